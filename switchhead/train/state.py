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
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from switchhead.errors import CheckpointError, brief, is_finite_number, is_int
from switchhead.fileio import atomic_directory, save_tensors
from switchhead.model.checkpoint import CONFIG, TOKENIZER, WEIGHTS, write_model_files

OPTIMIZER, TRAINER_TENSORS, TRAINER_STATE = (
    "optimizer.safetensors",
    "trainer.safetensors",
    "trainer_state.json",
)
_FILES = {CONFIG, WEIGHTS, TOKENIZER, OPTIMIZER, TRAINER_TENSORS, TRAINER_STATE}
# What Adam and AdamW keep for every parameter they have updated (and "max_exp_avg_sq" with amsgrad): without one,
# a resumed run fails in its first step.
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_STATE_KEY = re.compile(r"state\.(\d+)\.(\w+)")


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
    """Load an optimizer state split by `optimizer_to_flat`; a state that does not fit `opt`, or that its `step`
    could not use, is a CheckpointError naming the file and what is wrong."""
    if problem := _optimizer_meta_problem(meta):
        raise CheckpointError(f"{TRAINER_STATE} is malformed: {problem}")
    params = [p for g in opt.param_groups for p in g["params"]]
    groups = meta["param_groups"]
    if len(groups) != len(opt.param_groups) or any(
        len(g["params"]) != len(h["params"]) for g, h in zip(groups, opt.param_groups)
    ):
        raise CheckpointError("optimizer state does not match the model's parameters")
    # torch maps saved state to parameters through these numbers; its state_dict numbers them in order.
    if [i for g in groups for i in g["params"]] != list(range(len(params))):
        raise CheckpointError(f"{TRAINER_STATE} is malformed: the optimizer's param_groups must number its "
                              f"{len(params)} parameters 0 to {len(params) - 1} in order")
    for n, (saved, live) in enumerate(zip(groups, opt.param_groups)):
        if problem := _group_problem(saved, live):
            raise CheckpointError(f"{TRAINER_STATE} is malformed: optimizer.param_groups[{n}].{problem}")
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        m = _STATE_KEY.fullmatch(key)
        if not m or int(m[1]) >= len(params):
            raise CheckpointError(f"{OPTIMIZER} does not match the model: it holds {key}, the model has "
                                  f"{len(params)} parameters")
        if not value.is_floating_point():
            raise CheckpointError(f"{OPTIMIZER} is malformed: {key} is {str(value.dtype)[6:]}, not floating-point")
        state.setdefault(int(m[1]), {})[m[2]] = value
    for idx, values in meta["scalars"].items():
        if not idx.isdigit() or int(idx) >= len(params):
            raise CheckpointError(f"{TRAINER_STATE} is malformed: optimizer.scalars has an entry {idx!r} for no "
                                  "parameter")
        state.setdefault(int(idx), {}).update(values)
    group_of = [n for n, g in enumerate(groups) for _ in g["params"]]
    for i, st in state.items():
        if problem := _param_state_problem(opt, st, params[i], groups[group_of[i]]):
            also = f" (with {TRAINER_STATE}'s optimizer.scalars)" if str(i) in meta["scalars"] else ""
            raise CheckpointError(f"{OPTIMIZER}{also} is malformed: parameter {i} {problem}")
    # The checks above cover what AdamW reads; this is for what they cannot foresee in torch's own loader.
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state is malformed: {e}") from None


def _group_problem(saved: dict, live: dict) -> str | None:
    """What is wrong with a saved param group's hyperparameters, judged by the kind of each of `live`'s (the
    group of the run's own optimizer); None if nothing. torch fills in flags a group lacks, not numbers."""
    for key, want in live.items():
        flag = want is None or isinstance(want, bool)
        if key == "params" or (flag and key not in saved):
            continue
        v = saved.get(key)
        if flag and not (isinstance(v, bool) or (want is None and v is None)):
            return f"{key} must be true or false{' or null' if want is None else ''}, got {brief(v)}"
        if isinstance(want, (tuple, list)) and not (  # AdamW's betas: 1 divides by zero in the bias correction
            isinstance(v, (tuple, list)) and len(v) == len(want) and all(is_finite_number(b) and 0 <= b < 1 for b in v)
        ):
            return f"{key} must be {len(want)} numbers in [0, 1), got {brief(v)}"
        if is_finite_number(want) and not (is_finite_number(v) and v >= 0):
            return f"{key} must be a finite number >= 0, got {brief(v)}"
    return None


def _param_state_problem(opt: torch.optim.Optimizer, st: dict, param: torch.Tensor, group: dict) -> str | None:
    """What is wrong with one parameter's saved state (completed as in a parameter group `group`), or None."""
    for name, value in st.items():
        if torch.is_tensor(value) and value.dim() and value.shape != param.shape:
            return f"has {name} of shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    need = _ADAM_STATE + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if missing := [n for n in need if n not in st]:
        return f"has no {', '.join(missing)} (AdamW keeps {', '.join(need)} for every parameter it has updated)"
    step = st["step"]
    if torch.is_tensor(step) and step.dim():
        return f"has a step of shape {tuple(step.shape)}, not a single number"
    step = step.item() if torch.is_tensor(step) else step
    if not is_finite_number(step) or step < 0:
        return f"has a step of {brief(step)}, not a number >= 0"
    for name in need[1:]:
        if not torch.is_tensor(st[name]) or st[name].shape != param.shape:
            return f"has {name} {brief(st[name])}, not a tensor of the parameter's shape {tuple(param.shape)}"
        if name != "exp_avg" and bool((st[name] < 0).any()):  # their square roots are AdamW's denominators
            return f"has negative values in {name}"
    return None


def write_training_checkpoint(
    path: Path, model, tokenizer, opt, state: dict, trainer_tensors: dict[str, torch.Tensor]
) -> None:
    """Write the whole training checkpoint at `path` atomically (a crash keeps the previous one intact). Refused,
    keeping the previous one, where `path` holds files of someone else's, which replacing it would delete."""
    if problem := _foreign_files(path):
        raise CheckpointError(f"cannot save the checkpoint of step {state.get('step')}: {problem}, then --resume "
                              "from the previous one, which it still holds")
    opt_tensors, opt_meta = optimizer_to_flat(opt)
    with atomic_directory(path) as tmp:
        write_model_files(tmp, model, tokenizer)  # the model checkpoint's writer: its format stays in one place
        save_tensors(opt_tensors, tmp / OPTIMIZER)
        save_tensors({k: v.detach().contiguous().cpu() for k, v in trainer_tensors.items()}, tmp / TRAINER_TENSORS)
        (tmp / TRAINER_STATE).write_text(json.dumps({**state, "optimizer": opt_meta}, indent=1))


def has_training_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file()


def _foreign_files(path: Path) -> str | None:
    """Why `path` cannot be replaced by a training checkpoint: it holds more than one's files; None if it can."""
    path = Path(path)
    if not path.is_dir():
        return None  # nothing there yet; a file in the way is for atomic_directory to refuse
    other = sorted(p.name + ("" if p.is_file() else "/") for p in path.iterdir()
                   if p.name not in _FILES or not p.is_file())
    if not other:
        return None
    listed = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
    return (f"{path} holds {listed}, not part of a training checkpoint; every save replaces the whole directory, "
            "which would delete them: move them elsewhere")


def read_training_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state JSON, optimizer tensors, trainer tensors) of the checkpoint at `path`; the state JSON is checked
    to have the fields resuming reads, and the tensors to be finite (a CheckpointError otherwise). A `path` the
    next save could not replace without deleting a user's files is refused here already, before any training."""
    if problem := _foreign_files(path):
        raise CheckpointError(problem)
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
    # As model.safetensors: NaN moments or memory would only show later, as a diverged run blamed on --lr.
    for name, tensors in ((OPTIMIZER, opt_tensors), (TRAINER_TENSORS, trainer_tensors)):
        bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:
            raise CheckpointError(f"training checkpoint {path / name} is corrupt: tensor {bad} has NaN or infinite "
                                  "values")
    return state, opt_tensors, trainer_tensors


def _state_problem(state) -> str | None:
    """What is wrong with a trainer_state.json object, or None."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    step = state.get("step")
    if not is_int(step) or step < 0:
        return f"'step' must be a non-negative integer, got {step!r}"
    if problem := _optimizer_meta_problem(state.get("optimizer")):
        return problem
    interval = state.get("log_interval_by_rank")
    if interval is not None and not isinstance(interval, list):
        return f"'log_interval_by_rank' must be a list, got {brief(interval)}"
    for r, entry in enumerate(interval or []):
        if not isinstance(entry, dict):
            return f"'log_interval_by_rank[{r}]' must be an object, got {brief(entry)}"
        for key in ("losses", "grad_norms"):
            # NaN and inf included: an fp16 step the grad scaler skipped has an infinite gradient norm.
            values = entry.get(key, [])
            if not isinstance(values, list) or not all(
                isinstance(v, float) or (is_int(v) and is_finite_number(v)) for v in values
            ):
                return f"'log_interval_by_rank[{r}].{key}' must be a list of numbers, got {brief(values)}"
    if state.get("scaler") is not None and not isinstance(state["scaler"], dict):
        return "'scaler' must be an object or null"
    return None


def _optimizer_meta_problem(opt) -> str | None:
    """What is wrong with the 'optimizer' object of trainer_state.json, or None."""
    if not isinstance(opt, dict):
        return "'optimizer' is missing or not an object"
    groups, scalars = opt.get("param_groups"), opt.get("scalars")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        return "'optimizer.param_groups' must be a list of objects with 'params'"
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        return "'optimizer.scalars' must be an object of objects"
    return None
