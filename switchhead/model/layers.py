"""Attention variants (SwitchHead, dense relative XL, MoA), feed-forward variants (dense, sigma-MoE), pre-LN block.

Every attention module exposes the same two halves so that the LM's chunked forward and the runtime's cached
decoding run the same code:

- ``kv(src_BSD) -> (k_BSGd, v_BSGd)``: keys and values of the source tokens (V after its expert mix), i.e.
  exactly what a KV cache stores;
- ``attend(x_BTD, k, v, pos_q_BT, pos_k_BS, valid_BS) -> y_BTD``: queries of the destination tokens against
  those keys. Positions are indices in the key window; query t sees key s iff pos_k <= pos_q and valid.
  XL relative positions use the distance pos_q - pos_k, which must lie in [0, S).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from switchhead.devices import autocast_off
from switchhead.kernels.ops import project
from switchhead.model.config import ModelConfig


def wide(t: Tensor) -> Tensor:
    """At least float32 (float64 is kept): a half-precision model run without autocast gets its routing and
    attention logits in float32. Under autocast the einsums recast their inputs to the autocast dtype, as usual in
    mixed precision; only `routing_logits` switches autocast off, since there a rounded logit flips a choice."""
    return t if t.dtype == torch.float64 else t.float()


def sinusoids(n: int, d: int, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Transformer-XL sinusoidal embedding of the distances 0..n-1: [n, d]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=device, dtype=dtype) / d))
    angles = torch.arange(n, device=device, dtype=dtype)[:, None] * inv_freq[None]
    return torch.cat([angles.sin(), angles.cos()], -1)[:, :d]


def apply_rope(x_BTHd: Tensor, pos_BT: Tensor) -> Tensor:
    """Rotary embedding (rotate-half, base 10000) on the first half of each head's channels."""
    rot = x_BTHd.shape[-1] // 2
    dtype = wide(x_BTHd).dtype
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=x_BTHd.device, dtype=dtype) / rot))
    angles = pos_BT.to(dtype)[..., None] * inv_freq  # [B, T, rot/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, :, None].to(x_BTHd.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, :, None].to(x_BTHd.dtype)
    xr, rest = x_BTHd[..., :rot], x_BTHd[..., rot:]
    half = torch.cat([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
    return torch.cat([xr * cos + half * sin, rest], -1)


def init_(w: Tensor, fan_in: int, n_layers: int) -> Tensor:
    """The paper's pre-LN init: N(0, sqrt(2 / n_layers) / sqrt(fan_in))."""
    return nn.init.normal_(w, 0.0, math.sqrt(2 / n_layers) / math.sqrt(fan_in))


def moe_project(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """The expert projection op; under autocast it computes in the autocast dtype, as F.linear does (custom ops
    are not cast by autocast on their own)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        gate = None if gate is None else gate.to(dtype)
    return project(x, weight, index, gate, n_out)


def routing_logits(x_ND: Tensor, w_sel: Tensor) -> Tensor:
    """Selection logits in (at least) float32, autocast or not: low-precision logits flip top-k choices."""
    with autocast_off(x_ND.device.type):
        return F.linear(wide(x_ND), wide(w_sel))


def select_topk(x_ND: Tensor, w_sel: Tensor, n_groups: int, k: int) -> tuple[Tensor, Tensor]:
    """Non-competitive routing: per group, top-k of sigmoid(x W_sel) over its experts; the gate is the sigmoid
    value itself (no renormalisation). Returns global expert ids (group g owns g*E..g*E+E-1) and gates, [N, G*k].
    Computed in float32 as in the paper. The choice ranks the logits, which the sigmoid orders alike: its float32
    values saturate (every logit above ~17 rounds to 1.0), and a tie would go to the lower expert index."""
    logits = routing_logits(x_ND, w_sel).view(x_ND.shape[0], n_groups, -1)
    top, idx = logits.topk(k, dim=-1, sorted=False)
    idx = idx + torch.arange(n_groups, device=idx.device)[:, None] * logits.shape[-1]
    return idx.flatten(1), torch.sigmoid(top).flatten(1)


def _autocast_dtype(device) -> torch.dtype | None:
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def window_positions(m: int, t: int, device=None) -> tuple[Tensor, Tensor]:
    """Query and key positions [1, T], [1, M+T] for T tokens after M memory tokens."""
    pos_k = torch.arange(m + t, device=device)[None]
    return pos_k[:, m:], pos_k


class AttentionBase(nn.Module):
    """Shared score/softmax/mix step; subclasses define projections and positional terms."""

    # When True, the last forward's attention probabilities [B, H, T, S] are kept in `last_probs` and its expert
    # choices in `last_routes`: {"v": (experts, gates), "o": (...)} with experts/gates [B, tokens, H, k] (expert
    # ids local to the head; "v" covers the key window, memory included, "o" the queries).
    record: bool = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.last_probs: Tensor | None = None
        self.last_routes: dict[str, tuple[Tensor, Tensor]] = {}

    def _record_route(self, side: str, idx: Tensor, gate: Tensor, b: int, n_groups: int, n_experts: int) -> None:
        if self.record:
            local = idx.view(b, -1, n_groups, idx.shape[-1] // n_groups) % n_experts
            self.last_routes[side] = (local.detach(), gate.view(local.shape).detach())

    def forward(self, x_BTD: Tensor, mem_BMD: Tensor | None = None) -> Tensor:
        src = x_BTD if mem_BMD is None else torch.cat([mem_BMD, x_BTD], 1)
        k, v = self.kv(src)
        return self.attend(x_BTD, k, v, *window_positions(src.shape[1] - x_BTD.shape[1], x_BTD.shape[1], x_BTD.device))

    pos_scale: float = 1.0

    def rel_pos(self, n: int, device=None) -> Tensor:
        """Projected relative-position embeddings of distances 0..n-1: [n, G, dh] (XL only).

        In inference the table is memoised: cached decoding asks for the same 2T distances at every step, and
        recomputing them ([2T, d] x [d, G*dh] per layer) would cost more than the rest of the step. The key
        includes the weight's version counter, so an in-place update is never served stale, the autocast
        dtype, so a table rounded under autocast never serves a full-precision forward, and inference mode, whose
        tensors autograd refuses to save (a frozen weight is memoised with grad enabled too). Edits through
        `weight.data` bypass the version counter: make them under `torch.no_grad()` on the weight itself."""
        w = self.pos.weight
        memoise = not (torch.is_grad_enabled() and w.requires_grad) and not torch.compiler.is_compiling()
        key = (n, str(device), w.dtype, _autocast_dtype(device or w.device), w.data_ptr(), w._version,
               torch.is_inference_mode_enabled()) if memoise else None
        if key is not None and key == getattr(self, "_rel_pos_key", None):
            return self._rel_pos_value
        r = self.pos(sinusoids(n, self.cfg.d_model, device, wide(w).dtype).to(w.dtype))
        r = r.view(n, -1, self.cfg.d_head) * self.pos_scale
        if key is not None:
            # The weight's storage is kept alive with the table: once freed (the model moved to another dtype
            # and back), a new weight may be allocated at its address with the same version, and match the key.
            self._rel_pos_key, self._rel_pos_value, self._rel_pos_weight = key, r, w.detach()
        return r

    def mix(self, q_BTHd: Tensor, k_BSGd: Tensor, v_BSGd: Tensor, pos_q: Tensor, pos_k: Tensor,
            valid: Tensor | None, scale: Tensor | float = 1.0, q_pos_BTHd: Tensor | None = None) -> Tensor:
        """softmax(scale * (q k^T + q_pos r[pos_q - pos_k])) v with the causal/validity mask -> [B, T, H, dh]."""
        if k_BSGd.shape[2] != q_BTHd.shape[2]:  # MoA: one shared K/V head for every query head
            k_BSGd, v_BSGd = (t.expand(-1, -1, q_BTHd.shape[2], -1) for t in (k_BSGd, v_BSGd))
        if self.cfg.positional == "rope":
            q_BTHd, k_BSGd = apply_rope(q_BTHd, pos_q.expand(q_BTHd.shape[0], -1)), apply_rope(
                k_BSGd, pos_k.expand(k_BSGd.shape[0], -1))
        logits = torch.einsum("bthd,bshd->bhts", wide(q_BTHd), wide(k_BSGd))
        dist = pos_q[:, None, :, None] - pos_k[:, None, None, :]  # [B, 1, T, S]
        if self.cfg.positional == "xl":
            n = k_BSGd.shape[1]
            r = self.rel_pos(n, q_BTHd.device)
            q_pos = q_BTHd if q_pos_BTHd is None else q_pos_BTHd
            if r.shape[1] != q_pos.shape[2]:
                r = r.expand(-1, q_pos.shape[2], -1)
            by_dist = torch.einsum("bthd,nhd->bhtn", wide(q_pos), wide(r))  # [B, H, T, n distances]
            idx = dist.clamp(0, n - 1).expand(by_dist.shape[0], by_dist.shape[1], -1, -1)
            logits = logits + by_dist.gather(-1, idx)
        logits = logits * scale
        visible = dist >= 0
        if valid is not None:
            visible = visible & valid[:, None, None, :]
        probs = logits.masked_fill(~visible, torch.finfo(logits.dtype).min).softmax(-1)
        if self.record:
            self.last_probs = probs.detach()
        return torch.einsum("bhts,bshd->bthd", probs.to(v_BSGd.dtype), v_BSGd)


class SwitchHeadAttention(AttentionBase):
    """H heads; any subset of V, K, Q, O is a top-k mixture of E experts per head (docs/MODEL.md)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d, h, e, dh, n = cfg.d_model, cfg.n_heads, cfg.n_experts, cfg.d_head, cfg.n_layers
        for name in "vkq":
            shape = (h * e, d, dh) if cfg.is_moe(name) else (h * dh, d)
            self.register_parameter(f"w_{name}", nn.Parameter(init_(torch.empty(shape), d, n)))
        w_o_shape = (h * e, dh, d) if cfg.is_moe("o") else (d, h * dh)
        self.w_o = nn.Parameter(init_(torch.empty(w_o_shape), h * dh, n))
        # V's selection serves K too (source side); O's serves Q (destination side).
        self.sel_v = nn.Parameter(init_(torch.empty(h * e, d), d, n)) if cfg.is_moe("v") or cfg.is_moe("k") else None
        needs_o = cfg.is_moe("o") or cfg.is_moe("q")
        self.sel_o = (nn.Parameter(init_(torch.empty(h * e, d), d, n))
                      if needs_o and not (cfg.shared_selection and self.sel_v is not None) else None)
        self.pos = nn.Linear(d, h * dh, bias=False) if cfg.positional == "xl" else None
        if self.pos is not None:
            init_(self.pos.weight, d, n)
        self.scale = self.pos_scale = dh ** -0.25

    @property
    def _sel_o(self) -> Tensor | None:
        # Shared selection: V's matrix chooses O's and Q's experts too; with O and Q dense there is no choice.
        if self.sel_o is not None or not (self.cfg.is_moe("o") or self.cfg.is_moe("q")):
            return self.sel_o
        return self.sel_v

    def _project(self, name: str, x_ND: Tensor, route: tuple[Tensor, Tensor] | None) -> Tensor:
        w = getattr(self, f"w_{name}")
        if route is None:
            return F.linear(x_ND, w).view(x_ND.shape[0], self.cfg.n_heads, self.cfg.d_head)
        return moe_project(x_ND[:, None], w, route[0], route[1], self.cfg.n_heads)

    def route(self, x_ND: Tensor, side: str, batch: int = 1) -> tuple[Tensor, Tensor] | None:
        """(expert ids, gates) [N, H*k] for the source ('v') or destination ('o') side, or None if dense."""
        w = self.sel_v if side == "v" else self._sel_o
        if w is None:
            return None
        idx, gate = select_topk(x_ND, w, self.cfg.n_heads, self.cfg.k)
        self._record_route(side, idx, gate, batch, self.cfg.n_heads, self.cfg.n_experts)
        return idx, gate

    def kv(self, src_BSD: Tensor) -> tuple[Tensor, Tensor]:
        b, s, _ = src_BSD.shape
        x = src_BSD.reshape(b * s, -1)
        route = self.route(x, "v", b)
        k = self._project("k", x, route if self.cfg.is_moe("k") else None) * self.scale
        v = self._project("v", x, route if self.cfg.is_moe("v") else None)
        return k.view(b, s, *k.shape[1:]), v.view(b, s, *v.shape[1:])

    def attend(self, x_BTD, k, v, pos_q, pos_k, valid=None):
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d)
        route = self.route(x, "o", b)
        q = self._project("q", x, route if self.cfg.is_moe("q") else None) * self.scale
        q = q.view(b, t, *q.shape[1:])
        a = self.mix(q, k, v, pos_q, pos_k, valid).reshape(b * t, -1, self.cfg.d_head)
        if self.cfg.is_moe("o"):
            y = moe_project(a, self.w_o, route[0], route[1], 1)
        else:
            y = F.linear(a.flatten(1), self.w_o)
        return y.view(b, t, d)



class DenseXLAttention(AttentionBase):
    """Standard relative multi-head attention: global content/position biases u, v and a learnable scale."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d, h, dh, n = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.n_layers
        self.w_q, self.w_k, self.w_v = (nn.Parameter(init_(torch.empty(h * dh, d), d, n)) for _ in range(3))
        self.w_o = nn.Parameter(init_(torch.empty(d, h * dh), h * dh, n))
        self.scale = nn.Parameter(torch.tensor(dh ** -0.5))
        if cfg.positional == "xl":
            self.pos = nn.Linear(d, h * dh, bias=False)
            init_(self.pos.weight, d, n)
            self.u = nn.Parameter(torch.zeros(h, dh))
            self.v = nn.Parameter(torch.zeros(h, dh))
        else:
            self.pos = self.u = self.v = None

    def kv(self, src_BSD):
        b, s, _ = src_BSD.shape
        shape = (b, s, self.cfg.n_heads, self.cfg.d_head)
        return F.linear(src_BSD, self.w_k).view(shape), F.linear(src_BSD, self.w_v).view(shape)

    def attend(self, x_BTD, k, v, pos_q, pos_k, valid=None):
        b, t, _ = x_BTD.shape
        q = F.linear(x_BTD, self.w_q).view(b, t, self.cfg.n_heads, self.cfg.d_head)
        if self.u is not None:
            a = self.mix(q + self.u, k, v, pos_q, pos_k, valid, self.scale, q_pos_BTHd=q + self.v)
        else:
            a = self.mix(q, k, v, pos_q, pos_k, valid, self.scale)
        return F.linear(a.reshape(b, t, -1), self.w_o)


class MoAAttention(AttentionBase):
    """Mixture of Attention heads (Zhang et al. 2022): one shared K/V head, k of E query/output experts per
    token, one attention map per selected expert, softmax (or sigmoid) gates over the selected experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        d, e, dh, n = cfg.d_model, cfg.n_experts, cfg.d_head, cfg.n_layers
        self.w_k, self.w_v = (nn.Parameter(init_(torch.empty(dh, d), d, n)) for _ in range(2))
        self.w_q = nn.Parameter(init_(torch.empty(e, d, dh), d, n))
        self.w_o = nn.Parameter(init_(torch.empty(e, dh, d), cfg.k * dh, n))
        self.sel = nn.Parameter(init_(torch.empty(e, d), d, n))
        self.pos = nn.Linear(d, dh, bias=False) if cfg.positional == "xl" else None
        if self.pos is not None:
            init_(self.pos.weight, d, n)
        self.scale = self.pos_scale = dh ** -0.25

    def kv(self, src_BSD):
        b, s, _ = src_BSD.shape
        k = F.linear(src_BSD, self.w_k).view(b, s, 1, -1) * self.scale
        return k, F.linear(src_BSD, self.w_v).view(b, s, 1, -1)

    def attend(self, x_BTD, k, v, pos_q, pos_k, valid=None):
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d)
        logits = routing_logits(x, self.sel)
        top, idx = logits.topk(self.cfg.k, dim=-1, sorted=False)
        gate = top.softmax(-1) if self.cfg.moa_gate == "softmax" else top.sigmoid()
        self._record_route("o", idx, gate, b, 1, self.cfg.n_experts)
        q = moe_project(x[:, None], self.w_q, idx, None, self.cfg.k) * self.scale
        a = self.mix(q.view(b, t, self.cfg.k, -1), k, v, pos_q, pos_k, valid)
        return moe_project(a.reshape(b * t, self.cfg.k, -1), self.w_o, idx, gate, 1).view(b, t, d)



class DenseFF(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up, self.down = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)
        for lin in (self.up, self.down):
            init_(lin.weight, lin.in_features, cfg.n_layers)
            nn.init.zeros_(lin.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.drop(F.relu(self.up(x))))


class SigmaMoE(nn.Module):
    """sigma-MoE feed-forward: y = sum over top-k of sigmoid(x W_sel) of gate_e * ReLU(x W1_e) W2_e."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, e, g, n = cfg.d_model, cfg.ff_n_experts, cfg.ff_expert_size, cfg.n_layers
        self.cfg = cfg
        self.w1 = nn.Parameter(init_(torch.empty(e, d, g), d, n))
        self.w2 = nn.Parameter(init_(torch.empty(e, g, d), e * g, n))
        sel = init_(torch.empty(e, d), d, n)
        self.sel = nn.Parameter(sel * sel.norm(dim=1).mean() / sel.norm(dim=1, keepdim=True))
        self.last_aux: Tensor | None = None

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy, as EMA or best-model snapshots take) keeps the regulariser's value, not the
        # autograd graph of the last forward: deepcopy refuses tensors that are not graph leaves.
        return {**super().__getstate__(), "last_aux": None if self.last_aux is None else self.last_aux.detach()}

    def forward(self, x_BTD: Tensor) -> Tensor:
        b, t, d = x_BTD.shape
        x = x_BTD.reshape(b * t, d)
        logits = routing_logits(x, self.sel)
        for_topk = logits
        if self.training and self.cfg.ff_expert_dropout > 0:
            drop = torch.rand_like(logits) < self.cfg.ff_expert_dropout
            for_topk = logits.masked_fill(drop, float("-inf"))
        idx = for_topk.topk(self.cfg.ff_k, dim=-1, sorted=False).indices
        gate = logits.gather(-1, idx).sigmoid()
        h = F.relu(moe_project(x[:, None], self.w1, idx, None, self.cfg.ff_k))
        y = moe_project(h, self.w2, idx, gate, 1)
        # Entropy regulariser: maximise the entropy of the batch-mean expert distribution.
        # Eager, math.log of N costs nothing (also in a decode step); under torch.compile N may be a symbolic size,
        # which math.log would pin (a recompile for every token count), so there log N is computed as a tensor.
        n = logits.shape[0]
        log_n = logits.new_ones(n, dtype=torch.float32).sum().log() if torch.compiler.is_compiling() else math.log(n)
        log_p = torch.logsumexp(logits.log_softmax(-1), 0) - log_n
        self.last_aux = self.cfg.ff_entropy_coef * (log_p.exp() * log_p).sum()
        return y.view(b, t, d)


ATTENTION = {"switchhead": SwitchHeadAttention, "dense": DenseXLAttention, "moa": MoAAttention}


class Block(nn.Module):
    """Pre-LN block: x + Attn(LN1(x), memory=LN1(mem)); then x + FF(LN2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = ATTENTION[cfg.attention](cfg)
        self.ff = SigmaMoE(cfg) if cfg.ff == "sigma_moe" else DenseFF(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: Tensor, mem_BMD: Tensor | None = None) -> Tensor:
        h = self.ln1(x_BTD)
        src = h if mem_BMD is None else torch.cat([self.ln1(mem_BMD), h], 1)
        k, v = self.attn.kv(src)
        return self.finish(x_BTD, h, k, v, *window_positions(src.shape[1] - h.shape[1], h.shape[1], h.device))

    def finish(self, x_BTD, h_BTD, k, v, pos_q, pos_k, valid=None) -> Tensor:
        """The rest of the block once K/V of the whole key window are known (shared with cached decoding)."""
        x = x_BTD + self.drop(self.attn.attend(h_BTD, k, v, pos_q, pos_k, valid))
        return x + self.drop(self.ff(self.ln2(x)))
