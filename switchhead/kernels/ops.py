"""The top-k expert projection: the one op behind every mixture-of-experts projection in the model.

    expert_projection(x, weight, index, gate, n_out) -> out

    x      [N, I, D_in]      input rows (I rows per token)
    weight [E, D_in, D_out]  expert matrices
    index  [N, S] int64      expert of each (token, slot) pair, values in [0, E) (int32 also accepted)
    gate   [N, S] or None    multiplier of each pair (any float dtype; None = 1)
    out    [N, R, D_out]     R = n_out; dtype of x

    out[n, s // (S/R)] += gate[n, s] * x[n, s // (S/I)] @ weight[index[n, s]]

N may be 0. I and R must divide S: slot s reads input row s // (S/I) and adds into output row s // (S/R). This
covers every use in the model:

- SwitchHead V (and K) projection: x [N, 1, d], S = H*k slots (head h owns slots h*k..h*k+k-1 and experts
  h*E..h*E+E-1), R = H: each head keeps its own value vector.
- SwitchHead O (and Q) projection: x [N, H, dh] -> R = 1 (O sums over heads and slots) or R = H (Q).
- sigma-MoE up-projection: x [N, 1, d], S = k, gate None, R = k; down-projection: x [N, k, G], R = 1.
- MoA query/output experts: x [N, 1, d], R = k; x [N, k, dh], R = 1.

It is registered as the custom op ``switchhead::expert_projection`` (fake implementation and autograd; the
backward is the custom op ``switchhead::expert_projection_backward``) so that training, the runtime and the
ONNX exporter all see the same node. Accumulation is in float32 (or wider) on every backend. The Triton weight
gradient is bitwise reproducible run to run by construction (so are the PyTorch paths on the CPU); the Triton
forward and input gradient add the slots that share a row with atomics unless
torch.use_deterministic_algorithms(True) is set.

Where a half-precision product takes gated rows as an operand, the gated rows are rounded to x's dtype first, as
in any half-precision GEMM of gated rows: the Triton weight gradient (gate * x), and the dense regime's gated
inputs or gated output gradients (cuBLAS on CUDA; on a CPU only where it has instructions for that dtype, since
elsewhere half inputs are computed in float32). In float16 a gated value below its normal range (< 6.1e-5 in
magnitude) keeps only an absolute precision of 6e-8, and one above 65504 (a gate > 1) overflows to inf; bfloat16
has float32's range. The Triton forward and grad_x apply the gate to their float32 sums.

Non-finite values reach only the results that read them, as in the formula: on the CPU, where the dense regime
(which multiplies every expert and mixes a token's rows before zero coefficients drop what is not read, and
0 * nan is nan) gives results that are not all finite, they are computed again by the grouped regime
(`torch_paths`, "Non-finite values"). On CUDA that check would be a host sync per call, so there the shapes run
as one cuBLAS product spread an inf or nan of an unchosen expert or row over the rows that share the product.

A weight that does not require grad gets no gradient, and its products are skipped. Autocast is switched off
inside the op (it casts nothing itself: the caller casts its inputs, as `layers.moe_project` does).

Reverse-mode autograd only: like any torch.library custom op with just `register_autograd`, torch.func's
reverse-mode transforms (`grad`, `jacrev`) refuse it, while forward mode (torch.autograd.forward_ad,
`torch.func.jvp`, `jacfwd`) silently gives its output a zero tangent.

The model calls it through `project`, which runs the same implementation without the dispatcher where nothing
needs the op itself: eager calls on CPU, CUDA or MPS tensors outside tracing, modes and transforms, directly where
they record no autograd graph (inference and decoding) and through a plain autograd.Function with the op's
backward where they do (eager training).

Backends, chosen per call: CUDA tensors -> Triton kernels (`triton_kernels`; float64 ones -> PyTorch, since the
kernels accumulate in float32; and the fp16/bf16 forward of the O-like shapes where cuBLAS is measured faster ->
PyTorch's dense regime, `torch_paths.cuda_prefers_dense`; likewise grad_x and the weight gradient of the V-like
shapes where that is measured faster, `torch_paths.cuda_prefers_dense_backward`), anything else -> PyTorch
(`torch_paths`, which picks a regime by shape). The environment variable ``SWITCHHEAD_KERNEL`` (read at every
call) overrides this: ``triton`` (the kernels for every call; on CPU tensors this needs ``TRITON_INTERPRET=1``;
not for float64), ``torch``, ``reference`` (`reference`: slow, obviously correct) or ``auto``/unset.
"""

from __future__ import annotations

import os
import weakref
from functools import partial
from types import ModuleType

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from switchhead.devices import autocast_off
from switchhead.errors import SwitchheadError
from switchhead.kernels import reference, torch_paths

ENV_VAR = "SWITCHHEAD_KERNEL"
BACKENDS = ("auto", "triton", "torch", "reference")
INDEX_DTYPES = (torch.int64, torch.int32)


class KernelBackendError(SwitchheadError):
    """An unknown or unusable value of SWITCHHEAD_KERNEL."""


def _choice() -> str:
    choice = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise KernelBackendError(f"{ENV_VAR}={choice!r} is not one of {', '.join(BACKENDS)}")
    return choice


def backend_for(t: Tensor) -> str:
    """The backend a call on tensors like `t` uses now: 'triton', 'torch' or 'reference'."""
    choice = _choice()
    if choice == "auto":
        return "triton" if t.is_cuda and t.dtype != torch.float64 else "torch"
    if choice == "triton" and t.dtype == torch.float64:
        raise KernelBackendError(f"{ENV_VAR}=triton: the Triton kernels compute in float32 at most, not float64")
    return choice


def _triton() -> ModuleType:
    try:
        from switchhead.kernels import triton_kernels
    except ImportError as exc:  # triton is a Linux-only dependency
        raise KernelBackendError(f"{ENV_VAR}=triton but triton cannot be imported: {exc}") from exc
    return triton_kernels.load()


def _check(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> None:
    """Eager check on concrete shapes and (CPU) index values: as few host operations as possible, since it runs
    on every call, also at batch-1 decode where the whole op takes tens of microseconds. (Plain raises: on
    concrete values torch._check adds ~3.5 us per condition for nothing.)"""
    # type(): a bool is an int to isinstance, and True would quietly be read as R = 1
    ok = type(n_out) is int and x.dim() == 3 and weight.dim() == 3 and index.dim() == 2 and n_out > 0
    ok = ok and weight.shape[1] == x.shape[2] and index.shape[0] == x.shape[0] and x.dtype == weight.dtype
    ok = ok and x.shape[1] > 0 and index.shape[1] > 0 and weight.shape[2] > 0 and x.dtype.is_floating_point
    ok = ok and x.shape[2] > 0 and (gate is None or gate.dtype.is_floating_point)
    ok = ok and index.shape[1] % x.shape[1] == 0 and index.shape[1] % n_out == 0
    ok = ok and (gate is None or gate.shape == index.shape) and index.dtype in INDEX_DTYPES
    if not ok:
        raise RuntimeError(_shape_error(x, weight, index, gate, n_out))
    if not _same_device(x, weight, index, gate):
        raise RuntimeError(_device_error(x, weight, index, gate))
    if index.device.type == "cpu" and index.numel():
        # An index outside [0, E) would otherwise be read as another expert's rows or wrap around, silently. On
        # the CPU the check is one small reduction; on CUDA it would need a host sync per call, so there the
        # index is trusted (the model's come from topk).
        lo, hi = torch.aminmax(index)
        lo, hi = lo.item(), hi.item()
        if lo < 0 or hi >= weight.shape[0]:
            raise RuntimeError(
                f"expert_projection: index values must lie in [0, {weight.shape[0]}) (E); got {lo}..{hi}"
            )


def _check_symbolic(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> None:
    """The same conditions for fake tensors, one torch._check each: with symbolic sizes (export, compile)
    every condition becomes a runtime assertion instead of a guard that would specialise the shape."""
    msg = lambda: _shape_error(x, weight, index, gate, n_out)  # noqa: E731
    torch._check(x.dim() == 3 and weight.dim() == 3 and index.dim() == 2 and n_out > 0, msg)
    torch._check(x.dtype == weight.dtype and x.dtype.is_floating_point and index.dtype in INDEX_DTYPES, msg)
    # A meta tensor among real ones dispatches here: without this the caller got uninitialised memory.
    torch._check(_same_device(x, weight, index, gate), lambda: _device_error(x, weight, index, gate))
    torch._check(x.shape[1] > 0, msg)
    torch._check(index.shape[1] > 0, msg)
    torch._check(weight.shape[2] > 0, msg)
    torch._check(x.shape[2] > 0, msg)
    torch._check(gate is None or gate.dtype.is_floating_point, msg)
    torch._check(weight.shape[1] == x.shape[2], msg)
    torch._check(index.shape[0] == x.shape[0], msg)
    torch._check(index.shape[1] % x.shape[1] == 0, msg)
    torch._check(index.shape[1] % n_out == 0, msg)
    if gate is not None:
        torch._check(gate.shape[0] == index.shape[0], msg)
        torch._check(gate.shape[1] == index.shape[1], msg)


def _same_device(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None) -> bool:
    d = x.device
    return weight.device == d and index.device == d and (gate is None or gate.device == d)


def _device_error(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None) -> str:
    return "expert_projection: x, weight, index and gate must be on one device; got " + ", ".join(
        f"{n} {t.device}" for n, t in zip(("x", "weight", "index", "gate"), (x, weight, index, gate)) if t is not None
    )


def _shape_error(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> str:
    gate_shape = None if gate is None else tuple(gate.shape)
    return (
        f"expert_projection: expected floating-point x [N, I, D_in], weight [E, D_in, D_out] of x's dtype, index "
        f"[N, S] int64 or int32 and floating-point gate [N, S] or None, with I, S, D_in, D_out >= 1 and I and "
        f"R=n_out dividing S; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
        f"index {tuple(index.shape)} {index.dtype}, gate {gate_shape}, n_out {n_out}"
    )


@torch.library.custom_op("switchhead::expert_projection", mutates_args=())
def expert_projection(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """See the module docstring: [N, I, D_in] x [E, D_in, D_out] -> [N, n_out, D_out]."""
    return _forward(x, weight, index, gate, n_out)


def project(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """`expert_projection`, with its implementation called without the dispatcher where nothing needs the op itself:
    eager calls on CPU, CUDA or MPS tensors outside compile and export tracing, dispatch and function modes,
    functorch transforms and tensor subclasses. A call that records no autograd graph (inference, decoding) runs
    the forward directly; one that does (eager training) runs it through `_Eager`, a plain autograd.Function with the
    op's forward, saved tensors and backward, but neither the forward's nor the backward's custom-op dispatch and
    autograd wrappers. At batch-1 decode the dispatch is a large part of the op (docs/BENCHMARKS.md, "Decode: the
    op without its dispatcher"); on a GPU it is host time, which the GPU waits on wherever a call's host time
    exceeds its GPU time ("The op's host time without a GPU")."""
    if _plain_eager(x, weight, index, gate):
        grads = x.requires_grad or weight.requires_grad or (gate is not None and gate.requires_grad)
        if grads and torch.is_grad_enabled():
            return _Eager.apply(x, weight, index, gate, n_out)
        return _forward(x, weight, index, gate, n_out)
    if type(n_out) is not int:  # the dispatcher's int argument would take True as R = 1 before `_check` saw it
        raise RuntimeError(_shape_error(x, weight, index, gate, n_out))
    return expert_projection(x, weight, index, gate, n_out)


# Private torch state that tells whether a mode or transform is active; in a torch without it, `project` always goes
# through the dispatcher.
_MODE_PROBES = (
    getattr(torch._C, "_len_torch_dispatch_stack", None),
    getattr(torch._C, "_len_torch_function_stack", None),
    getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None),
)
_PROBED = all(_MODE_PROBES) and hasattr(torch.autograd.forward_ad, "_current_level")
_DIRECT_DEVICES = ("cpu", "cuda", "mps")


def _plain_eager(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None) -> bool:
    if not _PROBED or torch.compiler.is_compiling() or torch.jit.is_tracing() or x.device.type not in _DIRECT_DEVICES:
        return False  # (a meta tensor, among others, needs the op's fake implementation)
    if torch.autograd.forward_ad._current_level >= 0:
        return False  # dual tensors may be about: the op's forward-mode behaviour (a zero tangent) stays the same
    plain = (Tensor, torch.nn.Parameter)
    if type(x) not in plain or type(weight) not in plain or type(index) not in plain:
        return False
    if gate is not None and type(gate) not in plain:
        return False
    # A mode or transform expects to see the op itself (tracing, fake tensors, vmap, observers).
    dispatch_modes, function_modes, transforms = _MODE_PROBES
    return dispatch_modes() == 0 and function_modes() == 0 and transforms() is None


def _forward(
    x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int, pairs: list | None = None
) -> Tensor:
    """The op's forward; `pairs` collects the Triton forward's sort of the pairs by expert, if it makes one, for
    `_backward_impl` to reuse."""
    _check(x, weight, index, gate, n_out)
    index = index.contiguous()  # every path flattens it with views; a transposed index is legal input
    backend = backend_for(x)
    if x.shape[0] == 0:  # no tokens: nothing to launch (and no per-backend corner case to get right)
        return x.new_zeros(0, n_out, weight.shape[-1])
    # Autocast does not cast a custom op's inputs, but it would reach the matmuls inside the PyTorch paths and round
    # their float32 products and sums (widened half inputs, gated rows) to half precision mid-op.
    with autocast_off(x.device.type):
        if backend == "triton":
            if _dense_on_cuda(x, weight, index, n_out):
                return torch_paths.dense_forward(x, weight, index, gate, n_out)
            return _triton().forward(x, weight, index, gate, n_out, pairs)
        if backend == "reference":
            return reference.forward(x, weight, index, gate, n_out)
        return torch_paths.forward(x, weight, index, gate, n_out)


def _dense_on_cuda(x: Tensor, weight: Tensor, index: Tensor, n_out: int, rule=torch_paths.cuda_prefers_dense) -> bool:
    """The automatic choice (not a forced `triton`) on CUDA tensors of a shape whose forward (or, with
    `torch_paths.cuda_prefers_dense_backward` as the rule, backward) cuBLAS runs faster."""
    if not x.is_cuda:
        return False
    shape = x.shape[0], x.shape[1], index.shape[1], n_out, *weight.shape
    return rule(*shape, x.dtype) and _choice() == "auto"


@expert_projection.register_fake
def _(x, weight, index, gate, n_out):
    _check_symbolic(x, weight, index, gate, n_out)
    return x.new_empty(x.shape[0], n_out, weight.shape[-1])


@torch.library.custom_op("switchhead::expert_projection_backward", mutates_args=())
def expert_projection_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. x, weight and gate (the weight's and the gate's are empty when not needed; the gate's
    also when gate is None)."""
    return _backward_impl(grad, x, weight, index, gate, need_gate_grad, need_weight_grad)


def _backward_impl(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool, pairs: list | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    backend = backend_for(x)
    index = index.contiguous()
    if x.shape[0] == 0:
        grad_x, grad_w, grad_gate = _grad_buffers(x, weight, index, gate, need_gate_grad, need_weight_grad)
        return grad_x, grad_w.zero_(), grad_gate
    args = grad, x, weight, index, gate, need_gate_grad, need_weight_grad
    with autocast_off(x.device.type):  # as in the forward
        if backend == "triton":
            dense = _dense_on_cuda(x, weight, index, grad.shape[1], torch_paths.cuda_prefers_dense_backward)
            return _triton().backward(*args, dense_grad_x=dense, dense_grad_w=dense, pairs=pairs)
        if backend == "reference":
            return reference.backward(*args)
        return torch_paths.backward(*args)


def _grad_buffers(
    x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool, need_weight_grad: bool
):
    """Uninitialised tensors shaped like the backward's results (empty where not needed)."""
    gate_shape = index.shape if (gate is not None and need_gate_grad) else (0,)
    dtype = gate.dtype if gate is not None else x.dtype
    # Contiguous whatever the inputs' strides, as every backend returns them: a fake with other strides than
    # the real results breaks torch.compile's backward (a transposed weight, as nn.Linear stores its own).
    grad_w = weight.new_empty(weight.shape if need_weight_grad else (0,))
    return x.new_empty(x.shape), grad_w, x.new_empty(gate_shape, dtype=dtype)


@expert_projection_backward.register_fake
def _(grad, x, weight, index, gate, need_gate_grad, need_weight_grad):
    return _grad_buffers(x, weight, index, gate, need_gate_grad, need_weight_grad)


def _setup_context(ctx, inputs, output):
    x, weight, index, gate, n_out = inputs
    ctx.save_for_backward(x, weight, index, gate)


def _gradients(ctx, grad: Tensor, backward, saved: tuple | None = None) -> tuple:
    x, weight, index, gate = ctx.saved_tensors if saved is None else saved
    need_gate = gate is not None and ctx.needs_input_grad[3]
    # A frozen weight's gradient (a third of the backward's products) is not computed. x's always is: the gate
    # gradient comes out of the same products, and inside a model x needs one wherever anything before it trains.
    need_weight = ctx.needs_input_grad[1]
    grad_x, grad_w, grad_gate = backward(grad.contiguous(), x, weight, index, gate, need_gate, need_weight)
    return grad_x, grad_w if need_weight else None, None, grad_gate if need_gate else None, None


def _backward(ctx, grad):
    return _gradients(ctx, grad, expert_projection_backward)


expert_projection.register_autograd(_backward, setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The op's autograd for eager calls from `project`: the same forward, saved tensors and backward, called
    directly. Once differentiable, as the op is (its backward has no autograd formula). The forward takes ctx itself
    rather than leaving it to a separate setup_context: with one, every apply binds its arguments to the forward's
    signature through inspect, which costs tens of microseconds a call.

    The backward also reuses the Triton forward's sort of the pairs by expert (two launches and a cumsum) when the
    index autograd hands back is the very tensor the forward sorted, which autograd refuses to unpack if it was
    changed in place since. Saved-tensor hooks (offloading, activation checkpointing's recomputation) hand back
    another tensor, whose values might differ: then the backward sorts it again."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
        _setup_context(ctx, (x, weight, index, gate, n_out), None)
        ctx.pairs, ctx.sorted_index = [], weakref.ref(index)  # (a weak one: hooks may mean to free the index)
        return _forward(x, weight, index, gate, n_out, ctx.pairs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple:
        saved = ctx.saved_tensors
        pairs = ctx.pairs if saved[2] is ctx.sorted_index() else None
        return _gradients(ctx, grad, partial(_backward_impl, pairs=pairs), saved)
