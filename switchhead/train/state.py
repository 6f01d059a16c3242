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

from switchhead.errors import CheckpointError, is_int
from switchhead.fileio import atomic_directory
from switchhead.model.checkpoint import save

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
    """Load an optimizer state split by `optimizer_to_flat`; a state that does not fit `opt` is a CheckpointError."""
    params = [p for g in opt.param_groups for p in g["params"]]
    try:
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            _, idx, name = key.split(".", 2)
            i = int(idx)
            if not 0 <= i < len(params):
                raise ValueError(f"{key} names parameter {i}, the model has {len(params)}")
            if value.dim() and value.shape != params[i].shape:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, the parameter {tuple(params[i].shape)}")
            state.setdefault(i, {})[name] = value
        for idx, values in meta["scalars"].items():
            state.setdefault(int(idx), {}).update(values)
        groups = meta["param_groups"]
        matches = len(groups) == len(opt.param_groups) and all(
            len(g["params"]) == len(h["params"]) for g, h in zip(groups, opt.param_groups)
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"optimizer state is malformed: {e}") from None
    if not matches:
        raise CheckpointError("optimizer state does not match the model's parameters")
    # load_state_dict moves state tensors to each parameter's device and dtype rules itself.
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state is malformed: {e}") from None


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
    """(state JSON, optimizer tensors, trainer tensors) of the checkpoint at `path`; the state JSON is checked
    to have the fields resuming reads (a CheckpointError otherwise)."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"training checkpoint {path / TRAINER_STATE} is unreadable: {e}") from None
    try:
        opt_tensors = load_file(str(path / OPTIMIZER))
        trainer_tensors = load_file(str(path / TRAINER_TENSORS))
    except (OSError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"training checkpoint {path} is unreadable: {e}") from None
    problem = _state_problem(state)
    if problem:
        raise CheckpointError(f"training checkpoint {path / TRAINER_STATE} is malformed: {problem}")
    return state, opt_tensors, trainer_tensors


def _state_problem(state) -> str | None:
    """What is wrong with a trainer_state.json object, or None."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    step = state.get("step")
    if not is_int(step) or step < 0:
        return f"'step' must be a non-negative integer, got {step!r}"
    opt = state.get("optimizer")
    if not isinstance(opt, dict):
        return "'optimizer' is missing or not an object"
    groups, scalars = opt.get("param_groups"), opt.get("scalars")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return "'optimizer.param_groups' must be a list of objects with 'params'"
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        return "'optimizer.scalars' must be an object of objects"
    if state.get("scaler") is not None and not isinstance(state["scaler"], dict):
        return "'scaler' must be an object or null"
    return None
