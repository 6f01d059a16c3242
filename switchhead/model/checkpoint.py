"""Checkpoints: a directory with config.json, model.safetensors and (optionally) tokenizer.model.

Written into a temporary sibling directory and renamed into place, so a crash never leaves a half-written
checkpoint; loaded with full validation and without unpickling anything.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from switchhead.devices import resolve_device
from switchhead.errors import CheckpointError, ConfigError
from switchhead.fileio import (
    as_path,
    atomic_directory,
    check_output_dir,
    file_problem,
    holds_only,
    read_utf8,
    require_dir,
    save_tensors,
)
from switchhead.model.config import ModelConfig
from switchhead.model.lm import TransformerLM
from switchhead.model.tokenizer import vocab_mismatch

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.model"
# The dtypes the model computes in (float8 and the like hold weights but have no arithmetic here).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = "float16, bfloat16, float32 or float64"
# The built-in default model ships as package data (half-precision weights; see docs/RESULTS.md).
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "default"


def resolve_checkpoint(path: str | Path | None) -> Path:
    """`path`, or the built-in default model when no path is given (None; an empty path is an error)."""
    if path is not None:
        if not isinstance(path, (str, Path)):
            raise CheckpointError(f"a checkpoint path must be a str or Path, got {type(path).__name__}")
        if not str(path):
            raise CheckpointError("the checkpoint path is empty; give a directory, or none for the built-in model")
        return Path(path)
    if not is_checkpoint(DEFAULT_CHECKPOINT):
        raise CheckpointError("no model given and the built-in default model is not installed: pass --ckpt DIR")
    return DEFAULT_CHECKPOINT


def is_checkpoint(path: str | Path) -> bool:
    p = as_path(path, "a checkpoint path", CheckpointError)
    return (p / CONFIG).is_file() and (p / WEIGHTS).is_file()


def save(path: str | Path, model: TransformerLM, tokenizer=None) -> Path:
    """Write `model` (and a SentencePiece tokenizer) as a checkpoint directory at `path`.

    Refuses to replace a non-empty directory that is not a checkpoint written here, so nothing unrelated is
    ever lost.
    """
    tensors = _savable(model, tokenizer)
    path = check_output_dir(as_path(path, "a checkpoint path", CheckpointError), is_saved_checkpoint,
                            "a switchhead checkpoint")
    with atomic_directory(path) as tmp:
        _write(tmp, model.config, tensors, tokenizer)
    return path


def write_model_files(directory: Path, model: TransformerLM, tokenizer=None) -> None:
    """A checkpoint's files, with the checks of `save`, written into an existing `directory` whose own atomic
    writer (a training checkpoint's) puts them in place: a write that fails then names the destination, not a
    temporary directory of its own."""
    _write(directory, model.config, _savable(model, tokenizer), tokenizer)


def _savable(model: TransformerLM, tokenizer) -> dict[str, torch.Tensor]:
    """The tensors to write, after every check that `load` would otherwise fail: a saved checkpoint can always be
    loaded."""
    if not isinstance(model, TransformerLM):
        raise CheckpointError(f"save needs a TransformerLM, got {type(model).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, spm.SentencePieceProcessor):
        raise CheckpointError("save needs a SentencePieceProcessor or None as tokenizer, got "
                              f"{type(tokenizer).__name__}")
    if tokenizer is not None and (problem := vocab_mismatch(tokenizer, model.config.vocab_size)):
        raise CheckpointError(f"the tokenizer {problem}")
    state = model.state_dict()
    # A submodule added to the model or a layer resized after construction would be saved, then refused by load.
    _check_weights(state, model.config, "cannot save: the model's state_dict")
    tensors, storages = {}, set()
    for k, v in state.items():
        if v.is_meta:
            raise CheckpointError(f"cannot save: tensor {k} is on the meta device and holds no values")
        v = v.detach().contiguous().cpu()
        # safetensors refuses tensors that share memory (weights a user tied, slices of one tensor): each is
        # written on its own and loads as an untied copy with the same values.
        if v.untyped_storage().data_ptr() in storages:
            v = v.clone()
        storages.add(v.untyped_storage().data_ptr())
        tensors[k] = v
    if (bad := _nonfinite(tensors)) is not None:
        raise CheckpointError(f"cannot save: tensor {bad} has NaN or infinite values")
    return tensors


def _write(directory: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer) -> None:
    (directory / CONFIG).write_text(config.to_json())
    save_tensors(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    if tokenizer is not None:
        (directory / TOKENIZER).write_bytes(tokenizer.serialized_model_proto())


def is_saved_checkpoint(path: Path) -> bool:
    """A checkpoint `save` wrote: its files only (a user's notes beside them would be lost), and a config.json
    of ours (other libraries' checkpoints also hold a config.json and a model.safetensors)."""
    if not holds_only(path, {CONFIG, WEIGHTS, TOKENIZER}, required={CONFIG, WEIGHTS}):
        return False
    try:
        read_config(path / CONFIG)
    except CheckpointError:
        return False
    return True


def load_config(path: str | Path) -> ModelConfig:
    path = as_path(path, "a checkpoint path", CheckpointError)
    require_dir(path, "checkpoint directory", CheckpointError)
    _require_file(path, CONFIG)
    return read_config(path / CONFIG)


def _require_file(path: Path, name: str) -> None:
    if problem := file_problem(path / name):
        problem = "missing" if problem == "not found" else problem
        raise CheckpointError(f"{path} is not a checkpoint: {name} is {problem}")


def read_config(file: Path) -> ModelConfig:
    """A config.json (of a checkpoint or an ONNX export), validated; its problems name the file."""
    text = read_utf8(file, CheckpointError)
    try:
        return ModelConfig.from_json(text, complete=True)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from None


def read_tokenizer(file: Path, config: ModelConfig):
    """The SentencePieceProcessor in `file` (None if there is none), which must have the model's vocab_size."""
    if problem := file_problem(file):
        if problem == "not found":
            return None
        raise CheckpointError(f"{file} is {problem}, not a tokenizer model")  # a damaged checkpoint, not one without
    import sentencepiece as spm

    tokenizer = spm.SentencePieceProcessor()
    try:
        tokenizer.LoadFromSerializedProto(file.read_bytes())
    except Exception as e:  # sentencepiece raises a bare RuntimeError/OSError on bad protos
        raise CheckpointError(f"{file} is corrupt: {e}") from None
    if problem := vocab_mismatch(tokenizer, config.vocab_size):
        raise CheckpointError(f"{file} {problem}")
    return tokenizer


def load(path: str | Path | None = None, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = torch.float32) -> tuple[TransformerLM, object | None]:
    """Load a checkpoint directory (default: the built-in model): (model in eval mode, SentencePieceProcessor or
    None).

    Weights are cast to `dtype` (float32 by default, so half-precision checkpoints run anywhere); pass
    None to keep the stored dtype."""
    device = resolve_device(device)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in DTYPES):
        raise CheckpointError(f"dtype must be a floating-point torch.dtype ({_DTYPE_NAMES}), or None for the "
                              f"stored one; got {dtype!r}")
    path = resolve_checkpoint(path)
    config = load_config(path)
    _require_file(path, WEIGHTS)
    try:
        # safetensors names the CPU "cpu" only: "cpu:0", a valid torch device, would read as a corrupt file.
        tensors = load_file(str(path / WEIGHTS), device="cpu" if device.type == "cpu" else str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path / WEIGHTS} is corrupt: {e}") from None
    with torch.device("meta"):
        model = TransformerLM(config)
    _check_weights(tensors, config, str(path / WEIGHTS), model)
    if dtype is None and len(stored := {t.dtype for t in tensors.values()}) > 1:
        # Kept as stored, the first matmul across two of them would fail with an error naming no file.
        raise CheckpointError(f"{path / WEIGHTS} mixes dtypes ({', '.join(sorted(str(d)[6:] for d in stored))}); "
                              "pass a dtype to load every weight as one")
    # A NaN or inf weight raises nothing later: every output is NaN, read as garbage text.
    if (bad := _nonfinite(tensors)) is not None:
        raise CheckpointError(f"{path / WEIGHTS}: tensor {bad} has NaN or infinite values")
    cast = {}
    if dtype is not None:
        cast = {k: v.to(dtype) for k, v in tensors.items() if v.dtype != dtype}
        if (bad := _nonfinite(cast)) is not None:
            raise CheckpointError(f"{path / WEIGHTS}: tensor {bad} overflows {str(dtype)[6:]}")
    if device.type == "cpu":
        # On the CPU the file's tensors are views into a memory map at arbitrary offsets. BLAS takes other code
        # paths (with other rounding) on unaligned data, so the model would not compute what the saved one did.
        cast = {k: cast[k] if k in cast else v.clone() for k, v in tensors.items()}
    tensors.update(cast)
    model.load_state_dict(tensors, assign=True)
    model.eval()
    return model, read_tokenizer(path / TOKENIZER, config)


def _check_weights(tensors: dict[str, torch.Tensor], config: ModelConfig, where: str,
                   model: TransformerLM | None = None) -> None:
    """A `CheckpointError` (its message starting with `where`) unless `tensors` are exactly the weights of a
    model built from `config` (`model`, on the meta device, if already built): names, shapes and dtypes."""
    if model is None:
        with torch.device("meta"):
            model = TransformerLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"] if extra else [])
        raise CheckpointError(f"{where} does not match its config: {'; '.join(parts)}")
    for k, shape in expected.items():
        if tensors[k].shape != shape:
            raise CheckpointError(f"{where}: tensor {k} has shape {tuple(tensors[k].shape)}, "
                                  f"config expects {tuple(shape)}")
        if tensors[k].dtype not in DTYPES:  # every weight of the model is floating-point
            raise CheckpointError(f"{where}: tensor {k} has dtype {str(tensors[k].dtype)[6:]}, the model "
                                  f"expects a floating-point dtype ({_DTYPE_NAMES})")


def _nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, or None."""
    return next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
