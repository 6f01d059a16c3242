"""The output directory of a training run, and what `--resume` reads from it.

Layout of ``--out DIR``:

- ``DIR/final/``: the finished model checkpoint (`switchhead.load` reads it), written at the last step.
- ``DIR/checkpoint/``: the latest training state (also a loadable model checkpoint); `--resume` starts here.
- ``DIR/run.json``: what defines the run (model config, data, tokenizer, optimisation settings); marks the
  directory as ours and is compared on `--resume`.
- ``DIR/tokenizer.model``: the tokenizer the run uses. ``DIR/metrics.jsonl``: one JSON object per log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from switchhead.errors import CheckpointError, SwitchheadError
from switchhead.fileio import check_creatable, check_writable, is_temporary, read_utf8, write_atomic
from switchhead.model.checkpoint import CONFIG, is_saved_checkpoint
from switchhead.model.checkpoint import load as load_checkpoint
from switchhead.model.config import ModelConfig
from switchhead.model.lm import TransformerLM
from switchhead.train.data import file_digest
from switchhead.train.state import (
    TRAINER_STATE,
    TRAINER_TENSORS,
    has_training_checkpoint,
    optimizer_from_flat,
    read_training_checkpoint,
)

if TYPE_CHECKING:
    from switchhead.train.loop import TrainOptions

RUN_FILE, TOKENIZER_FILE, METRICS_FILE = "run.json", "tokenizer.model", "metrics.jsonl"
FINAL_DIR, CHECKPOINT_DIR = "final", "checkpoint"
RUN_FORMAT = "switchhead-train/1"


def run_spec(opts: TrainOptions, config: ModelConfig, tok_fp: str, data: list[Path], world: int) -> dict:
    """What defines a run: resuming with any of these changed would not continue the same run."""
    return {
        "format": RUN_FORMAT,
        "model_config": config.to_dict(),
        "tokenizer_sha256": tok_fp,
        "data": [{"path": str(p.resolve()), "sha256": file_digest(p)} for p in data],
        "batch_size": opts.batch_size,
        "lr": opts.lr,
        "warmup": opts.warmup,
        "seed": opts.seed,
        "unwrap": opts.unwrap,
        "world_size": world,
        # Informational (not compared): lets `--resume` without flags continue with the same settings.
        "options": {k: getattr(opts, k) for k in _RESUMABLE}
        | {"cache_dir": opts.cache_dir and str(Path(opts.cache_dir).resolve())},  # the same cache from anywhere
        "eval_data": [str(Path(p).resolve()) for p in opts.eval_data],
    }


_RESUMABLE = (
    "steps",
    "batch_size",
    "grad_accum",
    "lr",
    "warmup",
    "grad_clip",
    "eval_every",
    "eval_batch_size",
    "save_every",
    "log_every",
    "seed",
    "vocab_size",
    "cache_dir",
    "unwrap",
    "device",
    "dtype",
)


def resume_defaults(out: str | Path) -> dict:
    """The options of the run recorded in `out` (for `--resume` without repeating every flag).

    A SwitchheadError when `out` holds no run: `--resume` has nothing to continue."""
    run_file = Path(out) / RUN_FILE
    if not run_file.is_file():
        raise _no_run_to_resume(Path(out))
    spec = _read_run_file(run_file)
    try:
        options = spec.get("options", {})
        return {
            **{k: options[k] for k in _RESUMABLE if k in options},  # a key of ours, not any the file holds
            "config": ModelConfig.from_dict(spec["model_config"], complete=True),
            "data": [d["path"] for d in spec["data"]],
            "eval_data": list(spec.get("eval_data", [])),
        }
    except (ValueError, KeyError, TypeError) as e:
        raise SwitchheadError(f"{run_file} is unreadable: {e!r}") from None


def _read_run_file(run_file: Path) -> dict:
    """The run record in `run_file`, if it is one."""
    text = read_utf8(run_file)
    try:
        spec = json.loads(text)
    except ValueError as e:
        raise SwitchheadError(f"{run_file} is unreadable: {e}") from None
    if not isinstance(spec, dict) or spec.get("format") != RUN_FORMAT:
        raise SwitchheadError(f"{run_file} is not a switchhead training run record")
    return spec


def _no_run_to_resume(out: Path) -> SwitchheadError:
    if not out.exists():
        return SwitchheadError(f"cannot resume: {out} does not exist, so there is no run to resume in it")
    return SwitchheadError(f"cannot resume: {out} holds no switchhead training run ({RUN_FILE} is missing)")


def _check_resumable(out: Path) -> None:
    """Refuse `--resume` unless OUT/checkpoint/ is there (a half-replaced one is pointed out, not repaired)."""
    ckpt_dir = out / CHECKPOINT_DIR
    if ckpt_dir.exists() and not ckpt_dir.is_dir():
        raise CheckpointError(f"cannot resume: {ckpt_dir} is not a directory")
    if ckpt_dir.is_dir():
        if not has_training_checkpoint(ckpt_dir):
            raise CheckpointError(
                f"cannot resume: {ckpt_dir} is not a training checkpoint ({TRAINER_STATE} is missing)"
            )
        return
    aside = sorted(
        (p for p in out.glob(f".{CHECKPOINT_DIR}.old-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    if aside:
        raise CheckpointError(
            f"cannot resume: {ckpt_dir} is missing but {aside[-1]} holds the previous checkpoint (a crash "
            f"interrupted its replacement); rename {aside[-1]} to {ckpt_dir} and resume again"
        )
    raise CheckpointError(f"cannot resume: {out} has no {CHECKPOINT_DIR}/ to resume from")


def check_out_dir(out: Path, resume: bool) -> dict | None:
    """Refuse directories we do not own; return the recorded run spec when resuming an existing run (and refuse
    --resume without a run and its checkpoint)."""
    if out.exists() and not out.is_dir():
        raise SwitchheadError(f"--out {out} exists and is not a directory")
    check_creatable(out, "--out")
    if out.is_dir():  # where the run writes, found out now rather than after the tokenizer and the token caches
        check_writable(out, f"--out {out}")
    run_file = out / RUN_FILE
    # A run killed while writing leaves the temporaries of its writers: they are neither a user's files nor a
    # checkpoint, so they neither forbid the directory nor make a run that never saved one resumable.
    entries = [p for p in out.iterdir() if not is_temporary(p.name)] if out.is_dir() else []
    if entries and not run_file.is_file():
        raise SwitchheadError(
            f"--out {out} is not empty and holds no switchhead training run; refusing to write into it"
        )
    if not run_file.is_file():
        if resume:
            raise _no_run_to_resume(out)
        return None
    spec = _read_run_file(run_file)
    # A run that stopped (diverged, was refused, crashed) before its first checkpoint left no weights: starting
    # it over there loses nothing a resume could use, and is what the divergence error tells the user to do.
    never_saved = all(p.name in (RUN_FILE, TOKENIZER_FILE, METRICS_FILE) and p.is_file() for p in entries)
    if not resume:
        if never_saved:
            return None
        raise SwitchheadError(
            f"--out {out} already holds a training run; pass --resume to continue it or "
            "choose another directory"
        )
    if never_saved:
        raise CheckpointError(
            f"cannot resume: the run in {out} stopped before its first checkpoint; run again without --resume "
            "to start it over"
        )
    _check_resumable(out)
    final = out / FINAL_DIR  # replaced at the end of the run: refused now rather than after the training
    if final.exists() and (not final.is_dir() or (any(final.iterdir()) and not is_saved_checkpoint(final))):
        raise SwitchheadError(f"cannot resume: {final} is not a switchhead checkpoint, and the run writes its "
                              "model there when it ends; move it away first")
    return spec


def _lock(out: Path, held: contextlib.ExitStack, shared: bool = False) -> bool:
    """Take the exclusive (or a shared) lock on `out` until `held` closes: False where locks are not supported, a
    SwitchheadError where another run holds it."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform
        return False
    fd = os.open(out, os.O_RDONLY)
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SwitchheadError(f"--out {out} is in use by another training run; wait for it to end or choose "
                              "another directory") from None
    except OSError:  # a file system without locks (some network ones): unguarded, as where there is no flock
        return False
    return True


def refuse_if_in_use(out: Path) -> None:
    """A SwitchheadError now, before any slow work, if another run holds `out`: that it is running is what to
    report, not what its files look like (run.json and no checkpoint yet: as if it had stopped before one).
    Shared, so that the processes of one run probing at once do not see each other."""
    if out.is_dir():
        with contextlib.ExitStack() as probe:
            _lock(out, probe, shared=True)


def lock_run_dir(out: Path, held: contextlib.ExitStack) -> None:
    """Hold an exclusive lock on the run directory `out` until `held` closes; a SwitchheadError if another run
    holds it. Two runs in one directory would overwrite each other's run.json, tokenizer and checkpoints, which
    --resume would then combine without noticing. Once it is held, no writer of another run can be at work in
    `out`: the temporaries there were left by killed ones, and are removed."""
    if not _lock(out, held):
        return
    for p in out.iterdir():
        if is_temporary(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif is_temporary(p.name):
            p.unlink(missing_ok=True)


def compare_specs(old: dict, new: dict) -> None:
    old = {"unwrap": False, **old}  # runs recorded before the option existed read their text verbatim
    # The tokenizer comes from the run when resuming, so a changed --vocab-size would be silently ignored.
    old_vocab = (old.get("options") or {}).get("vocab_size")
    if old_vocab is not None and old_vocab != new["options"]["vocab_size"]:
        raise SwitchheadError(
            f"cannot resume: vocab size changed since the run started ({old_vocab!r} -> "
            f"{new['options']['vocab_size']!r}); the run keeps its tokenizer"
        )
    for key in ("model_config", "tokenizer_sha256", "data", "batch_size", "lr", "warmup", "seed", "unwrap"):
        if key == "model_config":  # the name is a label, not part of the model (ModelConfig's == skips it too)
            detail = _changes(old.get(key) or {}, new[key], skip=("name",))
        elif old.get(key) == new.get(key):
            continue
        elif key == "data":
            detail = "the data files or their contents differ"
        else:
            detail = f"{old.get(key)!r} -> {new.get(key)!r}"
        if detail:
            raise SwitchheadError(
                f"cannot resume: {key.replace('_', ' ')} changed since the run started ({detail})"
            )


def _changes(a: dict, b: dict, skip: tuple[str, ...] = ()) -> str:
    """`key: a -> b` for every key whose value differs between the two config dicts."""
    keys = sorted(k for k in set(a) | set(b) if k not in skip and a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys)


def write_run_spec(out: Path, spec: dict) -> None:
    write_atomic(out / RUN_FILE, json.dumps(spec, indent=1))


def truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines past `step` (written by a run killed after its last checkpoint; they will be redone)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line torn by the kill
    write_atomic(path, "".join(k + "\n" for k in keep))


def read_resume_state(
    ckpt_dir: Path, model: TransformerLM, opt: torch.optim.Optimizer, config: ModelConfig, batch_size: int
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Load the weights and optimizer state of the training checkpoint into `model` and `opt`, validating
    every file first; return (state JSON, trainer tensors). Anything that does not fit the
    run is a CheckpointError naming what is wrong."""
    try:
        state, opt_tensors, trainer_tensors = read_training_checkpoint(ckpt_dir)
        # The validating model loader: a missing, corrupt or mis-shaped model.safetensors is refused with the
        # reason (and never half-loaded into `model`).
        saved, _ = load_checkpoint(ckpt_dir, device=next(model.parameters()).device, dtype=None)
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume: {e}") from None
    if saved.config != config:
        diff = _changes(saved.config.to_dict(), config.to_dict(), skip=("name",))
        raise CheckpointError(
            f"cannot resume: {ckpt_dir / CONFIG} does not match the run's model config (checkpoint -> run: {diff})"
        )
    mem = trainer_tensors.get("memory")
    # The previous chunk's layer inputs, as the model returned them: of its weights' dtype, chunk_len long.
    want, dtype = (config.n_layers, batch_size, config.chunk_len, config.d_model), next(model.parameters()).dtype
    if mem is not None and (tuple(mem.shape) != want or mem.dtype != dtype):
        raise CheckpointError(
            f"cannot resume: the memory in {ckpt_dir / TRAINER_TENSORS} is {str(mem.dtype)[6:]} of shape "
            f"{tuple(mem.shape)}, expected {str(dtype)[6:]} of shape {want}"
        )
    try:
        optimizer_from_flat(opt, opt_tensors, state["optimizer"])
    except CheckpointError as e:
        raise CheckpointError(f"cannot resume from {ckpt_dir}: {e}") from None
    model.load_state_dict(saved.state_dict())
    return state, trainer_tensors
