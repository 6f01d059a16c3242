"""The simplest obviously-correct implementation of the expert projection (``SWITCHHEAD_KERNEL=reference``).

One batched matmul per slot with the gathered expert matrices, and the same loop for the backward.
It is the yardstick the fast paths are tested against, not something to run in production.
"""

from __future__ import annotations

import torch
from torch import Tensor


def forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    n, n_in, _ = x.shape
    slots = index.shape[1]
    in_per, out_per = slots // n_in, slots // n_out
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros(n, n_out, weight.shape[-1], dtype=acc_dtype)
    for s in range(slots):
        y = torch.bmm(x[:, s // in_per].unsqueeze(1), weight[index[:, s]]).squeeze(1).to(acc_dtype)
        if gate is not None:
            y = y * gate[:, s, None].to(acc_dtype)
        out[:, s // out_per] += y
    return out.to(x.dtype)


def backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    # (Autograd is switched off inside a custom op's implementation, so the chain rule is written out.)
    n, n_in, _ = x.shape
    slots = index.shape[1]
    in_per, out_per = slots // n_in, slots // grad.shape[1]
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    grad_x = torch.zeros(x.shape, dtype=acc_dtype, device=x.device)
    grad_w = torch.zeros(weight.shape if need_weight_grad else (0,), dtype=acc_dtype, device=x.device)
    want_gate = gate is not None and need_gate_grad
    grad_gate = torch.zeros(index.shape if want_gate else (0,), dtype=acc_dtype, device=x.device)
    for s in range(slots):
        xs = x[:, s // in_per].to(acc_dtype)
        w = weight[index[:, s]].to(acc_dtype)
        g = grad[:, s // out_per].to(acc_dtype)
        if want_gate:
            grad_gate[:, s] = (torch.bmm(xs.unsqueeze(1), w).squeeze(1) * g).sum(-1)
        if gate is not None:
            g = g * gate[:, s, None].to(acc_dtype)
        grad_x[:, s // in_per] += torch.bmm(g.unsqueeze(1), w.transpose(1, 2)).squeeze(1)
        if need_weight_grad:
            grad_w.index_add_(0, index[:, s], xs.unsqueeze(2) * g.unsqueeze(1))
    gate_dtype = gate.dtype if gate is not None else x.dtype
    return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_gate.to(gate_dtype)
