"""Pure-PyTorch expert projection (``SWITCHHEAD_KERNEL=torch``; the default for non-CUDA tensors).

Three regimes, each with its own forward and backward, picked per call by `choose_regime`:

- ``gather``: one vector-matrix product per (token, slot) pair against the selected expert (the backward
  gathers the selected matrices). It reads only the weights that are used and copies none of them, which
  is what matters at decode time (N*S = a few pairs).
- ``dense``: run every expert as one big GEMM and gate afterwards (or scale the inputs by the gates first
  and contract over experts in one GEMM, whichever side has fewer rows). Wastes E/k of the FLOPs but
  issues one large matmul instead of E small ones plus gathers; wins when E/k is small (SwitchHead).
- ``grouped``: sort (token, slot) pairs by expert and run one GEMM per expert: no wasted FLOPs, but
  gather/scatter copies and E small matmuls; wins when E/k is large (sigma-MoE feed-forward).

The thresholds in `choose_regime` come from `benchmarks/kernels.py` run on a 2-core CPU
(docs/BENCHMARKS_kernels.md); re-measure before changing them.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Regime = Literal["gather", "dense", "grouped"]
Grads = tuple[Tensor, Tensor, Tensor]

# Thresholds measured on a 2-core CPU with benchmarks/kernels.py (see docs/BENCHMARKS_kernels.md; the numbers
# are from a shared, noisy machine: re-measure before trusting small differences).
# Up to this many (token, slot) pairs a plain loop of vector-matrix products wins: it reads only the selected
# experts and copies nothing (batch-1 decode: N*S = 6..8 for the paper models).
GATHER_MAX_PAIRS = 8
# Dense evaluates every expert: waste = (experts / slots reaching one row) times the useful FLOPs; grouped pays
# gathers, scatters and one small GEMM per expert instead. Forward, dense wins up to about these waste factors:
# 1.8 when it runs all experts on the inputs (V-like, I <= R: 47M V 34 vs 81 ms at N = 4096), 1.5 when it
# contracts gated inputs (O-like: grouped was ~12 % faster for 47M O, waste 1.67, in two runs). Backward, dense
# wins up to 2.0 (47M O, N = 4096: 159 vs 409 ms; 262M V: 1.33 vs 1.63 s); sigma-MoE (waste 4) is grouped.
DENSE_MAX_WASTE_FORWARD = 1.8
DENSE_MAX_WASTE_FORWARD_CONTRACT = 1.5
DENSE_MAX_WASTE_BACKWARD = 2.0
# The dense backward writes the gradient of every expert's full matrix through a permuted copy; with few tokens
# that memory traffic dominates (262M V, N = 16: 13.7 ms dense vs 3.6 ms grouped), so it needs this many.
DENSE_BACKWARD_MIN_TOKENS = 128
# Below this many input rows the dense path multiplies by the [E, D_in, D_out] weight as a broadcast batched
# matmul; above it, copying the weight once into a [D_in, E*D_out] matrix for one big GEMM pays off.
DENSE_BROADCAST_MAX_ROWS = 64


def choose_regime(n: int, n_in: int, slots: int, n_out: int, n_experts: int, backward: bool = False) -> Regime:
    if n * slots <= GATHER_MAX_PAIRS:
        return "gather"
    waste = n_experts * min(n_in, n_out) / slots
    if backward:
        return "dense" if waste <= DENSE_MAX_WASTE_BACKWARD and n >= DENSE_BACKWARD_MIN_TOKENS else "grouped"
    limit = DENSE_MAX_WASTE_FORWARD if _dense_expands_inputs(n_in, n_out) else DENSE_MAX_WASTE_FORWARD_CONTRACT
    return "dense" if waste <= limit else "grouped"


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _slot_rows(slots: int, rows: int, device: torch.device) -> Tensor:
    """Row (of x or of the output) that each slot reads or writes: s // (S / rows)."""
    return torch.arange(slots, device=device) // (slots // rows)


def _reduce_slots(y: Tensor, rows: int) -> Tensor:
    """[N, S, D] -> [N, rows, D]: consecutive slots that share a row are summed."""
    n, slots, d = y.shape
    return y.view(n, rows, slots // rows, d).sum(2)


def _per_slot(t: Tensor, slots: int) -> Tensor:
    """[N, rows, D] -> [N, S, D]: each row repeated for the slots that read it (a view when possible)."""
    n, rows, d = t.shape
    return t.unsqueeze(2).expand(n, rows, slots // rows, d).reshape(n, slots, d)


def _gated(y: Tensor, gate: Tensor | None) -> Tensor:
    return y if gate is None else y * gate.unsqueeze(-1).to(y.dtype)


# ----------------------------------------------------------------------------------------------------------
# gather: tiny N


def gather_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    n, slots = index.shape
    in_per = slots // x.shape[1]
    experts = index.tolist()  # a handful of pairs: one vector-matrix product each, no weight copies
    y = torch.stack([x[t, s // in_per] @ weight[experts[t][s]] for t in range(n) for s in range(slots)])
    return _reduce_slots(_gated(y.view(n, slots, -1).to(_acc_dtype(x)), gate), n_out).to(x.dtype)


def gather_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool
) -> Grads:
    n, slots = index.shape
    acc = _acc_dtype(x)
    flat = index.reshape(-1)
    w = weight[flat]  # [P, D_in, D_out]
    xs = _per_slot(x, slots).reshape(n * slots, -1)
    gs = _per_slot(grad.to(acc), slots).reshape(n * slots, -1)
    grad_gate = _gate_grad_from_outputs(xs, w, gs, gate, need_gate_grad, n, slots)
    gs = _gated(gs, gate.reshape(-1) if gate is not None else None).to(x.dtype)
    grad_xs = torch.bmm(gs.unsqueeze(1), w.transpose(1, 2)).view(n, slots, -1)
    grad_x = _reduce_slots(grad_xs.to(acc), x.shape[1]).to(x.dtype)
    outer = xs.unsqueeze(2).to(acc) * gs.unsqueeze(1).to(acc)  # [P, D_in, D_out]
    grad_w = torch.zeros_like(weight, dtype=acc).index_add_(0, flat, outer).to(weight.dtype)
    return grad_x, grad_w, grad_gate


def _gate_grad_from_outputs(
    xs: Tensor, w: Tensor, gs: Tensor, gate: Tensor | None, need: bool, n: int, slots: int
) -> Tensor:
    if gate is None or not need:
        return xs.new_empty(0, dtype=gate.dtype if gate is not None else xs.dtype)
    y = torch.bmm(xs.unsqueeze(1), w).squeeze(1).to(gs.dtype)
    return (y * gs).sum(-1).view(n, slots).to(gate.dtype)


# ----------------------------------------------------------------------------------------------------------
# dense: every expert in one GEMM


def _dense_expands_inputs(n_in: int, n_out: int) -> bool:
    """Run all experts on the inputs (cost ~ I*E) rather than contract gated inputs (cost ~ R*E)?"""
    return n_in <= n_out


def _coefficients(index: Tensor, gate: Tensor | None, n_in: int, n_out: int, n_experts: int, dtype) -> Tensor:
    """C[n, r, e, i] = sum of the gates of the slots that read row i through expert e into output row r."""
    n, slots = index.shape
    r = _slot_rows(slots, n_out, index.device)
    i = _slot_rows(slots, n_in, index.device)
    pos = (r * n_experts + index) * n_in + i
    val = gate.to(dtype) if gate is not None else torch.ones(n, slots, dtype=dtype, device=index.device)
    c = torch.zeros(n, n_out * n_experts * n_in, dtype=dtype, device=index.device)
    return c.scatter_add_(1, pos, val).view(n, n_out * n_experts, n_in)


def _all_experts(x: Tensor, weight: Tensor, index: Tensor) -> Tensor:
    """[N, S, D_out]: every expert applied to every input row, then each slot's (row, expert) picked."""
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    slots = index.shape[1]
    rows = torch.arange(n, device=x.device).unsqueeze(1) * n_in + _slot_rows(slots, n_in, x.device)
    if n * n_in <= DENSE_BROADCAST_MAX_ROWS:
        return torch.matmul(x.reshape(1, n * n_in, d_in), weight)[index, rows]  # [E, N*I, D_out] -> [N, S, D_out]
    w_cat = weight.permute(1, 0, 2).reshape(d_in, n_experts * d_out)
    y_all = (x.reshape(n * n_in, d_in) @ w_cat).view(n * n_in, n_experts, d_out)
    return y_all[rows, index]


def dense_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    if _dense_expands_inputs(n_in, n_out):
        y = _all_experts(x, weight, index).to(_acc_dtype(x))
        return _reduce_slots(_gated(y, gate), n_out).to(x.dtype)
    c = _coefficients(index, gate, n_in, n_out, n_experts, x.dtype)
    z = torch.bmm(c, x) if n_in > 1 else c * x  # [N, R*E, D_in]: gated inputs per (output row, expert)
    out = z.view(n * n_out, n_experts * d_in) @ weight.reshape(n_experts * d_in, d_out)
    return out.view(n, n_out, d_out)


def dense_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool
) -> Grads:
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    n_out = grad.shape[1]
    slots = index.shape[1]
    acc = _acc_dtype(x)
    in_rows = _slot_rows(slots, n_in, x.device)
    no_gate_grad = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    if _dense_expands_inputs(n_in, n_out):
        w_cat = weight.permute(1, 0, 2).reshape(d_in, n_experts * d_out)
        sel = in_rows * n_experts + index
        gs = _per_slot(grad.to(acc), slots)  # [N, S, D_out]
        grad_gate = no_gate_grad
        if gate is not None and need_gate_grad:
            grad_gate = (_all_experts(x, weight, index).to(acc) * gs).sum(-1).to(gate.dtype)
        grad_y = torch.zeros(n, n_in * n_experts, d_out, dtype=acc, device=x.device)
        grad_y.scatter_add_(1, sel.unsqueeze(-1).expand(n, slots, d_out), _gated(gs, gate))
        grad_y = grad_y.view(n * n_in, n_experts * d_out).to(x.dtype)
        grad_x = (grad_y @ w_cat.t()).view_as(x)
        grad_w_cat = x.reshape(n * n_in, d_in).t() @ grad_y
        grad_w = grad_w_cat.view(d_in, n_experts, d_out).permute(1, 0, 2).contiguous()
        return grad_x, grad_w, grad_gate
    c = _coefficients(index, gate, n_in, n_out, n_experts, x.dtype)
    z = torch.bmm(c, x) if n_in > 1 else c * x
    g2 = grad.reshape(n * n_out, d_out).to(x.dtype)
    w_flat = weight.reshape(n_experts * d_in, d_out)
    grad_w = (z.view(n * n_out, n_experts * d_in).t() @ g2).view_as(weight)
    grad_z = (g2 @ w_flat.t()).view(n, n_out * n_experts, d_in)
    grad_x = torch.bmm(c.transpose(1, 2), grad_z)
    grad_gate = no_gate_grad
    if gate is not None and need_gate_grad:
        sel = _slot_rows(slots, n_out, x.device) * n_experts + index
        gz = grad_z.gather(1, sel.unsqueeze(-1).expand(n, slots, d_in)).to(acc)
        xs = x.to(acc)[:, in_rows]
        grad_gate = (gz * xs).sum(-1).to(gate.dtype)
    return grad_x, grad_w, grad_gate


# ----------------------------------------------------------------------------------------------------------
# grouped: one GEMM per expert over the pairs sorted by expert


def _sorted_pairs(index: Tensor, n_experts: int) -> tuple[Tensor, list[int]]:
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts).tolist()


def _per_expert_mm(rows: Tensor, counts: list[int], weight: Tensor) -> Tensor:
    """rows (already in expert order) times their expert's matrix, concatenated."""
    parts, start = [], 0
    for e, c in enumerate(counts):
        if c:
            parts.append(rows[start : start + c] @ weight[e])
            start += c
    return torch.cat(parts) if parts else rows.new_empty(0, weight.shape[-1])


def grouped_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    n, slots = index.shape
    d_out = weight.shape[-1]
    acc = _acc_dtype(x)
    order, counts = _sorted_pairs(index, weight.shape[0])
    rows = x.reshape(-1, x.shape[-1])[order // (slots // x.shape[1])]
    out_rows = order // (slots // n_out)
    gate_sorted = gate.reshape(-1)[order].to(acc).unsqueeze(-1) if gate is not None else None
    # Gate and reduce each expert's result straight into the output: no [N*S, D_out] intermediate.
    out = torch.zeros(n * n_out, d_out, dtype=acc, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            y = (rows[start : start + c] @ weight[e]).to(acc)
            if gate_sorted is not None:
                y = y * gate_sorted[start : start + c]
            out.index_add_(0, out_rows[start : start + c], y)
            start += c
    return out.view(n, n_out, d_out).to(x.dtype)


def grouped_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool
) -> Grads:
    n, slots = index.shape
    n_in, n_out = x.shape[1], grad.shape[1]
    acc = _acc_dtype(x)
    order, counts = _sorted_pairs(index, weight.shape[0])
    xs = x.reshape(-1, x.shape[-1])[order // (slots // n_in)]  # sorted by expert
    gs = grad.reshape(-1, grad.shape[-1])[order // (slots // n_out)].to(acc)
    grad_gate = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    if gate is not None:
        gate_sorted = gate.reshape(-1)[order].to(acc)
        if need_gate_grad:
            y = _per_expert_mm(xs, counts, weight).to(acc)
            grad_gate = torch.empty(n * slots, dtype=gate.dtype, device=x.device)
            grad_gate[order] = (y * gs).sum(-1).to(gate.dtype)
            grad_gate = grad_gate.view(n, slots)
        gs = gs * gate_sorted.unsqueeze(-1)
    gs = gs.to(x.dtype)
    grad_xs = torch.empty(n * slots, x.shape[-1], dtype=acc, device=x.device)
    grad_xs[order] = _per_expert_mm(gs, counts, weight.transpose(1, 2)).to(acc)
    grad_x = _reduce_slots(grad_xs.view(n, slots, -1), n_in).to(x.dtype)
    grad_w = torch.zeros_like(weight)
    start = 0
    for e, c in enumerate(counts):
        if c:
            grad_w[e] = xs[start : start + c].t() @ gs[start : start + c]
            start += c
    return grad_x, grad_w, grad_gate


FORWARD = {"gather": gather_forward, "dense": dense_forward, "grouped": grouped_forward}
BACKWARD = {"gather": gather_backward, "dense": dense_backward, "grouped": grouped_backward}


def forward(
    x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int, regime: Regime | None = None
) -> Tensor:
    regime = regime or choose_regime(x.shape[0], x.shape[1], index.shape[1], n_out, weight.shape[0])
    return FORWARD[regime](x, weight, index, gate, n_out)


def backward(
    grad: Tensor,
    x: Tensor,
    weight: Tensor,
    index: Tensor,
    gate: Tensor | None,
    need_gate_grad: bool,
    regime: Regime | None = None,
) -> Grads:
    regime = regime or choose_regime(x.shape[0], x.shape[1], index.shape[1], grad.shape[1], weight.shape[0], True)
    return BACKWARD[regime](grad, x, weight, index, gate, need_gate_grad)
