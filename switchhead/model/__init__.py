"""Model library: configs and presets, layers, the LM, resource accounting, checkpoints."""

from switchhead.model.checkpoint import load, save
from switchhead.model.config import PRESETS, ModelConfig, resolve_config
from switchhead.model.lm import TransformerLM

__all__ = ["PRESETS", "ModelConfig", "TransformerLM", "load", "resolve_config", "save"]
