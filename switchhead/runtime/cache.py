"""Fixed-window KV cache for Transformer-XL chunked attention (docs/MODEL.md).

Layout, per layer: K and V buffers ``[batch, heads, 2T, d_head]`` (T = chunk_len; heads = 1 for MoA), the
``past_key_values.{i}.key|value`` layout of ONNX graphs. The 2T slots are two halves of T slots: one half holds
the current chunk, the other the frozen memory chunk. When a row's current chunk is full, the halves swap roles
(the full chunk *is* the next memory), so a roll-over copies nothing and the buffers never grow or move.

Which half is current, how full it is and whether memory exists are tracked per row, so rows of a batch may be
at different points of their streams. Positions are assigned per row so that they equal the chunked forward's:
with memory, memory slots get 0..T-1 and the current chunk T..2T-1; without memory, the current chunk gets
0..T-1 (and the other half, which is then invalid, negative positions).

One step of ``t`` new token slots per row goes ``plan = cache.begin(counts, t)``, then for every layer
``cache.update(layer, k, v)`` (the `switchhead.model.lm.KVCache` protocol) or ``cache.write`` +
``cache.window``, then ``cache.commit()``. Row b contributes ``counts[b]`` real tokens in slots ``0..counts[b]-1``
of the step; the remaining slots are padding: never written, never visible, their logits meaningless.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from switchhead.devices import check_allocation, out_of_memory, resolve_device
from switchhead.errors import SwitchheadError, brief, is_int
from switchhead.model.accounting import kv_heads
from switchhead.model.config import ModelConfig


@dataclass(frozen=True)
class StepPlan:
    """Bookkeeping of one step, shared by every backend.

    pos_q [B, t]: positions of the step's token slots. pos_k [B, S], valid [B, S]: positions and validity of
    the buffer slots once this step's tokens are written (S = 2T). past_valid [B, S]: validity before writing
    (for graphs that attend over ``concat(past, new)``). new_mask [B, t]: which step slots are real tokens.
    slots [B, t]: buffer slot each real token is written to (-1 for padding).
    """

    pos_q: Tensor
    pos_k: Tensor
    valid: Tensor
    past_valid: Tensor
    new_mask: Tensor
    slots: Tensor
    counts: Tensor


class XLCache:
    """Preallocated per-layer K/V buffers plus per-row chunk bookkeeping (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, batch: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if not isinstance(cfg, ModelConfig):
            raise SwitchheadError(f"XLCache needs the model's ModelConfig, got {type(cfg).__name__}")
        if not isinstance(batch, numbers.Integral) or isinstance(batch, bool) or batch < 1:
            raise SwitchheadError(f"cache batch size must be an integer >= 1, got {batch!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SwitchheadError(f"cache dtype must be a floating-point torch.dtype, got {dtype!r}")
        batch = int(batch)
        self.cfg, self.batch, self.T = cfg, batch, cfg.chunk_len
        self.device = resolve_device(device)
        shape = (batch, kv_heads(cfg), 2 * self.T, cfg.d_head)
        what = f"the KV cache for {batch} sequence{'s' * (batch > 1)}"
        nbytes = 2 * cfg.n_layers * math.prod(shape) * dtype.itemsize
        check_allocation(nbytes, self.device, what)
        try:
            self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.n_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.n_layers)]
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e):
                raise
            raise SwitchheadError(f"{what} needs {nbytes} bytes ({nbytes / 2**30:,.4g} GiB), which could not be "
                                  f"allocated on {self.device}") from None
        self.fill = torch.zeros(batch, dtype=torch.long, device=self.device)  # tokens in the current chunk
        self.cur = torch.zeros(batch, dtype=torch.long, device=self.device)  # which half is current (0/1)
        self.has_mem = torch.zeros(batch, dtype=torch.bool, device=self.device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=self.device)  # tokens consumed per row
        self.plan: StepPlan | None = None
        self._slot = torch.arange(2 * self.T, device=self.device)
        self._uniform_slot: int | None = None

    def reset_row(self, b: int) -> None:
        """Start row `b` over as an empty stream (for servers that reuse rows). Its stale keys/values need no
        clearing: an empty, memory-less row marks every slot invalid (see `begin`)."""
        if not is_int(b) or not 0 <= b < self.batch:  # -1 would reset the last row, True/None every row
            raise SwitchheadError(f"row must be an integer in [0, {self.batch}), got {brief(b)}")
        if self.plan is not None:
            raise SwitchheadError("XLCache.reset_row inside a step (between begin and commit) would corrupt it; "
                                  "commit the step first")
        self.fill[b] = 0
        self.cur[b] = 0
        self.has_mem[b] = False
        self.seen[b] = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def room(self) -> Tensor:
        """Tokens each row can take in its next step without crossing a chunk boundary [B]."""
        return torch.where(self.fill >= self.T, self.T, self.T - self.fill)

    def begin(self, counts: Tensor | list[int], t: int | None = None) -> StepPlan:
        """Plan a step in which row b adds ``counts[b]`` tokens (step width ``t`` >= max count)."""
        if self.plan is not None:
            raise SwitchheadError("XLCache.begin called twice without commit")
        counts = self._counts(counts)
        t = int(counts.max()) if t is None else t
        if not is_int(t) or t < 1 or bool((counts < 0).any()) or int(counts.max()) > t:
            raise SwitchheadError(f"bad step: counts {counts.tolist()} with width {brief(t)} for batch {self.batch}")
        T = self.T
        # Lazy roll-over: a full chunk becomes the memory only once a row actually needs room, so a step
        # that exactly fills a chunk leaves the cache in the same state as the chunked forward leaves it.
        roll = (self.fill >= T) & (counts > 0)
        if bool(roll.any()):
            self.cur = torch.where(roll, 1 - self.cur, self.cur)
            self.fill = torch.where(roll, 0, self.fill)
            self.has_mem = torch.where(roll, torch.tensor(self.cfg.mem_chunks > 0, device=self.device),
                                       self.has_mem)
        if bool((self.fill + counts > T).any()):
            raise SwitchheadError(f"step crosses a chunk boundary: fill {self.fill.tolist()} + counts "
                                  f"{counts.tolist()} > chunk_len {T}; split it (see engine.feed)")
        base = torch.where(self.has_mem, T, 0)  # position of the current chunk's first slot
        j = torch.arange(t, device=self.device)
        pos_q = base[:, None] + self.fill[:, None] + j[None]
        in_cur = (self._slot[None] // T) == self.cur[:, None]  # [B, S]
        pos_k = base[:, None] + self._slot[None] % T - torch.where(in_cur, 0, T)
        offset = self._slot[None] % T
        past_valid = torch.where(in_cur, offset < self.fill[:, None], self.has_mem[:, None])
        valid = torch.where(in_cur, offset < (self.fill + counts)[:, None], self.has_mem[:, None])
        new_mask = j[None] < counts[:, None]
        slots = torch.where(new_mask, self.cur[:, None] * T + self.fill[:, None] + j[None], -1)
        # Fast path for the common lockstep case: every row writes the same contiguous slot range.
        self._uniform_slot = None
        if bool(new_mask.all()) and bool((slots == slots[:1]).all()):
            self._uniform_slot = int(slots[0, 0])
        self._rows, self._cols = new_mask.nonzero(as_tuple=True)
        self._dst = slots[self._rows, self._cols]
        self.plan = StepPlan(pos_q, pos_k, valid, past_valid, new_mask, slots, counts)
        return self.plan

    def _counts(self, counts: Tensor | list[int]) -> Tensor:
        """`counts` as a long tensor [batch] on the cache's device, if they are whole numbers (a float count was
        truncated)."""
        if isinstance(counts, Tensor):
            whole = not (counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool)
        else:
            whole = isinstance(counts, (list, tuple)) and all(is_int(c) for c in counts)
        if not whole or tuple(getattr(counts, "shape", (len(counts),))) != (self.batch,):
            raise SwitchheadError(f"bad step: counts must be {self.batch} integers (one per row), got {brief(counts)}")
        return torch.as_tensor(counts, dtype=torch.long, device=self.device)

    def _layer(self, layer: int) -> int:
        if not is_int(layer) or not 0 <= layer < len(self.keys):  # -1 would be the last layer, silently
            raise SwitchheadError(f"layer must be an integer in [0, {len(self.keys)}), got {brief(layer)}")
        return layer

    def write(self, layer: int, k_BGtd: Tensor, v_BGtd: Tensor) -> None:
        """Store this step's keys/values of `layer` ([B, heads, t, d_head]); padding slots are dropped."""
        p = self._planned("write")
        layer = self._layer(layer)
        if k_BGtd.shape[0] != self.batch or k_BGtd.shape[2] != p.pos_q.shape[1]:
            raise SwitchheadError(f"this step was planned for {self.batch} rows of {p.pos_q.shape[1]} tokens; got "
                                  f"{k_BGtd.shape[0]} rows of {k_BGtd.shape[2]}")
        kb, vb = self.keys[layer], self.values[layer]
        if self._uniform_slot is not None:
            s, t = self._uniform_slot, k_BGtd.shape[2]
            kb[:, :, s:s + t] = k_BGtd
            vb[:, :, s:s + t] = v_BGtd
            return
        kb[self._rows, :, self._dst] = k_BGtd[self._rows, :, self._cols].to(kb.dtype)
        vb[self._rows, :, self._dst] = v_BGtd[self._rows, :, self._cols].to(vb.dtype)

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        """The whole key window of `layer`, [B, heads, 2T, d_head] each."""
        layer = self._layer(layer)
        return self.keys[layer], self.values[layer]

    def update(self, layer: int, k: Tensor, v: Tensor):
        """`KVCache` protocol of `TransformerLM.decode`: k, v are [B, t, heads, d_head]."""
        p = self._planned("update")
        self.write(layer, k.transpose(1, 2), v.transpose(1, 2))
        kw, vw = self.window(layer)
        return kw.transpose(1, 2), vw.transpose(1, 2), p.pos_q, p.pos_k, p.valid

    def commit(self) -> None:
        p = self._planned("commit")
        self.fill = self.fill + p.counts
        self.seen = self.seen + p.counts
        self.plan = None

    def _planned(self, what: str) -> StepPlan:
        if self.plan is None:
            raise SwitchheadError(f"XLCache.{what} outside a step: call cache.begin(counts) first (see engine.feed)")
        return self.plan
