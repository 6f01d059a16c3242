"""Backends: the only part of generation that differs between PyTorch and (later) ONNX Runtime.

A backend turns token ids plus the cache into logits. Everything else -- cache bookkeeping (positions, chunk
roll-over, validity), sampling, stopping, detokenisation and batching -- lives in shared code
(`cache`, `sampling`, `engine`) and is reused unchanged.

Contract of ``Backend.forward(ids, cache)``, called after ``cache.begin`` and before ``cache.commit``:

- ``ids`` [B, t] int64; ``cache.plan`` says which of the t slots per row are real (``new_mask``).
- For every layer i, compute this step's K/V and store them with ``cache.write(i, k, v)`` (layout
  [B, heads, t, d_head]); attend over ``cache.window(i)`` ([B, heads, 2T, d_head]) with
  ``plan.pos_q`` / ``plan.pos_k`` / ``plan.valid``. A graph that instead attends over
  ``concat(past_key_values.i, new)`` gets the past from ``cache.window(i)`` before writing, uses
  ``plan.past_valid`` for the past part and ``plan.new_mask`` plus causality for the new part, and returns
  ``present.i`` = the new K/V, which the backend then passes to ``cache.write``.
- Return logits [B, t, vocab] (float32 or wider).

Scoring (evaluation, perplexity) calls ``Backend.logits(ids, state)`` on whole rows instead; its default runs
``forward`` through the cache, and a backend may override it with an equivalent faster path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from switchhead.errors import SwitchheadError
from switchhead.model.config import ModelConfig
from switchhead.model.lm import TransformerLM, check_batch, check_ids, eval_mode
from switchhead.runtime.cache import XLCache


class Backend(ABC):
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype

    def new_cache(self, batch: int) -> XLCache:
        return XLCache(self.config, batch, dtype=self.dtype, device=self.device)

    @abstractmethod
    def forward(self, ids: Tensor, cache: XLCache) -> Tensor:
        """Logits [B, t, vocab] of a planned step (see the module docstring)."""

    def logits(self, ids: Tensor, state: object | None = None) -> tuple[Tensor, object]:
        """Logits [B, t, vocab] of the rows `ids` [B, t] (any t) continuing the streams in `state` -- what the
        previous call returned, None for fresh streams -- and the state after them."""
        from switchhead.runtime.engine import feed  # the engine builds on backends, not the other way

        check_batch(ids)
        check_ids(ids, self.config.vocab_size, values=False)  # a float tensor's ids would be reported as values
        if state is not None and not isinstance(state, XLCache):
            raise SwitchheadError(f"state must be what this backend's logits returned, got {type(state).__name__}")
        if state is not None and state.cfg != self.config:
            raise SwitchheadError("state is a cache of another model configuration; pass what this backend's "
                                  "logits returned")
        cache = state if state is not None else self.new_cache(ids.shape[0])
        return torch.stack(feed(self, cache, ids.tolist(), keep="all")), cache


class TorchBackend(Backend):
    """Runs `TransformerLM.decode` (the same block code as training) against the cache."""

    def __init__(self, model: TransformerLM):
        if not isinstance(model, TransformerLM):
            raise SwitchheadError(f"TorchBackend needs a TransformerLM (e.g. load_checkpoint(path)), got "
                                  f"{type(model).__name__}")
        self.model = model  # left in its mode: each call runs in eval mode (no dropout) and restores it
        self.config = model.config

    # The model's, read at every use: a model moved (.to(), .half()) after the backend was made gets caches of
    # its new dtype and device.
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.inference_mode()
    def forward(self, ids: Tensor, cache: XLCache) -> Tensor:
        # The model memoises its relative-position tables in inference, so every step after the first
        # reuses them.
        k, p = cache.keys[0], next(self.model.parameters())
        if (k.dtype, k.device) != (p.dtype, p.device):
            raise SwitchheadError(f"the cache holds {k.dtype} on {k.device}; the model is now {p.dtype} on "
                                  f"{p.device}: start a new cache (backend.new_cache) after moving the model")
        with eval_mode(self.model):
            return self.model.decode(ids.to(p.device), cache)

    @torch.inference_mode()
    def logits(self, ids: Tensor, state: object | None = None) -> tuple[Tensor, object]:
        # The chunked training forward computes a whole chunk per layer call; equal to feeding the cache
        # (tested) and faster for long rows. Its chunks must start where the stream's do, so the state is the XL
        # memory at the last chunk boundary plus the ids after it: a call that ends inside a chunk has that part
        # computed again at the start of the next call (at most chunk_len - 1 tokens).
        check_batch(ids)
        if state is not None and not (isinstance(state, tuple) and len(state) == 2):
            raise SwitchheadError(f"state must be what this backend's logits returned, got {type(state).__name__}")
        memory, pending = state if state is not None else (None, None)
        ids = ids.to(self.device)
        if pending is not None:
            if pending.shape[0] != ids.shape[0]:
                raise SwitchheadError(f"the state continues {pending.shape[0]} rows, got ids for {ids.shape[0]}")
            ids = torch.cat([pending, ids], 1)
        cut = ids.shape[1] // self.config.chunk_len * self.config.chunk_len
        parts = []
        with eval_mode(self.model):
            if cut:
                whole, memory = self.model(ids[:, :cut], memory)
                parts.append(whole)
            if cut < ids.shape[1]:
                parts.append(self.model(ids[:, cut:], memory)[0])
        skip = 0 if pending is None else pending.shape[1]
        return torch.cat(parts, 1)[:, skip:], (memory, ids[:, cut:] if cut < ids.shape[1] else None)
