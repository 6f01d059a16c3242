"""switchhead: train, run, export and evaluate SwitchHead language models (Csordás et al., NeurIPS 2024)."""

import importlib
from typing import TYPE_CHECKING

from switchhead.errors import CheckpointError, ConfigError, SwitchheadError

if TYPE_CHECKING:
    from switchhead.model import PRESETS, ModelConfig, TransformerLM, load, resolve_config, save

__version__ = "0.1.0"
__all__ = ["PRESETS", "CheckpointError", "ConfigError", "ModelConfig", "SwitchheadError", "TransformerLM", "load",
           "resolve_config", "save"]
_FROM_MODEL = {"PRESETS", "ModelConfig", "TransformerLM", "load", "resolve_config", "save"}
_SUBPACKAGES = {"model", "kernels", "runtime", "export", "evals", "train", "serve"}


def __getattr__(name: str):
    # Imported on first use, not with the package: `switchhead --help` and the CLI's start need no torch, and a
    # Ctrl-C while torch loads then reaches the CLI's handler (one line) rather than the interpreter (a traceback).
    if name in _FROM_MODEL:
        return getattr(importlib.import_module("switchhead.model"), name)
    if name in _SUBPACKAGES:  # `import switchhead` then `switchhead.model.X`, as when the package loaded them all
        return importlib.import_module(f"switchhead.{name}")
    raise AttributeError(f"module 'switchhead' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_MODEL, *_SUBPACKAGES})
