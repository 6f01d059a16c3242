"""The top-k expert projection: the one op behind every mixture-of-experts projection in the model.

    out[n, s // (S/R)] += gate[n, s] * x[n, s // (S/I)] @ weight[index[n, s]]

Shapes: x [N, I, D_in], weight [E, D_in, D_out], index [N, S] (int64, values in [0, E)), gate [N, S] or
None (no gating), result [N, R, D_out] with R = n_out. I and R must divide S: slot s reads input row
s // (S/I) and adds into output row s // (S/R). This covers every use in the model:

- SwitchHead V (and K) projection: x [N, 1, d], S = H*k slots (head h owns slots h*k..h*k+k-1 and experts
  h*E..h*E+E-1), R = H: each head keeps its own value vector.
- SwitchHead O (and Q) projection: x [N, H, dh] -> R = 1 (O sums over heads and slots) or R = H (Q).
- sigma-MoE up-projection: x [N, 1, d], S = k, gate None, R = k; down-projection: x [N, k, G], R = 1.
- MoA query/output experts: x [N, 1, d], R = k; x [N, k, dh], R = 1.

It is registered as the custom op ``switchhead::expert_projection`` (with a fake implementation and
autograd) so that training, the runtime and the ONNX exporter all see the same node.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> tuple[int, int]:
    n, i_rows, d_in = x.shape
    e, w_in, _ = weight.shape
    s = index.shape[1]
    torch._check(w_in == d_in, lambda: f"weight D_in {w_in} != x D_in {d_in}")
    torch._check(index.shape[0] == n, lambda: "index and x disagree on N")
    torch._check(s % i_rows == 0 and s % n_out == 0, lambda: f"S={s} must be a multiple of I={i_rows} and R={n_out}")
    if gate is not None:
        torch._check(gate.shape == index.shape, lambda: "gate and index shapes differ")
    return s // i_rows, s // n_out


def _pairs_by_expert(index: Tensor, n_experts: int) -> tuple[Tensor, list[int]]:
    """Order of the flattened (token, slot) pairs grouped by expert, and the group sizes."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    return order, counts


def _grouped_mm(rows: Tensor, order: Tensor, counts: list[int], weight: Tensor) -> Tensor:
    """rows[p] @ weight[expert of p] for every pair p, one matmul per expert."""
    out = rows.new_empty(rows.shape[0], weight.shape[-1])
    start = 0
    for e, c in enumerate(counts):
        if c:
            sel = order[start : start + c]
            out[sel] = rows[sel] @ weight[e]
            start += c
    return out


def _expand_rows(t: Tensor, s: int, per: int) -> Tensor:
    """[N, S/per, D] -> [N*S, D]: row r of each token repeated for its `per` slots."""
    n, _, d = t.shape
    return t.unsqueeze(2).expand(n, s // per, per, d).reshape(n * s, d)


def expert_projection_torch(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """Plain-PyTorch forward, grouped by expert."""
    n_in_per, n_out_per = _check(x, weight, index, gate, n_out)
    n, s = index.shape
    order, counts = _pairs_by_expert(index, weight.shape[0])
    y = _grouped_mm(_expand_rows(x, s, n_in_per), order, counts, weight)
    if gate is not None:
        y = y * gate.reshape(-1, 1).to(y.dtype)
    return y.view(n, n_out, n_out_per, -1).sum(2)


@torch.library.custom_op("switchhead::expert_projection", mutates_args=())
def expert_projection(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    return expert_projection_torch(x, weight, index, gate, n_out)


@expert_projection.register_fake
def _(x, weight, index, gate, n_out):
    return x.new_empty(x.shape[0], n_out, weight.shape[-1])


@torch.library.custom_op("switchhead::expert_projection_backward", mutates_args=())
def expert_projection_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. x, weight and gate (the last is empty when not needed or gate is None)."""
    n, s = index.shape
    i_rows = x.shape[1]
    n_in_per, n_out_per = s // i_rows, s // grad.shape[1]
    order, counts = _pairs_by_expert(index, weight.shape[0])
    xs = _expand_rows(x, s, n_in_per)
    gy = _expand_rows(grad.contiguous(), s, n_out_per)
    grad_gate = x.new_empty(0)
    if gate is not None:
        if need_gate_grad:
            y = _grouped_mm(xs, order, counts, weight)
            grad_gate = (y * gy).sum(-1).view(n, s).to(gate.dtype)
        gy = gy * gate.reshape(-1, 1).to(gy.dtype)
    grad_x = _grouped_mm(gy, order, counts, weight.transpose(1, 2))
    grad_x = grad_x.view(n, i_rows, n_in_per, -1).sum(2).to(x.dtype)
    grad_w = torch.zeros_like(weight)
    start = 0
    for e, c in enumerate(counts):
        if c:
            sel = order[start : start + c]
            grad_w[e] = (xs[sel].t() @ gy[sel]).to(weight.dtype)
            start += c
    return grad_x, grad_w, grad_gate


@expert_projection_backward.register_fake
def _(grad, x, weight, index, gate, need_gate_grad):
    gate_shape = index.shape if (gate is not None and need_gate_grad) else (0,)
    dtype = gate.dtype if gate is not None else x.dtype
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(gate_shape, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, weight, index, gate, n_out = inputs
    ctx.save_for_backward(x, weight, index, gate)


def _backward(ctx, grad):
    x, weight, index, gate = ctx.saved_tensors
    need_gate = gate is not None and ctx.needs_input_grad[3]
    grad_x, grad_w, grad_gate = expert_projection_backward(grad, x, weight, index, gate, need_gate)
    return grad_x, grad_w, None, grad_gate if need_gate else None, None


expert_projection.register_autograd(_backward, setup_context=_setup_context)
