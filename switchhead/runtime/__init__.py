"""Inference runtime: KV cache with XL memory, backends, sampling and the generation loop."""

from switchhead.runtime.backends import Backend, TorchBackend
from switchhead.runtime.cache import StepPlan, XLCache
from switchhead.runtime.engine import Detokenizer, Generation, Generator, StopText, feed
from switchhead.runtime.sampling import SamplingParams

__all__ = ["Backend", "Detokenizer", "Generation", "Generator", "SamplingParams", "StepPlan", "StopText",
           "TorchBackend", "XLCache", "feed"]
