"""switchhead: train, run, export and evaluate SwitchHead language models (Csordás et al., NeurIPS 2024)."""

from switchhead.errors import CheckpointError, ConfigError, SwitchheadError
from switchhead.model import PRESETS, ModelConfig, TransformerLM, load, resolve_config, save

__version__ = "0.1.0"
__all__ = ["PRESETS", "CheckpointError", "ConfigError", "ModelConfig", "SwitchheadError", "TransformerLM", "load",
           "resolve_config", "save"]
