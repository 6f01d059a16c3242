"""Training-state checkpoints: the model checkpoint plus everything `--resume` needs, as safetensors + JSON.

Layout of ``OUT/checkpoint`` (one directory, replaced atomically as a whole):

- ``config.json``, ``model.safetensors``, ``tokenizer.model``: a regular model checkpoint (`switchhead.load`).
- ``optimizer.safetensors``: every tensor of the optimizer state, keyed ``state.<param index>.<name>``.
- ``trainer.safetensors``: the XL memory of every lane (``memory``) and each rank's RNG states.
- ``trainer_state.json``: step, data position, optimizer param groups and scalar state, grad-scaler state.

Nothing is pickled: resuming never executes code from the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from switchhead.errors import CheckpointError
from switchhead.model.checkpoint import atomic_directory, save

OPTIMIZER, TRAINER_TENSORS, TRAINER_STATE = (
    "optimizer.safetensors",
    "trainer.safetensors",
    "trainer_state.json",
)


def optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON-able rest."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, values in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(values)
    groups = meta["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        len(g["params"]) != len(h["params"]) for g, h in zip(groups, opt.param_groups)
    ):
        raise CheckpointError("optimizer state does not match the model's parameters")
    # load_state_dict moves state tensors to each parameter's device and dtype rules itself.
    opt.load_state_dict({"state": state, "param_groups": groups})


def write_training_checkpoint(
    path: Path, model, tokenizer, opt, state: dict, trainer_tensors: dict[str, torch.Tensor]
) -> None:
    """Write the whole training checkpoint at `path` atomically (a crash keeps the previous one intact)."""
    opt_tensors, opt_meta = optimizer_to_flat(opt)
    with atomic_directory(path) as tmp:
        # Reuse the model checkpoint writer so the format stays in one place; it writes into its own
        # directory, whose files then move up next to ours.
        sub = tmp / "model"
        save(sub, model, tokenizer)
        for f in sub.iterdir():
            os.replace(f, tmp / f.name)
        shutil.rmtree(sub)
        save_file(opt_tensors, str(tmp / OPTIMIZER))
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in trainer_tensors.items()}, str(tmp / TRAINER_TENSORS)
        )
        (tmp / TRAINER_STATE).write_text(json.dumps({**state, "optimizer": opt_meta}, indent=1))


def has_training_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file()


def read_training_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state JSON, optimizer tensors, trainer tensors) of the checkpoint at `path`."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        opt_tensors = load_file(str(path / OPTIMIZER))
        trainer_tensors = load_file(str(path / TRAINER_TENSORS))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"training checkpoint {path} is unreadable: {e}") from None
    return state, opt_tensors, trainer_tensors
