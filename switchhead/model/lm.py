"""The language model: embedding, pre-LN blocks with XL memory, final LN, output layer."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from switchhead.devices import out_of_memory
from switchhead.errors import ConfigError, SwitchheadError
from switchhead.model.accounting import cache_layout
from switchhead.model.config import ModelConfig
from switchhead.model.layers import Block, SigmaMoE


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the duration, then every submodule's own mode back: inference, validation or
    export of a model being trained must not switch its dropout off for good, nor on where its trainer froze it.
    A model whose root is in eval mode is taken as wholly in eval mode (as `eval()` leaves it): then nothing is
    done, not even a walk over the modules, which costs ~80 us per decode step on a small CPU."""
    training = [m for m in model.modules() if m.training] if model.training else []
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def check_ids(ids: Tensor | Sequence[Sequence[int]], vocab_size: int, values: bool = True) -> None:
    """A `SwitchheadError` unless every token id indexes the vocabulary: out of range, PyTorch's embedding
    raises a bare IndexError and ONNX Runtime's Gather silently wraps negative ids around. With values=False
    only a tensor's dtype is checked (the range needs a host sync on a GPU)."""
    if isinstance(ids, Tensor):
        if ids.dtype not in (torch.int64, torch.int32):  # the embedding's index kinds
            raise SwitchheadError(f"token ids must be an integer tensor, got {ids.dtype} (int64 or int32 are taken)")
        bad = None
        if values and ids.numel():
            lo, hi = ids.min().item(), ids.max().item()
            bad = lo if lo < 0 else hi if hi >= vocab_size else None
    else:
        bad = next((t for row in ids for t in row
                    if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SwitchheadError(f"token id {bad!r} is outside the vocabulary [0, {vocab_size})")


def check_batch(input_ids: Tensor) -> None:
    """Rows of token ids: [batch, tokens], both at least 1."""
    if not isinstance(input_ids, Tensor):
        raise SwitchheadError(f"input_ids must be a tensor [batch, tokens], got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise SwitchheadError(f"input_ids must be [batch, tokens] with batch, tokens >= 1, got "
                              f"{tuple(input_ids.shape)}")


class KVCache(Protocol):
    """What `TransformerLM.decode` needs from a cache (implemented by the runtime)."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """Store the new keys/values of `layer`; return the whole key window (k, v), the new tokens' positions
        pos_q [B, T], the window's positions pos_k [B, S] and its validity mask [B, S] (or None)."""
        ...


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"TransformerLM needs a ModelConfig (e.g. PRESETS[name]), got {type(config).__name__}")
        self.config = config
        try:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.out = nn.Linear(config.d_model, config.vocab_size)
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            from switchhead.model.accounting import count_params

            total, dtype = count_params(config)["total"], torch.get_default_dtype()
            raise ConfigError(f"a model of this config has {total:,} parameters, which could not be allocated "
                              f"({total * dtype.itemsize / 2**30:,.4g} GiB in {dtype})") from None
        self.drop = nn.Dropout(config.dropout)
        self._aux: Tensor | None = None
        self._sigma_moe = [m for m in self.modules() if isinstance(m, SigmaMoE)]  # found once, not per forward

    def __getstate__(self) -> dict:
        # As `SigmaMoE.__getstate__`: copy.deepcopy after a training forward copies the aux loss, not its graph.
        return {**super().__getstate__(), "_aux": None if self._aux is None else self._aux.detach()}

    def forward(self, input_ids: Tensor, memory: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits [B, T, vocab] and the memory for the next chunk of the same streams.

        `memory` is [n_layers, B, M, d_model]: the (detached) layer inputs of the previous chunk, as returned by
        the previous call, or None. Inputs longer than `chunk_len` are processed chunk by chunk, exactly as in
        training; the returned memory is then that of the last chunk. Without memory (mem_chunks=0) chunks are
        independent and None is returned.
        """
        cfg = self.config
        check_batch(input_ids)
        # The range check is a host sync on a GPU: not paid per training step there (inference pays it). Under
        # torch.compile it would be a data-dependent branch, i.e. a graph break, so compiled code skips it.
        values = (input_ids.device.type == "cpu" or not self.training) and not torch.compiler.is_compiling()
        check_ids(input_ids, cfg.vocab_size, values=values)
        if memory is not None and cfg.mem_chunks == 0:
            memory = None
        if memory is not None:
            self._check_memory(memory, input_ids.shape[0])
            if torch.is_grad_enabled() and not torch.compiler.is_compiling() and memory.is_inference():
                # Memory returned under inference mode (as generation runs): autograd refuses to save inference
                # tensors, and LN1 saves its input. A plain copy carries the same (detached) values.
                memory = memory.clone()
        logits, aux = [], []
        for chunk in input_ids.split(cfg.chunk_len, dim=1):  # checked once above, not per chunk
            out, memory = self._chunk(chunk, memory)
            logits.append(out)
            aux.append(self._aux_terms())
        # Each chunk's regulariser, averaged: the scale one chunk per training step gives it.
        self._aux = torch.stack(aux).mean() if len(aux) > 1 and aux[0] is not None else aux[0]
        return (logits[0] if len(logits) == 1 else torch.cat(logits, 1)), memory

    def _check_memory(self, memory: Tensor, batch: int) -> None:
        cfg, want = self.config, self.embed.weight
        if not isinstance(memory, Tensor) or memory.dim() != 4 or memory.shape[0] != cfg.n_layers or \
                memory.shape[1] != batch or memory.shape[3] != cfg.d_model:
            raise SwitchheadError(f"memory has shape {tuple(getattr(memory, 'shape', ()))}; expected "
                                  f"[{cfg.n_layers}, {batch}, M, {cfg.d_model}]")
        if memory.dtype != want.dtype or memory.device != want.device:
            raise SwitchheadError(f"memory is {memory.dtype} on {memory.device}; the model is {want.dtype} on "
                                  f"{want.device} (pass back the memory a previous call returned)")

    def _chunk(self, input_ids: Tensor, memory: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One chunk of at most chunk_len tokens, its inputs already checked."""
        x = self.drop(self.embed(input_ids))
        new_memory = []
        for i, block in enumerate(self.blocks):
            if self.config.mem_chunks:
                new_memory.append(x.detach())
            x = block(x, None if memory is None else memory[i])
        return self.out(self.drop(self.ln_f(x))), torch.stack(new_memory) if new_memory else None

    def decode(self, input_ids: Tensor, cache: KVCache) -> Tensor:
        """Logits for new tokens given a KV cache that holds everything before them (see `KVCache`). A cache that
        carries the config it was made for as `cfg` (the runtime's XLCache) must have been made for this model's
        layout: one of another chunk length or memory would give wrong logits without any error."""
        if not callable(getattr(cache, "update", None)):
            raise SwitchheadError(f"decode needs a KV cache (e.g. switchhead.runtime.cache.XLCache), got "
                                  f"{type(cache).__name__}")
        made_for = getattr(cache, "cfg", None)  # the engine's caches carry this very config: no comparison per step
        if isinstance(made_for, ModelConfig) and made_for is not self.config and \
                cache_layout(made_for) != cache_layout(self.config):
            names = "layers, K/V heads, d_head, chunk_len, memory"
            raise SwitchheadError(f"the cache was made for another model ({names}: {cache_layout(made_for)}; this "
                                  f"model: {cache_layout(self.config)}); make one with this model's config")
        check_batch(input_ids)
        # Id values are checked where that costs no host sync; the engine has checked them on the host anyway.
        values = input_ids.device.type == "cpu" and not torch.compiler.is_compiling()  # as in forward
        check_ids(input_ids, self.config.vocab_size, values=values)
        x = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            h = block.ln1(x)
            k, v, pos_q, pos_k, valid = cache.update(i, *block.attn.kv(h))
            # once: every layer's buffers have one dtype and device (attention would fail with a bare matmul error)
            if i == 0 and (k.dtype != h.dtype or k.device != h.device):
                raise SwitchheadError(f"the cache holds {k.dtype} on {k.device}; the model computes {h.dtype} on "
                                      f"{h.device}: make the cache with the model's dtype and device")
            x = block.finish(x, h, k, v, pos_q, pos_k, valid)
        return self.out(self.ln_f(x))

    def aux_loss(self) -> Tensor:
        """Auxiliary loss of the last forward (sigma-MoE entropy regularisers, coefficients applied; the mean over
        its chunks when it ran several)."""
        return self._aux if self._aux is not None else self.out.bias.new_zeros(())

    def _aux_terms(self) -> Tensor | None:
        terms = [m.last_aux for m in self._sigma_moe if m.last_aux is not None]
        return torch.stack(terms).sum() if terms else None

    def record_attention(self, on: bool = True) -> None:
        """Keep each layer's attention probabilities and expert choices of the next forward in
        `block.attn.last_probs` / `block.attn.last_routes` (see `AttentionBase`)."""
        if not isinstance(on, bool):  # "no" would switch recording on
            raise SwitchheadError(f"record_attention takes True or False, got {on!r}")
        for block in self.blocks:
            block.attn.record = on
            block.attn.last_probs = None
            block.attn.last_routes = {}
