"""Tests of the expert projection op (switchhead.kernels) on every backend.

The Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1, set per test with monkeypatch;
`triton_kernels.load` re-imports the kernels when the variable changed since their import, because
``triton.jit`` reads it at decoration time). On a machine with a GPU, ``SWITCHHEAD_TEST_DEVICE=cuda`` runs the
op tests on CUDA tensors instead: the compiled kernels, still against the float64 loop on the CPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import re
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from switchhead.errors import SwitchheadError
from switchhead.kernels import expert_projection, reference, torch_paths
from switchhead.kernels.ops import KernelBackendError, project

# Imported here, before any test sets TRITON_INTERPRET=1: triton.jit reads the variable when it decorates, also
# triton.language's own helpers, which the sm_90 builds below need as compiled-mode functions (imported first under
# the interpreter, they failed to build whenever an interpreter test ran first in a process that had not imported
# triton yet). Not installed off Linux: the file is skipped there.
pytest.importorskip("triton")

# Where the op tests put their tensors: "cpu" (Triton through its interpreter) or "cuda" (compiled kernels).
DEVICE = os.environ.get("SWITCHHEAD_TEST_DEVICE", "cpu")


@dataclass(frozen=True)
class Shape:
    n: int
    n_in: int  # I
    slots: int  # S
    n_out: int  # R
    experts: int  # E
    d_in: int
    d_out: int
    gated: bool = True
    routing: str = "random"  # random | one_expert | some_empty

    def __str__(self) -> str:
        g = "gate" if self.gated else "nogate"
        dims = f"N{self.n}-I{self.n_in}-S{self.slots}-R{self.n_out}-E{self.experts}"
        return f"{dims}-{self.d_in}x{self.d_out}-{g}-{self.routing}"


# S = G*k with G groups (heads) of k slots; I and R each in {1, G, S}. N = 1, small, not a multiple of 16.
SHAPES = [
    Shape(1, 1, 1, 1, 1, 8, 8),  # k=1, E=1, N=1
    Shape(1, 2, 6, 1, 8, 12, 20),  # SwitchHead O at decode
    Shape(3, 1, 4, 4, 5, 10, 9, gated=False),  # sigma-MoE up: R = S, no gate
    Shape(5, 1, 6, 2, 8, 20, 12),  # SwitchHead V: I=1, R=G (k=3)
    Shape(37, 2, 6, 1, 8, 12, 20),  # SwitchHead O: I=G, R=1 (k=3)
    Shape(37, 1, 6, 2, 8, 20, 12, routing="one_expert"),
    Shape(21, 4, 4, 1, 6, 9, 17, routing="some_empty"),  # sigma-MoE down: I = S, R = 1 (k=4)
    Shape(19, 2, 2, 2, 3, 16, 16),  # I = R = S (k=1 per group)
    Shape(17, 3, 3, 3, 4, 7, 18, gated=False, routing="some_empty"),
    Shape(24, 1, 8, 1, 7, 18, 10),  # I=1, R=1, k=4, G=2
    Shape(33, 2, 8, 4, 2, 11, 13, routing="one_expert"),  # I=G, R=S/2
    Shape(29, 1, 6, 2, 7, 14, 11, gated=False),  # segments of 3 slots without gates
    Shape(23, 2, 6, 3, 5, 9, 7),  # rows shared by 3 slots on the input side, 2 on the output side
    Shape(27, 4, 8, 2, 5, 10, 14),  # I > R > 1: four input rows contracted onto two output rows
]
REGIMES = ["gather", "dense", "grouped", "combo"]


def make(shape: Shape, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.n, shape.n_in, shape.d_in, generator=g, dtype=torch.float64)
    w = torch.randn(shape.experts, shape.d_in, shape.d_out, generator=g, dtype=torch.float64) / shape.d_in**0.5
    if shape.routing == "one_expert":
        index = torch.full((shape.n, shape.slots), shape.experts - 1, dtype=torch.int64)
    elif shape.routing == "some_empty":  # only the even experts are ever chosen
        index = torch.randint(0, (shape.experts + 1) // 2, (shape.n, shape.slots), generator=g) * 2
    else:
        index = torch.randint(0, shape.experts, (shape.n, shape.slots), generator=g)
    gate = torch.rand(shape.n, shape.slots, generator=g, dtype=torch.float64) if shape.gated else None
    grad = torch.randn(shape.n, shape.n_out, shape.d_out, generator=g, dtype=torch.float64)
    cast = [x.to(dtype), w.to(dtype), index, gate.float() if gate is not None else None, grad.to(dtype)]
    return (x, w, index, gate, grad), cast


def naive(x, w, index, gate, n_out):
    """out[n, s // (S/R)] += gate[n, s] * x[n, s // (S/I)] @ w[index[n, s]], one (n, s) at a time."""
    n_tokens, n_in, _ = x.shape
    slots = index.shape[1]
    rows = [[torch.zeros(w.shape[-1], dtype=x.dtype) for _ in range(n_out)] for _ in range(n_tokens)]
    for n in range(n_tokens):
        for s in range(slots):
            y = x[n, s // (slots // n_in)] @ w[index[n, s]]
            if gate is not None:
                y = y * gate[n, s]
            rows[n][s // (slots // n_out)] = rows[n][s // (slots // n_out)] + y
    return torch.stack([torch.stack(r) for r in rows])


def naive_all(shape: Shape, exact):
    """Output and gradients (x, weight, gate) of the naive loop in float64."""
    x, w, index, gate, grad = (
        t.clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in exact
    )
    out = naive(x, w, index, gate, shape.n_out)
    wrt = [x, w] + ([gate] if gate is not None else [])
    return [out.detach(), *torch.autograd.grad(out, wrt, grad)]


def on_device(tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def via_op(shape: Shape, cast, entry=expert_projection):
    x, w, index, gate, grad = (
        t.to(DEVICE, copy=True).requires_grad_(t.is_floating_point()) if t is not None else None for t in cast
    )
    out = entry(x, w, index, gate, shape.n_out)
    wrt = [x, w] + ([gate] if gate is not None else [])
    return [t.cpu() for t in (out.detach(), *torch.autograd.grad(out, wrt, grad))]


def via_regime(shape: Shape, cast, regime: str):
    x, w, index, gate, grad = cast
    out = torch_paths.FORWARD[regime](x, w, index, gate, shape.n_out)
    gx, gw, gg = torch_paths.BACKWARD[regime](grad, x, w, index, gate, True)
    return [out, gx, gw] + ([gg] if gate is not None else [])


TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (1e-2, 2e-2), torch.bfloat16: (4e-2, 8e-2)}


def assert_matches(got, want, dtype, names=("out", "grad_x", "grad_weight", "grad_gate")):
    rtol, atol = TOL[dtype]
    assert len(got) == len(want)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        scale = max(w.abs().max().item(), 1.0)  # relative to the tensor's own magnitude
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setenv("SWITCHHEAD_KERNEL", name)
        if name == "triton" and DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1")

    return use


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_op_matches_naive_loop(shape, name, backend):
    backend(name)
    exact, cast = make(shape)
    assert_matches(via_op(shape, cast), naive_all(shape, exact), torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_project_in_training_matches_naive_loop(shape, name, backend):
    """The model's entry in eager training (`project`: an autograd.Function with the op's forward and backward,
    whose Triton backward takes the pairs as the forward sorted them) against the float64 loop."""
    backend(name)
    exact, cast = make(shape)
    assert_matches(via_op(shape, cast, project), naive_all(shape, exact), torch.float32)


def test_kernels_run_on_the_inputs_device_whatever_device_is_current(backend):
    """Triton launches on the current CUDA device; the kernels' entry points make their inputs' device current, so that
    a model on another GPU than the current one (`--device cuda:1`) runs where its tensors are. Every CUDA device in
    turn, with device 0 current: the op (forward and backward) and `project` in inference mode (decoding), at the
    gather kernel's N and the tiled kernels', against the float64 loop. With one GPU that is the one device, and on
    the CPU the suite's device: the check bites on a machine with several GPUs."""
    backend("triton")
    count = torch.cuda.device_count() if DEVICE == "cuda" else 0
    devices = [f"cuda:{i}" for i in range(count)] if count else [DEVICE]
    with torch.cuda.device(0) if count else nullcontext():
        for shape, device in itertools.product((Shape(1, 2, 6, 1, 8, 12, 20), Shape(40, 2, 6, 2, 8, 12, 20)), devices):
            exact, cast = make(shape)
            want = naive_all(shape, exact)
            x, w, index, gate, grad = (t.to(device, copy=True) for t in cast)
            x, w, gate = (t.requires_grad_() for t in (x, w, gate))
            out = expert_projection(x, w, index, gate, shape.n_out)
            got = [out.detach(), *torch.autograd.grad(out, [x, w, gate], grad)]
            assert {t.device for t in got} == {torch.device(device)}
            assert_matches([t.cpu() for t in got], want, torch.float32)
            with torch.inference_mode():
                decoded = project(x, w, index, gate, shape.n_out)
            assert decoded.device == torch.device(device)
            assert_matches([decoded.cpu()], want[:1], torch.float32)
            assert not count or torch.cuda.current_device() == 0  # left as it was


def test_project_backward_reuses_the_forward_sort_on_every_pass(backend):
    """A graph kept for a second backward (retain_graph) sorts nothing again and gives the same gradients; the
    kernels' sort of the index happens once, in the forward. Saved-tensor hooks that hand back another tensor
    (offloading, checkpointing) get it sorted again, with the same gradients."""
    from switchhead.kernels import triton_kernels

    backend("triton")
    shape = Shape(40, 2, 6, 1, 8, 12, 20)  # past GATHER_MAX_TOKENS: the tiled forward, which sorts
    x, w, index, gate, grad = on_device(make(shape)[1])
    x, w, gate = (t.requires_grad_() for t in (x, w, gate))
    tk = triton_kernels.load()
    sorts = []
    sort_pairs = tk._sort_pairs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tk, "_sort_pairs", lambda *args: sorts.append(1) or sort_pairs(*args))
        out = project(x, w, index, gate, 1)
        first = torch.autograd.grad(out, [x, w, gate], grad, retain_graph=True)
        second = torch.autograd.grad(out, [x, w, gate], grad)
        assert len(sorts) == 1
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            out = project(x, w, index, gate, 1)
        hooked = torch.autograd.grad(out, [x, w, gate], grad)
        assert len(sorts) == 3
    for a, b, c in zip(first, second, hooked):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # (CUDA adds shared rows with atomics)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
    out = project(x, w, index, gate, 1)
    index[0, 0] = (index[0, 0] + 1) % shape.experts  # changed in place: its sort is stale, and autograd refuses it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, [x], grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_unpadded_forward_matches_naive_loop(dtype, backend):
    """Input rows at least UNPADDED_FORWARD_MIN_WIDTH wide go through the forward unpadded (the backward pads)."""
    backend("triton")
    from switchhead.kernels import triton_kernels

    shape = Shape(11, 1, 4, 2, 5, triton_kernels.load().UNPADDED_FORWARD_MIN_WIDTH + 3, 9)
    exact, cast = make(shape, dtype)
    assert_matches(via_op(shape, cast), naive_all(shape, exact), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("regime", REGIMES)
def test_torch_regimes_match_naive_loop(shape, regime):
    exact, cast = make(shape)
    assert_matches(via_regime(shape, cast, regime), naive_all(shape, exact), torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_forward_in_float64_is_exact(shape):
    """The gather forward on the CPU is one embedding_bag in fp32 and fp64: float64 gives the loop to rounding."""
    exact, _ = make(shape)
    x, w, index, gate, _ = exact
    got = torch_paths.FORWARD["gather"](x, w, index, gate, shape.n_out)
    torch.testing.assert_close(got, naive(x, w, index, gate, shape.n_out), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[3]], ids=str)
def test_gather_forward_after_inference_mode_records_autograd(shape):
    """The embedding_bag's offsets are cached per shape: a first call in inference mode (decoding) must not leave
    an inference tensor behind for a later call whose autograd saves it (the regime called with inputs that
    require grad), and the second call's gradients are the loop's."""
    exact, _ = make(shape)
    x, w, index, gate, grad = exact
    with torch.inference_mode():
        first = torch_paths.FORWARD["gather"](x, w, index, gate, shape.n_out)
    trained = [t.clone().requires_grad_() for t in (x, w) + ((gate,) if gate is not None else ())]
    got = torch_paths.FORWARD["gather"](*trained[:2], index, trained[2] if gate is not None else None, shape.n_out)
    torch.testing.assert_close(got.detach(), first, rtol=0, atol=0)
    want = naive_all(shape, exact)
    grads = torch.autograd.grad(got, trained, grad)
    for g, expected in zip((got.detach(), *grads), want):
        torch.testing.assert_close(g, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [SHAPES[4], SHAPES[5], SHAPES[6], SHAPES[10], SHAPES[11]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("regime", ["grouped", "combo"])
@pytest.mark.parametrize("buffers", [True, False], ids=["buffers", "fresh"])
def test_blocks_add_up(shape, dtype, regime, buffers, monkeypatch):
    """grouped and combo cut an expert's (or expert set's) rows into blocks; with tiny blocks each spans several,
    and the blocks' temporaries are views of buffers shared by all blocks, or fresh for each."""
    monkeypatch.setattr(torch_paths, "GROUPED_BLOCK_ELEMENTS", 60)  # a few rows
    monkeypatch.setattr(torch_paths, "BUFFER_MIN_ELEMENTS", 0 if buffers else 1 << 62)
    monkeypatch.setattr(torch_paths, "GROUPED_MM_MAX_ELEMENTS", 0)  # the blocks of the experts' pairs
    monkeypatch.setattr(torch_paths, "GROUPED_MM_BACKWARD_MAX_ELEMENTS", 0)
    exact, cast = make(shape, dtype)
    assert_matches(via_regime(shape, cast, regime), naive_all(shape, exact), dtype)


# Widths that are multiples of 4, as the grouped GEMM needs in fp32.
GROUPED_MM_SHAPES = [
    Shape(1, 1, 6, 2, 8, 20, 12),  # one token
    Shape(37, 1, 6, 2, 8, 20, 12),  # V-like: gated after the product (D_in >= D_out)
    Shape(37, 2, 6, 1, 8, 12, 20),  # O-like: gated inputs (D_in < D_out)
    Shape(30, 1, 4, 4, 5, 12, 8, gated=False),  # sigma-MoE up: one pair per output row
    Shape(21, 4, 4, 1, 6, 8, 16, routing="some_empty"),  # sigma-MoE down: one pair per input row
    Shape(25, 1, 6, 2, 8, 20, 12, routing="one_expert"),
]


@pytest.mark.parametrize("shape", GROUPED_MM_SHAPES, ids=str)
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "frozen"])
def test_grouped_regime_through_grouped_mm(shape, trained, monkeypatch):
    """grouped with its experts in one call of torch's grouped GEMM (few pairs per expert), with the weight trained
    or frozen (no weight gradient), the gates trained."""
    exact, cast = make(shape)
    x, w, index, gate, grad = cast
    assert torch_paths._grouped_mm_fits(x, w, index, backward=True)  # the default thresholds send them there
    monkeypatch.setattr(torch_paths, "_segments_forward", None)  # the per-expert blocks are not what runs
    monkeypatch.setattr(torch_paths, "_segments_backward", None)
    out = torch_paths.grouped_forward(x, w, index, gate, shape.n_out)
    gx, gw, gg = torch_paths.grouped_backward(grad, x, w, index, gate, True, trained)
    want = naive_all(shape, exact)
    got = [out, gx, gw] + ([gg] if gate is not None else [])
    if not trained:
        assert gw.numel() == 0
        got, want = got[:2] + got[3:], want[:2] + want[3:]
    assert_matches(got, want, torch.float32, ("out", "grad_x") + ("grad_weight",) * trained + ("grad_gate",))


@pytest.mark.parametrize(
    "shape, dtype",
    [(s, torch.float32) for s in SHAPES] + [(s, d) for s in SHAPES[1::3] for d in (torch.bfloat16, torch.float16)],
    ids=str,
)
def test_grouped_mm_regime_matches_naive_loop(shape, dtype):
    """The grouped_mm regime (the grouped GEMM at any size, `regime=` only): any widths (zero-padded to the
    grouped GEMM's 16-byte strides), fp32 and half inputs, on the tests' device."""
    exact, cast = make(shape, dtype)
    x, w, index, gate, grad = on_device(cast)
    out = torch_paths.grouped_mm_forward(x, w, index, gate, shape.n_out)
    gx, gw, gg = torch_paths.grouped_mm_backward(grad, x, w, index, gate, True)
    got = [t.cpu() for t in [out, gx, gw] + ([gg] if gate is not None else [])]
    assert [t.dtype for t in got[:3]] == [dtype] * 3
    assert_matches(got, naive_all(shape, exact), dtype)


def test_grouped_mm_regime_refuses_float64():
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(RuntimeError, match="grouped_mm regime takes float32, bfloat16 or float16"):
        torch_paths.forward(x.double(), w.double(), index, gate, SHAPES[3].n_out, regime="grouped_mm")


@pytest.mark.parametrize("missing", ["absent", "cuda-only", "wrong"])
def test_grouped_regime_without_a_cpu_grouped_mm(missing, monkeypatch):
    """A torch without the grouped GEMM on the CPU (absent, raising, or computing something else) keeps the blocks,
    and the regime its results."""

    def cuda_only(*args, **kwargs):
        raise RuntimeError("grouped gemm is only supported on CUDA")

    stand_in = {"absent": None, "cuda-only": cuda_only, "wrong": lambda a, b, offs: a[:, :0]}[missing]
    monkeypatch.setattr(torch_paths, "_GROUPED_MM", stand_in)
    torch_paths._grouped_mm_on_cpu.cache_clear()
    try:
        shape = GROUPED_MM_SHAPES[1]
        exact, cast = make(shape)
        assert not torch_paths._grouped_mm_fits(*cast[:2], cast[2])
        assert_matches(via_regime(shape, cast, "grouped"), naive_all(shape, exact), torch.float32)
    finally:
        monkeypatch.undo()
        torch_paths._grouped_mm_on_cpu.cache_clear()
    assert torch_paths._grouped_mm_on_cpu()


def test_grouped_mm_only_where_it_applies():
    """The grouped GEMM takes fp32 CPU tensors whose rows are multiples of 16 bytes, and few pairs per expert."""
    _, (x, w, index, _, _) = make(Shape(40, 1, 6, 2, 8, 20, 12))
    assert torch_paths._grouped_mm_fits(x, w, index)
    assert not torch_paths._grouped_mm_fits(x.double(), w.double(), index)
    assert not torch_paths._grouped_mm_fits(x.bfloat16(), w.bfloat16(), index)
    assert not torch_paths._grouped_mm_fits(x[..., :18], w[:, :18, :], index)  # D_in = 18
    assert not torch_paths._grouped_mm_fits(x, w[..., :10].contiguous(), index)  # D_out = 10
    assert not torch_paths._grouped_mm_fits(x, w.transpose(1, 2).contiguous().transpose(1, 2), index)
    limits = {False: torch_paths.GROUPED_MM_MAX_ELEMENTS, True: torch_paths.GROUPED_MM_BACKWARD_MAX_ELEMENTS}
    assert torch_paths._grouped_mm_on_cpu()  # this torch has it (2.13 does)
    for backward, limit in limits.items():
        pairs = limit * w.shape[0] // 20  # pairs at the threshold (D_in = 20), and two more
        for n, fits in ((pairs // 2, True), (pairs // 2 + 1, False)):
            assert torch_paths._grouped_mm_fits(x, w, torch.zeros(n, 2, dtype=torch.long), backward) == fits


@pytest.mark.parametrize("shape", [SHAPES[3], SHAPES[5], SHAPES[10], SHAPES[11]], ids=str)
@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "copied"])
def test_dense_weight_broadcast_or_copied(shape, broadcast, monkeypatch):
    """The dense path multiplies every expert by a broadcast batched matmul (few rows) or by the weight copied
    side by side into one GEMM (`broadcast_max_rows`); both lay the products out alike for the gates. Its
    backward likewise takes grad_x and the weight gradient one expert at a time against the weight as it lies, or
    against the copy (DENSE_SPLIT_MAX_ROWS)."""
    kind = torch_paths.this_cpu()
    limit = 1 << 62 if broadcast else 0
    costs = torch_paths.CPU_COSTS[kind]._replace(broadcast_max_rows={"aligned": limit, "unaligned": limit})
    monkeypatch.setitem(torch_paths.CPU_COSTS, kind, costs)
    monkeypatch.setattr(torch_paths, "DENSE_SPLIT_MAX_ROWS", 1 << 62 if broadcast else 0)
    assert torch_paths.dense_expands_inputs(shape.n_in, shape.n_out)  # the shapes take that path
    exact, cast = make(shape)
    assert_matches(via_regime(shape, cast, "dense"), naive_all(shape, exact), torch.float32)


# Widths that grouped and combo pad for their GEMMs (47 -> 48, 31 -> 32) and one too narrow to pad (19).
PADDED_SHAPES = [
    Shape(40, 1, 6, 2, 10, 47, 31),  # V-like, k = 3
    Shape(40, 2, 6, 1, 10, 31, 47),  # O-like
    Shape(33, 4, 4, 1, 6, 64, 19, routing="some_empty"),  # sigma-MoE down: neither width changes
]


@pytest.mark.parametrize("shape", PADDED_SHAPES, ids=str)
@pytest.mark.parametrize("regime", ["grouped", "combo"])
@pytest.mark.parametrize("buffers", [True, False], ids=["buffers", "fresh"])
def test_padded_gemm_rows(shape, regime, buffers, monkeypatch):
    """On the CPU in fp32, grouped and combo write their GEMMs' rows padded (GEMM_ALIGN) once the experts have
    enough pairs; here always, and with blocks of a few rows, into shared buffers or fresh temporaries."""
    kind = torch_paths.this_cpu()
    monkeypatch.setitem(torch_paths.CPU_COSTS, kind, torch_paths.CPU_COSTS[kind]._replace(gemm_pad_min_pairs=0))
    monkeypatch.setattr(torch_paths, "GROUPED_BLOCK_ELEMENTS", 8 * 64)
    monkeypatch.setattr(torch_paths, "BUFFER_MIN_ELEMENTS", 0 if buffers else 1 << 62)
    exact, cast = make(shape)
    x, _, index, _, _ = cast
    widths = [torch_paths._gemm_width(d, x, index, shape.experts) for d in (shape.d_in, shape.d_out)]
    assert (widths != [shape.d_in, shape.d_out]) == (shape.d_out != 19)  # the shapes test what they say
    assert_matches(via_regime(shape, cast, regime), naive_all(shape, exact), torch.float32)


@pytest.mark.parametrize("regime", ["grouped", "combo", "grouped_mm"])
def test_torch_weight_grad_is_deterministic(regime, monkeypatch):
    monkeypatch.setattr(torch_paths, "GROUPED_BLOCK_ELEMENTS", 24 * 50)  # 50 rows: several blocks per expert
    # grouped's experts one GEMM call each, or all of a block's in one grouped GEMM call
    monkeypatch.setattr(torch_paths, "GROUPED_MM_BACKWARD_MAX_ELEMENTS", 1 << 62 if regime == "grouped_mm" else 0)
    regime = regime.removesuffix("_mm")
    shape = Shape(300, 1, 6, 2, 4, 24, 16)
    _, (x, w, index, gate, grad) = make(shape)
    runs = [torch_paths.backward(grad, x, w, index, gate, True, regime=regime)[1] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


HALF_SHAPES = [SHAPES[1], SHAPES[4], SHAPES[6]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=str)
@pytest.mark.parametrize("regime", REGIMES)
def test_torch_regimes_half(shape, regime, dtype):
    exact, cast = make(shape, dtype)
    got = via_regime(shape, cast, regime)
    assert [t.dtype for t in got[:3]] == [dtype] * 3
    assert_matches(got, naive_all(shape, exact), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES + [SHAPES[2]], ids=str)  # SHAPES[2]: no gate
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("widen", [True, False])
def test_torch_paths_half_widened_or_not(shape, regime, dtype, widen):
    """Half inputs run in float32 on CPUs without half instructions (`widen` None); both ways give half results."""
    exact, (x, w, index, gate, grad) = make(shape, dtype)
    out = torch_paths.forward(x, w, index, gate, shape.n_out, regime, widen)
    got = [out, *torch_paths.backward(grad, x, w, index, gate, True, regime=regime, widen=widen)]
    assert [t.dtype for t in got] == [dtype, dtype, dtype, gate.dtype if gate is not None else dtype]
    assert_matches(got if gate is not None else got[:3], naive_all(shape, exact), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES + [Shape(300, 1, 6, 2, 10, 24, 16)], ids=str)
def test_torch_op_half(shape, dtype, backend):
    """The op picks its regime by dtype too (bf16 keeps dense longer on CPUs with bf16 instructions)."""
    backend("torch")
    exact, cast = make(shape, dtype)
    assert_matches(via_op(shape, cast), naive_all(shape, exact), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=str)
def test_triton_half(shape, dtype, backend):
    backend("triton")
    exact, cast = make(shape, dtype)
    got = via_op(shape, cast)
    assert [t.dtype for t in got[:3]] == [dtype] * 3
    assert got[3].dtype == torch.float32  # the gate stays fp32 (the model routes in fp32)
    assert_matches(got, naive_all(shape, exact), dtype)


@pytest.mark.parametrize(
    "shape, dtype",
    [(s, torch.float32) for s in SHAPES] + [(s, torch.bfloat16) for s in [SHAPES[2], SHAPES[3], *HALF_SHAPES]],
    ids=str,
)
def test_triton_backward_with_cublas_gradients_matches_naive_loop(shape, dtype, backend):
    """The backward with grad_x as one GEMM (`dense_grad_x`; the gate gradient then from the grouped kernel run
    forward-oriented, storing nothing) or the weight gradient as one GEMM (`dense_grad_w`), or both; with the gate
    and the weight gradients asked for and not."""
    from switchhead.kernels import triton_kernels

    backend("triton")
    tk = triton_kernels.load()
    exact, cast = make(shape, dtype)
    want = dict(zip(("grad_x", "grad_weight", "grad_gate"), naive_all(shape, exact)[1:]))
    x, w, index, gate, grad = on_device(cast)
    needs = [(True, True), (False, True), (True, False)]  # (gate gradient, weight gradient)
    routes = [(True, False), (False, True), (True, True)]  # (dense_grad_x, dense_grad_w); neither: other tests
    for (need_gate_grad, need_weight_grad), (dense_grad_x, dense_grad_w) in itertools.product(needs, routes):
        flags = dict(dense_grad_x=dense_grad_x, dense_grad_w=dense_grad_w)
        got = tk.backward(grad, x, w, index, gate, need_gate_grad, need_weight_grad, **flags)
        if need_weight_grad and not need_gate_grad and dtype == torch.float32:  # bitwise reproducible, any route
            assert torch.equal(got[1], tk.backward(grad, x, w, index, gate, False, True, **flags)[1])
        asked = {"grad_x": True, "grad_weight": need_weight_grad, "grad_gate": gate is not None and need_gate_grad}
        assert [t.numel() > 0 for t in got] == list(asked.values())
        names = [name for name, on in asked.items() if on]
        got = [t.cpu() for t in got if t.numel()]
        assert [t.dtype for t in got] == [torch.float32 if name == "grad_gate" else dtype for name in names]
        assert_matches(got, [want[name] for name in names], dtype, names=names)


def _split_weight_grad(monkeypatch, shape: Shape) -> None:
    """Let the weight gradient cut each expert's pairs into chunks even for a tiny shape."""
    from switchhead.kernels import triton_kernels

    tk = triton_kernels.load()
    monkeypatch.setattr(tk, "WEIGHT_GRAD_MIN_PAIRS", 2)
    bucket = tk._bucket(shape.n * shape.slots)
    assert tk._weight_grad_splits(shape.experts, shape.d_in, shape.d_out, bucket, torch.device(DEVICE)) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# Shape(65, ...): 130 pairs on one expert in 8 chunks, 8 * 16 + 2: chunks of the pairs / 8 rounded down to whole
# 16-pair steps (the interpreter's BLOCK_P) would leave the last two out.
@pytest.mark.parametrize(
    "shape", [SHAPES[4], SHAPES[6], SHAPES[10], Shape(45, 3, 6, 1, 3, 16, 24), Shape(65, 1, 2, 2, 1, 8, 8)], ids=str
)
def test_triton_weight_grad_in_chunks(shape, dtype, backend, monkeypatch):
    """The chunks' partial sums (some chunks empty, some experts without pairs) add up to the whole gradient."""
    backend("triton")
    _split_weight_grad(monkeypatch, shape)
    exact, cast = make(shape, dtype)
    assert_matches(via_op(shape, cast), naive_all(shape, exact), dtype)


# Every row of `gpu.sh splits` on an H200 (132 SMs, as NOMINAL_SMS; docs/BENCHMARKS.md): the benchmark shape, N
# and a chunk count that ran fastest or within 4 % of the fastest there.
@pytest.mark.parametrize(
    "name, n, chunks",
    [("47M V", 4096, 4), ("47M V", 16384, 4), ("47M O", 4096, 4), ("47M O", 16384, 4), ("262M V", 4096, 1),
     ("262M V", 16384, 1), ("262M O", 4096, 1), ("262M O", 16384, 1), ("sMoE up", 4096, 1), ("sMoE up", 16384, 2),
     ("sMoE down", 4096, 1), ("sMoE down", 16384, 2)],
)  # fmt: skip
def test_weight_grad_chunk_count_follows_the_timings(name, n, chunks):
    from switchhead.kernels import triton_kernels

    bench_module = _benchmark_module()
    (case,) = [c for c in bench_module.CASES if c.name == name]
    assert triton_kernels.load()._sm_count(torch.device("cpu")) == 132
    assert bench_module.geometry_splits(case, n, torch.device("cpu")) == chunks


@pytest.mark.parametrize("count", [1, 3, 8])
def test_triton_weight_grad_forced_chunk_count(count, backend, monkeypatch):
    """WEIGHT_GRAD_SPLITS overrides the geometry (for the benchmark that times each count): any count, one that
    does not divide the pairs or leaves chunks empty included, still adds up to the whole gradient."""
    from switchhead.kernels import triton_kernels

    backend("triton")
    tk = triton_kernels.load()
    monkeypatch.setattr(tk, "WEIGHT_GRAD_SPLITS", count)
    assert tk._weight_grad_splits(8, 16, 24, 1 << 20, torch.device(DEVICE)) == count
    shape = Shape(37, 1, 6, 2, 8, 20, 12)
    exact, cast = make(shape)
    assert_matches(via_op(shape, cast), naive_all(shape, exact), torch.float32)


@pytest.mark.parametrize("chunks", [False, True], ids=["whole", "chunks"])
def test_triton_weight_grad_is_deterministic(chunks, backend, monkeypatch):
    backend("triton")
    # Many pairs per expert (several BLOCK_P steps each). Two slots per input row: grad_x adds them with
    # atomics, which is order-independent (so bitwise reproducible on a GPU too) only for up to two addends.
    shape = Shape(45, 3, 6, 1, 3, 16, 24)
    if chunks:
        _split_weight_grad(monkeypatch, shape)
    _, cast = make(shape)
    first = via_op(shape, cast)
    second = via_op(shape, cast)
    assert torch.equal(first[2], second[2])
    assert torch.equal(first[1], second[1]) and torch.equal(first[3], second[3])


@pytest.mark.parametrize(
    "shape, name", [(SHAPES[3], "torch"), (SHAPES[4], "torch"), (SHAPES[8], "torch"), (SHAPES[3], "reference")], ids=str
)
def test_opcheck(shape, name, backend):
    backend(name)
    _, (x, w, index, gate, grad) = make(shape)
    x.requires_grad_()
    w.requires_grad_()
    if gate is not None:
        gate.requires_grad_()
    torch.library.opcheck(torch.ops.switchhead.expert_projection.default, (x, w, index, gate, shape.n_out))
    torch.library.opcheck(
        torch.ops.switchhead.expert_projection_backward.default,
        (grad, x.detach(), w.detach(), index, gate.detach() if gate is not None else None, gate is not None, True),
    )
    torch.library.opcheck(  # a frozen weight: no weight gradient
        torch.ops.switchhead.expert_projection_backward.default,
        (grad, x.detach(), w.detach(), index, None, False, False),
    )


def test_opcheck_triton(backend):
    backend("triton")
    shape = Shape(9, 2, 4, 1, 3, 8, 8)  # N > 8: the sorted-tile kernels, not the gather kernel
    x, w, index, gate, grad = on_device(make(shape)[1])
    args = (x.requires_grad_(), w.requires_grad_(), index, gate.requires_grad_(), shape.n_out)
    torch.library.opcheck(torch.ops.switchhead.expert_projection.default, args)
    torch.library.opcheck(
        torch.ops.switchhead.expert_projection_backward.default,
        (grad, x.detach(), w.detach(), index, gate.detach(), True, True),
    )
    torch.library.opcheck(
        torch.ops.switchhead.expert_projection_backward.default,
        (grad, x.detach(), w.detach(), index, gate.detach(), True, False),
    )


# Counting sort (up to 64 experts) and torch.sort beyond, with int16 and int64 keys; pair counts below one
# block, across several and not a multiple of any.
@pytest.mark.parametrize("n_experts", [1, 5, 16, 63, 64, 65, 2**15, 40000])
@pytest.mark.parametrize("n_tokens", [1, 37, 700])
def test_sort_pairs_groups_pairs_by_expert_stably(n_experts, n_tokens, backend):
    backend("triton")
    from switchhead.kernels import triton_kernels

    g = torch.Generator().manual_seed(n_experts)
    index = torch.randint(0, n_experts, (n_tokens, 6), generator=g)
    index[0, 0] = n_experts - 1  # the largest expert id is present
    index[-1, -1] = 0
    order, offsets = triton_kernels.load()._sort_pairs(index.to(DEVICE), n_experts)
    flat = index.reshape(-1)
    assert order.dtype == offsets.dtype == torch.int32
    assert order.tolist() == torch.argsort(flat, stable=True).tolist()
    assert offsets.tolist() == [0] + torch.bincount(flat, minlength=n_experts).cumsum(0).tolist()


def test_counting_sort_leaves_out_expert_ids_outside_the_range(backend):
    """CUDA indices are not checked (a host sync per call): an id outside [0, E) must not displace other pairs."""
    backend("triton")
    from switchhead.kernels import triton_kernels

    index = torch.randint(0, 5, (300, 4), generator=torch.Generator().manual_seed(1))
    index[3, 1], index[100, 0], index[299, 3] = -1, 5, 7  # 7 < E_PAD = 8: inside the one-hot's padded lanes
    order, offsets = triton_kernels.load()._sort_pairs(index.to(DEVICE), 5)
    flat = index.reshape(-1)
    valid = ((flat >= 0) & (flat < 5)).nonzero().squeeze(1)
    assert offsets.tolist() == [0] + torch.bincount(flat[valid], minlength=5).cumsum(0).tolist()
    assert order[: offsets[-1]].tolist() == valid[torch.argsort(flat[valid], stable=True)].tolist()


@pytest.mark.parametrize("n_experts", [5, 70])  # counting sort, torch.sort
def test_sort_pairs_of_a_strided_index_and_of_no_pairs(n_experts, backend):
    """The kernels' own entry points get the index as their caller has it: every other column of a wider tensor
    flattens to a view with stride 2, which the counting kernels must not read as if contiguous; and no pairs at
    all launch no block, while the offsets must still say that every expert has none."""
    backend("triton")
    from switchhead.kernels import triton_kernels

    tk = triton_kernels.load()
    wide = torch.randint(0, n_experts, (37, 12), generator=torch.Generator().manual_seed(2))
    index = wide[:, ::2].to(DEVICE)
    order, offsets = tk._sort_pairs(index, n_experts)
    flat = wide[:, ::2].reshape(-1)
    assert order.tolist() == torch.argsort(flat, stable=True).tolist()
    assert offsets.tolist() == [0] + torch.bincount(flat, minlength=n_experts).cumsum(0).tolist()
    torch.full((1 << 16,), 12345, dtype=torch.int32, device=DEVICE)  # freed memory that is not zero
    order, offsets = tk._sort_pairs(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), n_experts)
    assert order.numel() == 0 and offsets.tolist() == [0] * (n_experts + 1)
    x, w = torch.randn(0, 1, 4, device=DEVICE), torch.randn(n_experts, 4, 3, device=DEVICE)
    grad_x, grad_w, _ = tk.backward(torch.randn(0, 1, 3, device=DEVICE), x, w, index[:0], None, False, True)
    assert grad_x.shape == x.shape and torch.equal(grad_w, torch.zeros_like(w))


def test_autotune_key_buckets_token_counts(backend):
    backend("triton")
    from switchhead.kernels import triton_kernels

    tk = triton_kernels.load()
    assert [tk._bucket(n) for n in (1, 2, 3, 255, 256, 257, 4000)] == [1, 2, 4, 256, 256, 512, 4096]


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    from switchhead.kernels.ops import backend_for

    monkeypatch.delenv("SWITCHHEAD_KERNEL", raising=False)
    assert backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv("SWITCHHEAD_KERNEL", " Reference ")
    assert backend_for(torch.zeros(1)) == "reference"


def test_unknown_backend_is_a_clear_error(backend):
    backend("cuda-magic")
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(SwitchheadError, match="SWITCHHEAD_KERNEL='cuda-magic' is not one of"):
        expert_projection(x, w, index, gate, 2)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(KernelBackendError, match="TRITON_INTERPRET=1"):
        expert_projection(x, w, index, gate, 2)


@pytest.mark.parametrize(
    "triton_version, numpy_version, clash",
    [
        ("3.6.0", "2.4.6", True),
        ("3.6.0+git1a2b3c", "2.4.0rc1", True),
        ("2.3.1", "3.0.0", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.0", "2.4.6", False),
        ("3.10.0", "2.5.0", False),
        ("4.0.0", "2.4.0", False),
    ],
)
def test_interpreter_numpy_clash(triton_version, numpy_version, clash):
    from switchhead.kernels import triton_kernels

    message = triton_kernels.interpreter_clash(triton_version, numpy_version)
    assert (message is not None) == clash
    if clash:
        assert triton_version in message and numpy_version in message and "\n" not in message


def test_interpreter_numpy_clash_is_a_clear_error(backend, monkeypatch):
    """Triton < 3.7 with NumPy >= 2.4 under TRITON_INTERPRET=1: a one-line error instead of a TypeError from
    deep inside the interpreter."""
    import numpy
    import triton

    backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors, also where SWITCHHEAD_TEST_DEVICE=cuda
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(KernelBackendError, match="numpy<2.4"):
        expert_projection(x, w, index, gate, 2)


def test_bad_shapes_are_rejected():
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(RuntimeError, match="dividing S.*n_out 4"):
        expert_projection(x, w, index, gate, 4)  # R = 4 does not divide S = 6
    with pytest.raises(RuntimeError, match=r"weight \(8, 19, 12\)"):
        expert_projection(x, w[:, :-1], index, gate, 2)
    with pytest.raises(RuntimeError, match="float64"):
        expert_projection(x, w.double(), index, gate, 2)
    for n_out in (True, 2.0):  # R = 1 read from a bool; a float reached the index ops
        with pytest.raises(RuntimeError, match=f"n_out {n_out}"):
            project(x, w, index, gate, n_out)
        with pytest.raises(RuntimeError, match=f"n_out {n_out}"):  # through the dispatcher: training
            project(x.detach().requires_grad_(), w, index, gate, n_out)
    for args in ((x[:, :0], w, index, gate, 2), (x, w, index[:, :0], gate[:, :0], 2), (x, w[..., :0], index, gate, 2),
                 (x.long(), w.long(), index, gate, 2)):  # I = 0, S = 0, D_out = 0, integer inputs
        with pytest.raises(RuntimeError, match="expected floating-point x"):
            expert_projection(*args)


@pytest.mark.parametrize("meta", ["x", "weight", "index", "gate"])
def test_tensors_on_two_devices_are_rejected(meta):
    # A meta tensor among CPU ones dispatches to the fake implementation, which used to return uninitialised
    # memory; on a GPU machine the same check catches CPU/CUDA mixes.
    _, (x, w, index, gate, _) = make(SHAPES[3])
    args = dict(x=x, weight=w, index=index, gate=gate)
    args[meta] = args[meta].to("meta")
    with pytest.raises(RuntimeError, match=rf"must be on one device; got .*{meta} meta"):
        expert_projection(**args, n_out=2)


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[6]], ids=str)
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_no_tokens(shape, name, backend):
    """N = 0 (e.g. an empty batch): empty output and input gradient, zero weight gradient, on every backend."""
    backend(name)
    empty = Shape(0, *[getattr(shape, f) for f in ("n_in", "slots", "n_out", "experts", "d_in", "d_out")])
    _, cast = make(empty)
    x, w, index, gate, grad = (t.to(DEVICE).requires_grad_(t.is_floating_point()) for t in cast)
    out = expert_projection(x, w, index, gate, empty.n_out)
    assert out.shape == (0, empty.n_out, empty.d_out) and out.dtype == x.dtype
    gx, gw, gg = torch.autograd.grad(out, [x, w, gate], grad)
    assert gx.shape == x.shape and gg.shape == gate.shape
    assert gw.shape == w.shape and not gw.any()


def _backward_matching_its_fake(args: tuple) -> tuple[torch.Tensor, ...]:
    """The backward op's real results, checked to have the shapes, strides and dtypes its fake implementation
    gives (torch.compile builds its graph from the fake, and inductor asserts the real strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ops.switchhead.expert_projection_backward(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.switchhead.expert_projection_backward(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        )
    assert [(t.shape, t.stride(), t.dtype) for t in fake] == [(t.shape, t.stride(), t.dtype) for t in real]
    return real


@pytest.mark.parametrize("strided", ["weight", "x"])
@pytest.mark.parametrize("regime", REGIMES)
def test_fake_backward_has_the_real_gradients_strides(strided, regime, monkeypatch):
    """torch.compile (inductor) asserts that the real backward's results have the fake's strides: with a transposed
    weight (as nn.Linear stores its own) or a permuted x both must be contiguous."""
    monkeypatch.setattr(torch_paths, "choose_regime", lambda *a, **k: regime)
    g = torch.Generator().manual_seed(3)
    n, e = 40, 6
    x = torch.randn(5, n, 1, generator=g).permute(1, 2, 0) if strided == "x" else torch.randn(n, 1, 5, generator=g)
    w = torch.randn(e, 3, 5, generator=g).transpose(1, 2) if strided == "weight" else torch.randn(e, 5, 3, generator=g)
    args = (torch.randn(n, 2, 3, generator=g), x, w, torch.randint(0, e, (n, 4), generator=g), torch.rand(n, 4))
    args += (True, True)
    _backward_matching_its_fake(args)


FROZEN_SHAPES = [SHAPES[1], SHAPES[2], SHAPES[4], SHAPES[6], SHAPES[11], Shape(300, 1, 6, 2, 8, 20, 12)]


@pytest.mark.parametrize("shape", FROZEN_SHAPES, ids=str)
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_frozen_weight(shape, name, backend):
    """A weight that does not require grad gets none; x's and the gate's are still the naive loop's."""
    backend(name)
    exact, cast = make(shape)
    x, w, index, gate, grad = on_device(cast)
    wrt = [x.requires_grad_()] + ([gate.requires_grad_()] if gate is not None else [])
    out = expert_projection(x, w, index, gate, shape.n_out)
    got = torch.autograd.grad(out, wrt, grad)
    _, want_x, _, *want_gate = naive_all(shape, exact)
    for what, g, want in zip(["grad_x", "grad_gate"], got, [want_x, *want_gate]):
        torch.testing.assert_close(g.cpu().double(), want, rtol=2e-5, atol=1e-4, msg=lambda m, w=what: f"{w}: {m}")


PRODUCTS = {"aten::mm", "aten::mv", "aten::addr_", "aten::addmm", "aten::addmm_", "aten::bmm"}
PRODUCTS |= {"aten::index_add_", "aten::embedding_bag", "aten::_grouped_mm"}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("shape", [SHAPES[3], SHAPES[4], SHAPES[12]], ids=str)
def test_frozen_weight_skips_its_products(shape, regime, monkeypatch):
    """The backward of a frozen weight runs fewer products (GEMMs, index-adds) than a trained one's."""
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "torch")
    monkeypatch.setattr(torch_paths, "choose_regime", lambda *a, **k: regime)
    _, (x, w, index, gate, grad) = make(shape)
    counts = {}
    for trained in (True, False):
        xs, ws, gs = (t.clone().requires_grad_(t is not w or trained) for t in (x, w, gate))
        out = expert_projection(xs, ws, index, gs, shape.n_out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(out, [xs, gs] + ([ws] if trained else []), grad)
        counts[trained] = sum(e.name in PRODUCTS for e in prof.events())
    assert 0 < counts[False] < counts[True]


def test_frozen_weight_launches_no_weight_gradient_kernel(monkeypatch):
    """The Triton backward without a weight gradient launches everything else but not its kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # recorded, not run: the compiled module's launches
    from switchhead.kernels import gpu_build, triton_kernels

    tk = triton_kernels.load()
    _, (x, w, index, gate, grad) = make(Shape(40, 2, 6, 1, 8, 12, 20))
    kernels = {}
    for trained in (True, False):
        recorded = []
        with gpu_build._recording(tk, recorded):
            tk.backward(grad, x, w, index, gate, True, trained)
        kernels[trained] = [launch.kernel for launch in recorded]
    expected = list(kernels[True])
    expected.remove("_weight_grad_kernel")
    assert kernels[False] == expected


@pytest.mark.parametrize("entry", [expert_projection, project], ids=["op", "project"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4], SHAPES[6], Shape(300, 1, 6, 2, 8, 20, 12)], ids=str)
@pytest.mark.parametrize("name", ["reference", "torch"])
def test_autocast_does_not_reach_inside_the_op(shape, name, entry, backend):
    """Under autocast the op computes as without it, forward and backward, through the dispatcher or the model's
    entry (`project`'s autograd.Function in training): autocast does not cast a custom op's inputs, and must not
    round the products inside it either."""
    backend(name)
    _, cast = make(shape)
    plain = via_op(shape, cast, entry)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        under = via_op(shape, cast, entry)
    for name, got, want in zip(["out", "grad_x", "grad_weight", "grad_gate"], under, plain):
        if DEVICE == "cpu":
            assert torch.equal(got, want), name
        else:  # CUDA's index_add_ adds with atomics, so two fp32 runs differ in the last bits; bf16 rounding is ~1e-3
            scale = max(want.abs().max().item(), 1.0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_triton_refuses_float64(monkeypatch):
    """The Triton kernels accumulate in float32: forcing them on float64 is an error (auto sends it to PyTorch)."""
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    _, (x, w, index, gate, _) = make(SHAPES[3])
    with pytest.raises(KernelBackendError, match="float64"):
        expert_projection(x.double(), w.double(), index, gate.double(), SHAPES[3].n_out)


@pytest.mark.parametrize("bad", ["no input width", "integer gate"])
def test_op_names_an_empty_input_width_or_a_non_float_gate(bad):
    _, (x, w, index, gate, _) = make(SHAPES[3])
    if bad == "no input width":
        x, w = x[..., :0], w[:, :0]
    else:
        gate = (gate * 10).long()
    with pytest.raises(RuntimeError, match=r"floating-point gate .* D_in, D_out >= 1"):
        expert_projection(x, w, index, gate, SHAPES[3].n_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # half precision takes gather's product loop
@pytest.mark.parametrize("regime", REGIMES)
def test_regimes_take_no_tokens(regime, dtype):
    """Each PyTorch regime called directly (as benchmarks/kernels.py does; the op returns before them) with N = 0."""
    empty = Shape(0, *[getattr(SHAPES[3], f) for f in ("n_in", "slots", "n_out", "experts", "d_in", "d_out")])
    _, (x, w, index, gate, grad) = make(empty, dtype)
    out = torch_paths.FORWARD[regime](x, w, index, gate, empty.n_out)
    assert out.shape == (0, empty.n_out, empty.d_out) and out.dtype == dtype
    gx, gw, gg = torch_paths.BACKWARD[regime](grad, x, w, index, gate, True)
    assert gx.shape == x.shape and gg.shape == gate.shape and gw.shape == w.shape and not gw.any()


@pytest.mark.parametrize("n", [1, 20, 300])  # gather, dense and grouped regimes
@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_index_outside_the_experts_is_rejected(n, bad):
    """On the CPU an index outside [0, E) is an error, not a wrap-around or another expert's rows."""
    _, (x, w, index, gate, _) = make(Shape(n, 1, 6, 2, 8, 20, 12))
    index[n // 2, 3] = bad
    with pytest.raises(RuntimeError, match=rf"index values must lie in \[0, 8\).*{bad}"):
        expert_projection(x, w, index, gate, 2)


def test_index_dtypes(backend):
    backend("torch")
    _, (x, w, index, gate, _) = make(SHAPES[3])
    torch.testing.assert_close(expert_projection(x, w, index.int(), gate, 2), expert_projection(x, w, index, gate, 2))
    with pytest.raises(RuntimeError, match="index .* torch.float32"):
        expert_projection(x, w, index.float(), gate, 2)


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[4], SHAPES[6]], ids=str)
@pytest.mark.parametrize("regime", REGIMES)
def test_regimes_take_int32_index(shape, regime):
    """Every regime, forward and backward, gives with an int32 index exactly what it gives with int64."""
    _, cast = make(shape)
    x, w, index, gate, grad = cast
    want = via_regime(shape, cast, regime)
    got = via_regime(shape, (x, w, index.int(), gate, grad), regime)
    for g, v in zip(got, want):
        assert torch.equal(g, v)


def test_reference_is_the_naive_loop():
    # The reference path is the yardstick used elsewhere; check it separately, in float64 end to end.
    exact, _ = make(SHAPES[4])
    x, w, index, gate, grad = exact
    torch.testing.assert_close(reference.forward(x, w, index, gate, 1), naive(x, w, index, gate, 1))


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchall"])
def test_model_triton_equals_torch(preset, backend):
    from switchhead import PRESETS, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(PRESETS[preset]).eval().to(DEVICE)
    ids = torch.randint(0, PRESETS[preset].vocab_size, (1, 10)).to(DEVICE)  # 10 tokens: past the gather path
    results = {}
    for name in ["torch", "triton"]:
        backend(name)
        model.zero_grad()
        logits, _ = model(ids)
        logits.float().pow(2).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results[name] = (logits.detach(), grads)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-4, atol=1e-5)
    assert results["triton"][1].keys() == results["torch"][1].keys()
    for k, g in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][k], g, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_triton_results_are_written_at_the_weights_widths(monkeypatch):
    """The kernels read rows zero-padded to ALIGN but write the forward's output, grad_x and the weight gradient
    (or its chunks' partial sums) at the weight's own widths, D_in = 76 and D_out = 412 here: no padded result
    for a copy to slice afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from switchhead.kernels import gpu_build, triton_kernels

    tk = triton_kernels.load()
    names = {k: getattr(tk, k).fn.arg_names for k in ("_grouped_matmul_kernel", "_weight_grad_kernel")}
    for min_pairs in (2, 1 << 20):  # the weight gradient in chunks, then whole
        monkeypatch.setattr(tk, "WEIGHT_GRAD_MIN_PAIRS", min_pairs)
        x, w, index, gate = make(Shape(40, 2, 6, 1, 10, 76, 412), torch.bfloat16)[1][:4]
        launches = [launch for launch in gpu_build.launches(x, w, index, gate, 1) if launch.kernel in names]
        assert [launch.kernel for launch in launches] == [*names][:1] * 2 + [*names][1:]
        for launch, (padded, width) in zip(launches, [(416, 412), (80, 76)]):  # forward, grad_x
            arg = dict(zip(names[launch.kernel], launch.args))
            assert (arg["N_DIM"], arg["C_WIDTH"], arg["c_ptr"].shape[1], arg["stride_c"]) == (padded, *[width] * 3)
        arg = dict(zip(names["_weight_grad_kernel"], launches[2].args))
        assert (arg["D_IN"], arg["D_OUT"], arg["W_IN"], arg["W_OUT"]) == (80, 416, 76, 412)
        assert arg["dw_ptr"].shape == (arg["SPLITS"] * 10, 76, 412) and (arg["SPLITS"] > 1) == (min_pairs == 2)


@pytest.mark.parametrize(
    "dtype, every_config",
    [(torch.bfloat16, True), (torch.float32, True), (torch.float16, False)],
    ids=["bf16", "fp32-ieee", "fp16"],  # fp32: gpu_build.launches keeps TF32 off, so the FMA tiles
)
def test_triton_builds_for_sm90_pipelined_without_spills(dtype, every_config, monkeypatch):
    """The interpreter skips Triton's compiler: build every launch of a forward and backward (and of a decode
    step) for sm_90 with each config the tuner would try, at widths that are not multiples of 16 (as the 47M
    model's 412 and 76), and check what the binaries would use: no register spills, async tile loads kept in
    flight across steps, tensor-core products overlapping the loads."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from switchhead.kernels import gpu_build, triton_kernels

    assert not triton_kernels.load()._INTERPRETED
    # Few pairs per chunk: the O projection's weight gradient is split (SPLITS > 1), the decode step's is not
    # (SPLITS = 1, which Triton folds into the build): both builds are checked.
    monkeypatch.setattr(triton_kernels.load(), "WEIGHT_GRAD_MIN_PAIRS", 2)
    # The 47M model's O projection over 40 tokens: widths 76 and 412, each more than one K step (a width within
    # one K step leaves no loop to pipeline).
    _, many = make(Shape(40, 2, 6, 1, 10, 76, 412), dtype)
    _, decode = make(Shape(2, 1, 6, 2, 10, 20, 76), dtype)  # a V projection at decode (the gather kernel)
    _, wide = make(Shape(40, 1, 6, 2, 10, 412, 76), dtype)  # a V projection: its forward's rows are not padded
    _, up = make(Shape(40, 1, 4, 4, 16, 412, 128, gated=False), dtype)  # a sigma-MoE up-projection: no gate
    launches = gpu_build.launches(*many[:4], 1) + gpu_build.launches(*decode[:4], 2)
    launches += gpu_build.launches(*wide[:4], 2) + gpu_build.launches(*up[:4], 4)
    # the V projection again with grad_x by cuBLAS: the grouped kernel's gate-gradient pass that stores nothing
    launches += gpu_build.launches(*wide[:4], 2, dense_grad_x=True)[3:]
    sort = ["_count_pairs_kernel", "_place_pairs_kernel"]
    expected = [*sort, "_grouped_matmul_kernel", *sort, "_grouped_matmul_kernel", "_weight_grad_kernel"]
    expected += ["_gather_kernel", *sort, "_grouped_matmul_kernel", "_weight_grad_kernel"]  # fwd, grad_x, grad_w
    expected += [*sort, "_grouped_matmul_kernel", *sort, "_grouped_matmul_kernel", "_weight_grad_kernel"] * 2
    expected += [*sort, "_grouped_matmul_kernel", "_weight_grad_kernel"]
    assert [launch.kernel for launch in launches] == expected
    grouped = [launch for launch in launches if launch.kernel == "_grouped_matmul_kernel"]
    assert [launch.kwargs["STORE"] for launch in grouped] == [True] * 7 + [False]
    splits = triton_kernels.load()._weight_grad_kernel.fn.arg_names.index("SPLITS")
    assert launches[6].args[splits] > 1 and launches[11].args[splits] == 1
    k_dim = triton_kernels.load()._grouped_matmul_kernel.fn.arg_names.index("K_DIM")
    assert [launches[i].args[k_dim] for i in (2, 5, 14, 17)] == [80, 416, 412, 80]  # padded to 16 but the wide fwd
    for launch in launches:
        configs = gpu_build.configs(launch)
        for config in configs if every_config else configs[:1]:
            build = gpu_build.build(launch, config)
            assert build.stack_bytes == 0, (launch.kernel, config, build)
            if launch.kernel in sort:  # one block of expert ids per program: nothing to stage or multiply
                assert build.atomics == (), build
                continue
            assert build.async_copies, (launch.kernel, config, build)
            # The decode kernel multiplies on the CUDA cores by design (a vector per row, not a tile).
            assert build.tensor_cores or dtype == torch.float32 or launch.kernel == "_gather_kernel", build
            # Tile loads for later steps stay in flight while a step computes (the weight gradient's did not
            # while it loaded its pair ids in the step that used them; the decode kernel's weight rows, unpadded
            # and 76 wide, were loaded element by element and not staged at 16-bit precisions while their width
            # was a plain argument).
            assert build.copies_in_flight, (launch.kernel, config, build)
            if launch.kernel == "_gather_kernel":  # its weight tiles, not just the small loads, are staged
                tile_bytes = launch.kwargs["BLOCK_K"] * launch.kwargs["BLOCK_N"] * dtype.itemsize
                assert build.shared_bytes >= (launch.kwargs["STAGES"] - 1) * tile_bytes, build
            # Every wgmma build keeps a product in flight while it loads the next tiles (the gated weight
            # gradient did not, when the gate scaled the operand that wgmma reads from shared memory only).
            assert build.mma_in_flight is not False, (launch.kernel, config, build)
            # Shared output rows take relaxed atomic adds (Triton 3.6 emits atom, 3.9 red): the default acq_rel
            # ones were 1.4-2.1x slower on an H100 (docs/BENCHMARKS.md). The other builds have no atomics at all.
            if launch.kwargs.get("ATOMIC"):
                assert build.atomics and all(".relaxed.add." in a for a in build.atomics), (launch.kernel, build)
            else:
                assert build.atomics == (), (launch.kernel, config, build)


def test_triton_builds_for_sm100_use_the_tensor_cores(monkeypatch):
    """Blackwell's tensor-core instruction (tcgen05.mma) is neither mma.sync nor wgmma: the build report knows it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from switchhead.kernels import gpu_build, triton_kernels

    assert not triton_kernels.load()._INTERPRETED
    _, inputs = make(Shape(40, 2, 6, 1, 10, 76, 20), torch.bfloat16)
    forward = next(launch for launch in gpu_build.launches(*inputs[:4], 1) if launch.kernel == "_grouped_matmul_kernel")
    build = gpu_build.build(forward, gpu_build.configs(forward)[0], arch=100)
    assert build.tensor_cores and build.async_copies and build.mma_in_flight is None, build


def _benchmark_module():
    """benchmarks/kernels.py, imported from its file (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("benchmark_kernels", path)
    bench_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench_module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(bench_module)
    finally:
        del sys.modules[spec.name]
    return bench_module


@pytest.mark.parametrize("count", [1, 2, 4])
def test_interleaved_rounds_change_order(count):
    """benchmarks/kernels.py's interleaved timer: a warm-up round, then every function once per round, in orders
    that change from round to round, so that no function always follows the same one (that was measurably
    slower for the function after the largest)."""
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"[:count]}
    times = _benchmark_module().interleaved_times(fns, 12)
    assert {name: len(ts) for name, ts in times.items()} == {name: 12 for name in fns}
    rounds = [calls[i : i + count] for i in range(0, len(calls), count)]
    assert len(rounds) == 13 and all(sorted(r) == sorted(fns) for r in rounds)
    if count > 1:
        before = {name: {prev for prev, nxt in zip(calls, calls[1:]) if nxt == name} for name in fns}
        assert all(len(prev) > 1 for prev in before.values()), before


def _time_once(fn) -> float:
    """ms of one call of `fn`."""
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _tiny_cases(bench_module) -> list:
    """Two benchmark cases small enough for the interpreter and the simulated GPU: V-like, and O-like ungated."""
    Case = bench_module.Case
    return [Case("V", 20, 12, 1, 2, 2, 3, 2), Case("O ungated", 12, 20, 2, 1, 2, 3, 2, gated=False)]


def _timed_rows(lines: list[str], cases: list, ns: tuple, width: int) -> list[list[str]]:
    """The cells of a table with a row per case and N (in that order), `width` cells each, every cell after the
    first two a positive number."""
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(c.name, n) for c in cases for n in ns]
    assert all(len(r) == width and float(cell) > 0 for r in rows for cell in r[2:]), rows
    return rows


def test_gpu_benchmark_table_runs_under_the_interpreter(backend):
    """benchmarks/kernels.py's GPU table, run on the CPU (Triton interpreter, tiny cases, one timed call per
    cell): its code keeps working where no GPU is, so that it runs unchanged when one is there."""
    backend("triton")
    bench_module = _benchmark_module()
    once = _time_once
    cases = _tiny_cases(bench_module)
    lines = bench_module.gpu_table([1, 9], DEVICE, cases, once, once)  # N = 9: tiled
    assert os.environ["SWITCHHEAD_KERNEL"] == "triton"  # what the fixture set, restored
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [(r[0].strip(), r[1].strip(), int(r[2])) for r in rows] == [
        (c.name, d, n) for d in ("float16", "bfloat16") for c in cases for n in (1, 9)
    ]
    for r in rows:  # op ms, cuBLAS ms, % for GPU/wall x fwd/bwd
        assert len(r) == 3 + 3 * 4, r
        for first in range(3, 3 + 3 * 4, 3):
            assert float(r[first]) > 0 and float(r[first + 1]) > 0 and r[first + 2].strip().endswith("%"), r


def test_host_time_table_runs_where_no_gpu_is(backend, capsys):
    """`benchmarks/kernels.py --host` (the op's host time per call, and where cProfile sees it go), run on the
    suite's device with tiny cases: a row per case and N with two positive times, each followed by the forward's
    and the backward's functions by own time, the op's own code among them."""
    backend("torch")
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    lines = bench_module.host_table([1, 9], DEVICE, cases, torch.float32, calls=2, top=50)
    rows = _timed_rows(lines, cases, (1, 9), 6)
    printed = capsys.readouterr().out.splitlines()
    forwards = [line for line in printed if line.startswith("    forward: ")]
    backwards = [line for line in printed if line.startswith("    backward: ")]
    assert len(forwards) == len(backwards) == len(rows)
    assert all("(ops.py:" in line for line in forwards + backwards), forwards + backwards  # the op's own checks
    assert all(float(line.split(": ", 1)[1].split(" ", 1)[0]) > 0 for line in forwards + backwards)


def test_simulated_gpu_runs_the_cuda_path_on_cpu_tensors_and_leaves_nothing_behind(monkeypatch):
    """`gpu_build.simulated_gpu` (behind `benchmarks/kernels.py --host --simulated`): inside, the op's CUDA path
    runs on CPU tensors, forward and backward, through Triton's launch path with every kernel a CUDA run launches
    (`project`'s backward reusing its forward's sort), returning results of the right shapes; outside, the kernels
    refuse CPU tensors again, Triton's driver is the one from before, and no autotune result made inside is kept (a
    later real GPU run tunes for itself)."""
    from triton import knobs
    from triton.runtime import driver

    from switchhead.kernels import gpu_build, triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    tk = triton_kernels.load()
    tuned = {name: dict(getattr(tk, name).cache) for name in ("_grouped_matmul_kernel", "_weight_grad_kernel")}
    driver_before = driver._active
    shape = Shape(40, 2, 6, 1, 8, 12, 20)
    x, w, index, gate = (t.requires_grad_(t.is_floating_point()) for t in make(shape, torch.bfloat16)[1][:4])
    launched = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: launched.append(metadata.get()["name"]))
    seen = {}
    with gpu_build.simulated_gpu():
        for entry in (expert_projection, project):
            out = entry(x, w, index, gate, 1)
            forward, launched[:] = list(launched), []
            grads = torch.autograd.grad(out, [x, w, gate], torch.ones_like(out))
            seen[entry], launched[:] = (forward, list(launched)), []
    sort, products = ["_count_pairs_kernel", "_place_pairs_kernel"], ["_grouped_matmul_kernel", "_weight_grad_kernel"]
    assert seen[expert_projection] == ([*sort, products[0]], [*sort, *products])
    assert seen[project] == ([*sort, products[0]], products)  # its backward takes the forward's sort
    assert (out.shape, out.dtype) == ((40, 1, 20), torch.bfloat16)
    assert [g.shape for g in grads] == [x.shape, w.shape, gate.shape]
    assert driver._active is driver_before
    assert {name: dict(getattr(tk, name).cache) for name in tuned} == tuned
    with pytest.raises(KernelBackendError, match="need CUDA tensors"):
        project(x, w, index, gate, 1)


# aten ops that wait for a CUDA tensor's values on the host (or copy host memory to the GPU): a call that makes one
# stalls the host every time and cannot be captured into a CUDA graph.
_HOST_SYNCS = {
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::masked_select", "aten::unique_consecutive", "aten::_unique2", "aten::unique_dim", "aten::bincount",
    "aten::histc", "aten::repeat_interleave", "aten::lift_fresh", "aten::_assert_async",
}  # fmt: skip


@pytest.mark.parametrize("shape", [
    Shape(1, 2, 6, 1, 8, 12, 20),  # decode: the gather kernel forward, the tiled backward
    Shape(37, 2, 6, 1, 8, 12, 20),  # O: several pairs per output row
    Shape(21, 1, 4, 4, 70, 9, 17, gated=False),  # more experts than the counting sort takes: torch.sort
], ids=str)  # fmt: skip
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_cuda_path_makes_no_host_sync(shape, deterministic, monkeypatch):
    """The op's CUDA path, run on CPU tensors by `gpu_build.simulated_gpu`, never reads a tensor's values on the host
    (no aten op in `_HOST_SYNCS`, no tolist, numpy or cpu) outside the index range check, which runs only on CPU
    tensors: the op, `project` in training and `project` in inference mode, forward and backward. On a GPU such a read
    would make the host wait for the GPU at every call and make the call impossible to capture into a CUDA graph
    (`benchmarks/kernels.py --graphs`). The check itself is seen running, once per forward. (The cuBLAS routes some
    shapes take from 1024 tokens on need CUDA tensors: on a GPU, the graphs step captures them.)"""
    from torch.profiler import ProfilerActivity, profile, record_function

    from switchhead.kernels import gpu_build, ops

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    inside_check, reads = [False], []
    check = ops._check

    def observed_check(*args):
        inside_check[0] = True
        try:
            with record_function("index check"):
                return check(*args)
        finally:
            inside_check[0] = False

    monkeypatch.setattr(ops, "_check", observed_check)
    for name in ("tolist", "numpy", "cpu", "item"):
        method = getattr(torch.Tensor, name)

        def read(self, *args, method=method, name=name, **kwargs):
            if not inside_check[0]:
                reads.append(name)
            return method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    _, inputs = make(shape, torch.bfloat16)
    x, w, index, gate = (t if t is None or not t.is_floating_point() else t.requires_grad_() for t in inputs[:4])
    wrt = [t for t in (x, w, gate) if t is not None]

    def calls() -> None:
        for entry in (expert_projection, project):
            out = entry(x, w, index, gate, shape.n_out)
            torch.autograd.grad(out, wrt, torch.ones_like(out))
        with torch.inference_mode():
            project(x, w, index, gate, shape.n_out)

    with gpu_build.simulated_gpu(), deterministic_algorithms(deterministic):
        calls()  # built and tuned first
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            calls()

    def in_check(event) -> bool:
        while event is not None:
            if event.name == "index check":
                return True
            event = event.cpu_parent
        return False

    events = prof.events()
    syncs = [e.name for e in events if e.name in _HOST_SYNCS and not in_check(e)]
    assert syncs == [] and reads == [], (syncs, reads)
    assert sum(e.name == "index check" for e in events) == 3  # one per forward
    assert any(e.name == "aten::aminmax" and in_check(e) for e in events)  # the CPU-only check did run inside


def test_host_arithmetic_is_tritons():
    """The launchers' plain-Python ceil division and next power of two (grids, block counts, E_PAD) give what
    triton.cdiv and triton.next_power_of_2 give, at every size the kernels see."""
    import triton

    from switchhead.kernels import triton_kernels

    tk = triton_kernels.load()
    assert [tk._cdiv(a, b) for a in range(300) for b in (1, 2, 3, 16, 64, 127)] == [
        triton.cdiv(a, b) for a in range(300) for b in (1, 2, 3, 16, 64, 127)]  # fmt: skip
    assert [tk._next_power_of_2(n) for n in range(1, 5000)] == [triton.next_power_of_2(n) for n in range(1, 5000)]
    assert tk._aligned(412, 16) == 416 and tk._aligned(416, 16) == 416 and tk._aligned(1, 1) == 1


def test_direct_launch_launches_what_tritons_path_launches(monkeypatch):
    """`triton_kernels._launch`, run on CPU tensors by `gpu_build.simulated_gpu`: with the direct launch on, every
    launch of the op's forward and backward and of `project` in inference mode hands the launcher the same build
    (the same object Triton's own launch path picked), grid and arguments as with it off, and once each build has
    been seen every launch is direct (while a hook added to a kernel still runs before each of its launches). The
    inputs go from aligned to unaligned pointers (an unpadded input row 260 wide, one element into its buffer), from
    pair counts divisible by 16 to others, from bf16 to fp32, gated and not, with atomics and deterministic, one
    after the other, so that a build found for one is looked up for the next."""
    from triton.compiler.compiler import CompiledKernel

    from switchhead.kernels import gpu_build, triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    tk = triton_kernels.load()
    launched = []

    def recorder(build):
        def launch(g0, g1, g2, stream, function, packed, metadata, enter_hook, exit_hook, *args):
            described = [(a.dtype, a.shape, a.stride(), a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a
                         for a in args]  # fmt: skip
            launched.append((build, (g0, g1, g2), described))

        return launch

    monkeypatch.setattr(CompiledKernel, "run", property(recorder))  # both paths launch through build.run

    def unaligned(t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
        return buffer[1:].view_as(t).copy_(t)

    cases = []
    for shape, dtype, deterministic, shift in [
        (Shape(16, 1, 4, 1, 5, 260, 24), torch.bfloat16, False, False),
        (Shape(16, 1, 4, 1, 5, 260, 24), torch.bfloat16, False, True),  # x one element off its 16-byte alignment
        (Shape(13, 2, 6, 1, 8, 12, 20), torch.bfloat16, False, False),  # 78 pairs; several per output row
        (Shape(16, 2, 6, 1, 8, 12, 20), torch.bfloat16, True, False),  # 96 pairs
        (Shape(16, 2, 6, 1, 8, 12, 20, gated=False), torch.float32, False, False),
        (Shape(2, 2, 6, 2, 8, 12, 20), torch.float32, False, False),  # the gather kernel forward
    ]:  # fmt: skip
        x, w, index, gate = make(shape, dtype)[1][:4]
        x = unaligned(x) if shift else x
        assert (x.data_ptr() % 16 != 0) == shift
        x, w = x.requires_grad_(), w.requires_grad_()
        cases.append((shape, deterministic, x, w, index, gate.requires_grad_() if gate is not None else None))

    def run_all() -> list:
        launched.clear()
        for shape, deterministic, x, w, index, gate in cases:
            with deterministic_algorithms(deterministic):
                out = expert_projection(x, w, index, gate, shape.n_out)
                torch.autograd.grad(out, [t for t in (x, w, gate) if t is not None], torch.ones_like(out))
                with torch.inference_mode():
                    project(x, w, index, gate, shape.n_out)
        return list(launched)

    with gpu_build.simulated_gpu():
        monkeypatch.setattr(tk, "FAST_LAUNCH", False)
        run_all()  # built and tuned
        through_triton = run_all()
        monkeypatch.setattr(tk, "FAST_LAUNCH", True)
        run_all()  # each build seen once
        direct_before = sum(launcher.direct for launcher in tk._launchers.values())
        direct = run_all()
        direct_launches = sum(launcher.direct for launcher in tk._launchers.values()) - direct_before
        hooked = []  # a hook added to a kernel runs before each of its launches, as through Triton's path
        with monkeypatch.context() as m:
            m.setattr(tk._count_pairs_kernel, "pre_run_hooks", [lambda *args, **kwargs: hooked.append(args)])
            run_all()
    assert len(hooked) == sum(build.name == "_count_pairs_kernel" for build, _, _ in direct) > 0
    names = {build.name for build, _, _ in direct}
    assert names == {"_count_pairs_kernel", "_place_pairs_kernel", "_grouped_matmul_kernel", "_weight_grad_kernel",
                     "_gather_kernel"}  # fmt: skip
    assert len(direct) == len(through_triton) > 0 and direct_launches == len(direct)
    for ours, theirs in zip(direct, through_triton, strict=True):
        assert ours[0] is theirs[0] and ours[1:] == theirs[1:], (ours[0].name, ours[1:], theirs[1:])
    grouped = {id(b) for b, _, _ in through_triton if b.name == "_grouped_matmul_kernel"}
    assert len(grouped) >= 4  # the cases did need builds of their own
    jits = [(k.fn if hasattr(k, "configs") else k) for k in (getattr(tk, name) for name in gpu_build.KERNELS)]
    assert [jit.used_global_vals for jit in jits] == [{}] * len(jits)  # no globals to check, as Triton would


def _assert_ratio_columns(rows: list[list[str]], *firsts: int) -> None:
    """In each row, the cell after each pair of columns `first`, `first + 1` is their quotient (as rounded)."""
    for r in rows:
        for first in firsts:
            assert float(r[first + 2]) == pytest.approx(float(r[first + 1]) / float(r[first]), abs=0.01), r


def test_simulated_host_time_table_runs_without_a_gpu(monkeypatch):
    """`benchmarks/kernels.py --host --simulated`, with tiny cases: a row per case and N, with positive times for the
    op, `project` and their ratios, forward, forward + backward and in inference mode."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    lines = bench_module.simulated_host_table([1, 9], cases, torch.bfloat16, calls=2, repeats=1)
    _assert_ratio_columns(_timed_rows(lines, cases, (1, 9), 9), 2, 5)


def test_launch_table_times_both_launch_paths_without_a_gpu(monkeypatch):
    """`benchmarks/kernels.py --launch --simulated`, with tiny cases: a row per case and N, with positive times for
    Triton's launch path and the direct launch, decoding and forward + backward (whole calls, their ratio, and the
    time inside the launches); the direct cells did launch directly, and the switch is left as it was."""
    from switchhead.kernels import gpu_build, triton_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")
    tk = triton_kernels.load()
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    direct_before = sum(launcher.direct for launcher in tk._launchers.values())
    with gpu_build.simulated_gpu():
        lines = bench_module.launch_table([1, 9], "cpu", cases, torch.bfloat16, calls=2, repeats=1)
    _assert_ratio_columns(_timed_rows(lines, cases, (1, 9), 12), 2, 7)
    assert sum(launcher.direct for launcher in tk._launchers.values()) > direct_before
    assert tk.FAST_LAUNCH is True


def test_graph_table_times_checked_replays(backend, capsys):
    """`benchmarks/kernels.py --graphs` (project called eagerly and replayed from a CUDA graph), with tiny cases: on
    CUDA through real graphs; elsewhere with a capture that returns the function itself, which runs the table's
    code. A row per case and N with positive times and their ratios; a replay whose results are not the eager call's
    stops the table; a call that cannot be captured gets '-' cells and its error printed, and the rest is timed."""
    backend("auto" if DEVICE == "cuda" else "torch")
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    itself = bench_module.cuda_graph if DEVICE == "cuda" else (lambda fn: fn)
    lines = bench_module.graph_table([1, 9], DEVICE, cases, torch.float32, calls=2, repeats=1, capture=itself)
    _assert_ratio_columns(_timed_rows(lines, cases, (1, 9), 8), 2, 5)

    def off_by_one(fn):
        return lambda: tuple(t + 1 for t in fn())

    with pytest.raises(AssertionError, match=r"V, N = 9, decode: the graph's out is not the eager call's"):
        bench_module.graph_table([9], DEVICE, cases[:1], torch.float32, calls=1, repeats=1, capture=off_by_one)

    def refused(fn):
        if fn.__name__ == "train":
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return fn

    capsys.readouterr()
    lines = bench_module.graph_table([9], DEVICE, cases[:1], torch.float32, calls=1, repeats=1, capture=refused)
    cells = lines[2].strip("|").split("|")
    assert all(float(c) > 0 for c in cells[2:6]) and [c.strip() for c in cells[6:]] == ["-", "-"], cells
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "V, N = 9, fwd+bwd: capture failed: operation not permitted when stream is capturing"


def test_weight_grad_split_table_runs_under_the_interpreter(backend, monkeypatch):
    """`benchmarks/kernels.py --weight-grad-splits`, run on the CPU through the interpreter with tiny cases: one row
    per case and N, every count really launched (the gradients it times are the same for each), the knob reset."""
    from switchhead.kernels import triton_kernels

    backend("triton")  # TRITON_INTERPRET on the CPU
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "torch")  # the table forces the kernels itself and puts this back
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    tk = triton_kernels.load()
    seen, grads = [], []

    def times(fn):
        seen.append(tk.WEIGHT_GRAD_SPLITS)
        grads.append(fn()[1])
        return {"_weight_grad_kernel": _time_once(fn)}

    lines = bench_module.split_table([9], [1, 3], torch.float32, DEVICE, cases, times)
    assert os.environ["SWITCHHEAD_KERNEL"] == "torch" and tk.WEIGHT_GRAD_SPLITS == 0
    assert seen == [1, 3, 1, 3]
    for first, second in (grads[:2], grads[2:]):
        torch.testing.assert_close(first, second)
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [(r[0].strip(), int(r[2]), int(r[3])) for r in rows] == [(c.name, 9, 1) for c in cases]
    assert all(len(r) == 4 + 2 * 2 and all(float(v) > 0 for v in r[4:]) for r in rows), rows


def test_gpu_regime_table_runs_under_the_interpreter(backend):
    """`benchmarks/kernels.py --regimes ... --device cuda` (the PyTorch regimes beside the Triton kernels), run on
    the CPU through the interpreter with tiny cases and one timed call per cell."""
    backend("triton")
    bench_module = _benchmark_module()
    cases = _tiny_cases(bench_module)
    regimes = ["dense", "grouped", "combo", "grouped_mm"]
    timer = bench_module.each_call(_time_once)
    lines = bench_module.regime_table([9], regimes, 0, None, torch.float16, DEVICE, timer, cases, triton=True)
    variants = ["triton", "cuBLAS dx", "cuBLAS dw", "cuBLAS dx+dw", "op", *regimes]
    assert lines[0].split("|")[3:-1:2] == [f" {v} fwd " for v in variants]  # no CPU auto column
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(c.name, 9) for c in cases]
    assert all(len(r) == 2 + 2 * len(variants) and all(float(v) > 0 for v in r[2:]) for r in rows), rows


def test_gpu_kernels_timed_against_an_old_checkout(backend, tmp_path):
    """`benchmarks/kernels.py --device cuda --against DIR`: the Triton kernels as they lie in an old checkout
    beside the current ones, here a copy whose forward records its calls, which the timed calls must reach (the
    table times what it says it times)."""
    from switchhead.kernels import triton_kernels

    backend("triton")
    bench_module = _benchmark_module()
    old = tmp_path / "switchhead" / "kernels"
    old.mkdir(parents=True)
    source = open(triton_kernels.__file__).read()
    body = source.index(") -> Tensor:\n", source.index("\ndef forward(")) + len(") -> Tensor:\n")
    ran = []  # the names of the timed calls
    recording = source[:body] + "    RAN.append(x.shape)\n" + source[body:] + "\nRAN = []\n"
    (old / "triton_kernels.py").write_text(recording)
    cases = [bench_module.Case("V", 20, 12, 1, 2, 2, 3, 2)]

    def timer(fns):
        ran.extend(name for name in fns)
        return bench_module.each_call(_time_once)(fns)

    lines = bench_module.regime_table([9], [], 0, str(tmp_path), torch.float16, DEVICE, timer, cases, triton=True)
    variants = ["triton", f"triton @{tmp_path}", "cuBLAS dx", "cuBLAS dw", "cuBLAS dx+dw", "op"]
    assert lines[0].split("|")[3:-1:2] == [f" {v} fwd " for v in variants]
    assert f"triton @{tmp_path} fwd" in ran
    old_module = sys.modules[f"triton_kernels@{tmp_path}"]
    assert old_module.RAN and all(shape == (9, 1, 20) for shape in old_module.RAN)


def test_gemm_width_table_lists_the_unaligned_products():
    """`benchmarks/kernels.py --gemm-widths`: one row per product whose result rows are not a multiple of
    GEMM_ALIGN wide, the padded time beside the time as is."""
    bench_module = _benchmark_module()
    Case = bench_module.Case
    cases = [Case("V", 40, 19, 1, 2, 2, 3, 2), Case("aligned", 32, 16, 2, 1, 2, 3, 2)]
    rows = [line.strip("|").split("|") for line in bench_module.width_table([30], 1, cases)[2:]]
    assert [(r[0].strip(), int(r[2]), r[3].strip(), r[4].strip()) for r in rows] == [
        ("V", 20, "forward", "19 -> 32"), ("V", 20, "grad_x", "40 -> 48"), ("V", 20, "weight grad", "19 -> 32")
    ]
    assert all(float(r[5]) > 0 and float(r[6]) > 0 and float(r[7]) > 0 for r in rows), rows


def test_inductor_table_times_the_compiled_template():
    """`benchmarks/kernels.py --inductor`: a row per case and N with the per-expert row count, every time positive
    and each ratio the quotient of the (rounded) times beside it. The table compiles with inductor's C++ template as
    the only GEMM backend (no fallback to torch.mm) and checks each compiled product against eager before timing."""
    bench_module = _benchmark_module()
    cases = [bench_module.Case("V", 40, 19, 1, 2, 2, 3, 2), bench_module.Case("O", 19, 40, 2, 1, 2, 3, 2)]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in bench_module.inductor_table([30], 1, cases)[2:]]
    assert [(r[0], int(r[1]), int(r[2])) for r in rows] == [("V", 30, 20), ("O", 30, 20)]
    for r in rows:
        times = {i: float(r[i]) for i in (3, 4, 5, 7, 8, 10)}
        assert all(t > 0 for t in times.values()), r
        for ratio, (a, b) in {6: (4, 5), 9: (7, 8), 11: (4, 10)}.items():
            assert float(r[ratio]) == pytest.approx(times[b] / times[a], rel=0.05, abs=0.006), r  # times rounded


def test_block_table_sweeps_each_blocked_regime(monkeypatch):
    """`benchmarks/kernels.py --block-elements ... --regimes grouped combo`: every regime at every block size, each
    cell run with that size in force (0: one block per expert set) and the size restored afterwards."""
    bench_module = _benchmark_module()
    seen = []
    plan = torch_paths._plan

    def recording_plan(*args):
        seen.append((args[-1] > 1, torch_paths.GROUPED_BLOCK_ELEMENTS))  # (combo's segments, block size)
        return plan(*args)

    monkeypatch.setattr(torch_paths, "_plan", recording_plan)
    lines = bench_module.block_table([9], [4096, 0], 1, ("grouped", "combo"))
    assert torch_paths.GROUPED_BLOCK_ELEMENTS == 256 * 1024
    assert lines[0].split("|")[3:-1:2] == [f" {s} {r} fwd " for r in ("grouped", "combo") for s in ("4K", "expert")]
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [r[0].strip() for r in rows] == [c.name for c in bench_module.CASES]
    assert all(len(r) == 2 + 2 * 4 and all(float(v) > 0 for v in r[2:]) for r in rows), rows
    assert set(seen) == {(False, 4096), (False, 1 << 62), (True, 4096), (True, 1 << 62)}


def test_grouped_mm_table_times_both_ways(monkeypatch):
    """`benchmarks/kernels.py --grouped-mm`: grouped through the grouped GEMM and through its blocks at every N,
    whatever the threshold says, which is restored afterwards; the last column each expert's pairs x the wider
    width."""
    bench_module = _benchmark_module()
    calls = {"grouped GEMM": 0, "blocks": 0}
    grouped_mm, segments = torch_paths._GROUPED_MM, torch_paths._segments_forward

    def counting_grouped_mm(*args, **kwargs):
        calls["grouped GEMM"] += 1
        return grouped_mm(*args, **kwargs)

    def counting_segments(*args):
        calls["blocks"] += 1
        return segments(*args)

    monkeypatch.setattr(torch_paths, "_GROUPED_MM", counting_grouped_mm)
    monkeypatch.setattr(torch_paths, "_segments_forward", counting_segments)
    lines = bench_module.grouped_mm_table([1000], 1)  # beyond the threshold for every model shape
    assert (torch_paths.GROUPED_MM_MAX_ELEMENTS, torch_paths.GROUPED_MM_BACKWARD_MAX_ELEMENTS) == (65536, 28672)
    assert lines[0].split("|")[3:-2:2] == [" grouped GEMM fwd ", " blocks fwd "]
    rows = [line.strip("|").split("|") for line in lines[2:]]
    cases = bench_module.CASES
    assert [r[0].strip() for r in rows] == [c.name for c in cases]
    assert all(float(v) > 0 for r in rows for v in r[2:6]), rows
    assert [int(r[6]) for r in rows] == [1000 * c.slots * max(c.d_in, c.d_out) // (c.heads * c.experts) for c in cases]
    # forward (one grouped GEMM) and backward (two) of the warm-up and the timed round; the blocks' forward twice
    assert calls == {"grouped GEMM": len(cases) * 2 * 3, "blocks": len(cases) * 2}


@contextmanager
def deterministic_algorithms(on: bool):
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


@pytest.mark.parametrize("shape", [SHAPES[4], SHAPES[6], SHAPES[12]], ids=str)
def test_triton_deterministic_mode_matches_naive_loop(shape, backend):
    """Under torch.use_deterministic_algorithms the rows that several pairs add into (here: the output in the
    forward and the input rows in grad_x) get one row per pair, summed afterwards instead of atomically."""
    backend("triton")
    with deterministic_algorithms(True):
        for dtype in (torch.float32, torch.bfloat16):
            exact, cast = make(shape, dtype)
            assert_matches(via_op(shape, cast), naive_all(shape, exact), dtype)


@pytest.mark.parametrize("on", [False, True], ids=["default", "deterministic"])
def test_triton_deterministic_mode_launches_no_atomics(on, monkeypatch):
    """The launches the op makes (recorded as for a GPU): atomics into shared rows unless determinism is asked for."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from switchhead.kernels import gpu_build, triton_kernels

    kernel = triton_kernels.load()._grouped_matmul_kernel.fn
    shape = SHAPES[4]  # O projection: 6 slots into one output row, 3 per input row in grad_x
    with deterministic_algorithms(on):
        launches = gpu_build.launches(*make(shape)[1][:4], shape.n_out)
    matmuls = [  # forward and grad_x
        dict(zip(kernel.arg_names, launch.args)) | launch.kwargs
        for launch in launches
        if launch.kernel == "_grouped_matmul_kernel"
    ]
    assert [m["C_PER"] for m in matmuls] == [6, 3]
    assert [m["ATOMIC"] for m in matmuls] == [not on] * 2
    assert [m["STORE_PER"] for m in matmuls] == ([1, 1] if on else [6, 3])


@pytest.mark.parametrize("cpu", sorted(torch_paths.CPU_COSTS))
def test_choose_regime_follows_its_documented_thresholds(monkeypatch, cpu):
    """The timing rule alone (every regime gives the loop's numbers, so only this test notices a threshold moved),
    pinned to torch_paths' constants in fp32, for each kind of CPU: gather up to GATHER_MAX_PAIRS pairs (the
    kind's bag_max_pairs for a forward that runs as one embedding_bag, its gather_backward_max_pairs by the shape's
    kind for a backward), dense while its wasted MACs cost at most what grouped spends beside its GEMMs (per expert
    and per element of each pair's rows), combo's forward from COMBO_MIN_SEGMENTS_PER_SET segments per expert set (from
    the kind's combo_forward_min_per_set where dense is not picked), its backward once a set fills
    COMBO_BACKWARD_BLOCK_SHARE of a block (BF16_COMBO_MIN_SEGMENTS_PER_SET for both in bf16 on a CPU with bf16
    instructions), and for the backward of inputs expanded to every expert dense by that pass's own constants
    (never where its per_expert is -inf)."""
    tp = torch_paths
    costs = tp.CPU_COSTS[cpu]
    choose = functools.partial(tp.choose_regime, costs=costs)
    # sigma-MoE down (I = S, R = 1): segments of one slot, so never combo; contracted inputs
    down = dict(n_in=4, slots=4, n_out=1, n_experts=16, d_in=64, d_out=64)
    k = down["slots"]
    assert choose(tp.GATHER_MAX_PAIRS // k, **down) == "gather"
    assert choose(tp.GATHER_MAX_PAIRS // k + 1, **down) == "dense"
    assert choose(costs.bag_max_pairs // k, **down, bag=True) == "gather"
    assert choose(costs.bag_max_pairs // k + 1, **down, bag=True) == "dense"
    assert choose(costs.bag_max_pairs // k, **down, backward=True, bag=True) == "dense"  # the bag is forward-only
    expand, contract = costs.gather_backward_max_pairs["expand"], costs.gather_backward_max_pairs["contract"]
    assert contract // k >= 1 and expand // k >= 1  # the shapes test what they say
    assert choose(contract // k, **down, backward=True) == "gather"
    assert choose(contract // k + 1, **down, backward=True) == "dense"
    waste = down["n_experts"] * min(down["n_in"], down["n_out"]) / k  # dense's MACs per useful MAC
    for backward in (False, True):
        # per pair: dense's wasted MACs less what grouped moves (64 + 64 elements)
        saved = (waste - 1) * 64 * 64 - costs.per_element[backward] * (64 + 64)
        n_dense = int(down["n_experts"] * costs.per_expert[backward] // (k * saved))
        assert n_dense * k > costs.bag_max_pairs  # the shape tests what it says: dense beyond the bag's pairs
        assert choose(n_dense, **down, backward=backward) == "dense"
        assert choose(n_dense + 1, **down, backward=backward) == "grouped"
        # rows so narrow that moving them costs grouped more than dense wastes: dense at any N, on a CPU where
        # moving them costs anything
        narrow = dict(down, d_in=8, d_out=8)
        many = 10**7
        moved_more = costs.per_element[backward] * (8 + 8) >= (waste - 1) * 8 * 8
        assert choose(many, **narrow, backward=backward) == ("dense" if moved_more else "grouped")
    # sigma-MoE up (I = 1, R = S): the same waste, but its dense backward would recompute the forward
    up = dict(down, n_in=1, n_out=4)
    assert choose(tp.GATHER_MAX_PAIRS // k + 1, **up) == "dense"
    assert choose(expand // k, **up, backward=True) == "gather"
    if costs.per_expert[2] == -math.inf:
        for n in (expand // k + 1, 10**6):
            assert choose(n, **up, backward=True) == "grouped"
    else:
        saved = (waste - 1) * 64 * 64 - costs.per_element[2] * (64 + 64)
        n_dense = int(up["n_experts"] * costs.per_expert[2] // (k * saved))
        assert n_dense > expand // k  # the shape tests what it says
        assert choose(expand // k + 1, **up, backward=True) == "dense"
        assert choose(n_dense, **up, backward=True) == "dense"
        assert choose(n_dense + 1, **up, backward=True) == "grouped"
    # SwitchHead V (2 heads of 4 experts, k = 3): segments of 3 slots, C(4, 3) expert sets per head
    v = dict(n_in=1, slots=6, n_out=2, n_experts=8, d_in=20, d_out=12)
    n_combo = tp.COMBO_MIN_SEGMENTS_PER_SET * math.comb(4, 3)
    assert choose(n_combo, **v) == "combo"
    assert choose(n_combo - 1, **v) != "combo"

    def n_backward(shape: dict, sets: int) -> int:  # the first N whose backward runs combo
        return math.ceil(tp.COMBO_BACKWARD_BLOCK_SHARE * tp.block_rows(shape["d_in"], shape["d_out"]) * sets)

    assert tp.block_rows(20, 12) == tp.GROUPED_BLOCK_ELEMENTS // 20
    assert choose(n_backward(v, 4), **v, backward=True) == "combo"
    assert choose(n_backward(v, 4) - 1, **v, backward=True) != "combo"
    # the backward's threshold follows the rows' width: 262M V and O (4 heads of 4 experts, k = 2) from N = 538
    v262 = dict(n_in=1, slots=8, n_out=4, n_experts=16, d_in=1024, d_out=112)
    assert n_backward(v262, math.comb(4, 2)) == 538
    for shape in (v262, dict(v262, n_in=4, n_out=1, d_in=112, d_out=1024)):
        assert choose(538, **shape, backward=True) == "combo"
        assert choose(537, **shape, backward=True) != "combo"
    # ... and where grouped, not dense, is the alternative, the forward takes combo from
    # the kind's combo_forward_min_per_set (2 heads of 8 experts, k = 2: dense wastes 3x the useful MACs)
    v8 = dict(n_in=1, slots=4, n_out=2, n_experts=16, d_in=256, d_out=256)
    n_forward = costs.combo_forward_min_per_set * math.comb(8, 2)
    assert costs.combo_forward_min_per_set < tp.COMBO_MIN_SEGMENTS_PER_SET  # the case tests what it says
    assert choose(n_forward, **v8) == "combo"
    assert choose(n_forward - 1, **v8) == "grouped"
    assert choose(n_forward, **v8, backward=True) == "grouped"
    assert n_backward(v8, math.comb(8, 2)) > n_forward  # the case tests what it says
    assert choose(n_backward(v8, math.comb(8, 2)), **v8, backward=True) == "combo"
    o8 = dict(v8, n_in=2, n_out=1)  # the same for contracted inputs
    assert choose(n_forward, **o8) == "combo"
    assert choose(n_forward, **o8, backward=True) == "grouped"
    # bf16 on a CPU with bf16 instructions: combo from its own count (a backward wide enough not to stay dense)
    monkeypatch.setattr(tp, "native_half", lambda dtype: True)
    v_wide = dict(v, d_in=256, d_out=256)
    n_combo = tp.BF16_COMBO_MIN_SEGMENTS_PER_SET * math.comb(4, 3)
    assert tp.BF16_COMBO_MIN_SEGMENTS_PER_SET != tp.COMBO_MIN_SEGMENTS_PER_SET  # the case tests what it says
    assert choose(n_combo, **v_wide, backward=True, dtype=torch.bfloat16) == "combo"
    assert choose(n_combo - 1, **v_wide, backward=True, dtype=torch.bfloat16) == "grouped"


def test_cpu_costs_follow_the_kind_of_cpu(monkeypatch):
    """The regime constants are those measured on the kind of CPU this is (an Intel one that PyTorch runs with
    AVX-512, or any other), and the op's choice uses them unless told otherwise."""
    tp = torch_paths
    assert tp.cpu_kind("GenuineIntel", "AVX512") == "intel-avx512"
    for vendor, capability in [("GenuineIntel", "AVX2"), ("AuthenticAMD", "AVX512"), ("AuthenticAMD", "AVX2"),
                               ("", "DEFAULT")]:
        assert tp.cpu_kind(vendor, capability) == "default"
    # this machine, its vendor read independently
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = None
    if cpuinfo is not None:
        intel = re.search(r"^vendor_id\s*:\s*GenuineIntel$", cpuinfo, re.M) is not None
        for capability in ("AVX512", "AVX2"):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            tp.this_cpu.cache_clear()
            try:
                assert tp.this_cpu() == ("intel-avx512" if intel and capability == "AVX512" else "default")
            finally:
                tp.this_cpu.cache_clear()
    # the choice follows whichever kind it is: 262M O's backward is dense up to N ~ 270 on one, ~42 on the other
    o = dict(n_in=4, slots=8, n_out=1, n_experts=16, d_in=112, d_out=1024, backward=True)
    for kind in ("intel-avx512", "default"):
        monkeypatch.setattr(tp, "this_cpu", lambda k=kind: k)
        for n in (16, 64, 256, 1024):
            assert tp.choose_regime(n, **o) == tp.choose_regime(n, **o, costs=tp.CPU_COSTS[kind])
    # ... and the two kinds differ there
    assert tp.choose_regime(64, **o, costs=tp.CPU_COSTS["default"]) == "grouped"
    assert tp.choose_regime(64, **o, costs=tp.CPU_COSTS["intel-avx512"]) == "dense"
    # ... and so does the embedding_bag's threshold, of a forward just past the smaller one
    default, intel = tp.CPU_COSTS["default"], tp.CPU_COSTS["intel-avx512"]
    down = dict(n_in=4, slots=4, n_out=1, n_experts=16, d_in=64, d_out=64, bag=True)
    n = min(default.bag_max_pairs, intel.bag_max_pairs) // 4 + 1
    picks = {kind: tp.choose_regime(n, **down, costs=tp.CPU_COSTS[kind]) for kind in ("default", "intel-avx512")}
    assert sorted(picks.values()) == ["dense", "gather"]
    # ... and so does the dense forward's broadcast limit for 47M V's 76-wide experts (AVX2 runs 80-wide ones better)
    assert tp.broadcast_max_rows(76, default) < tp.broadcast_max_rows(80, default) == tp.broadcast_max_rows(76, intel)
    # ... and so does the count of pairs from which grouped and combo pad 47M's 76-wide GEMM rows to 80
    x, index = torch.zeros(1024, 1, 412), torch.zeros(1024, 6, dtype=torch.long)  # N = 1024: 614 pairs per expert
    for kind, width in (("default", 80), ("intel-avx512", 76)):
        monkeypatch.setattr(tp, "this_cpu", lambda k=kind: k)
        assert tp._gemm_width(76, x, index, 10) == width


def test_regime_fit_scores_the_rule_on_measured_tables(monkeypatch):
    """`benchmarks/regime_fit.py`: every dense/grouped cell of a `--regimes` table scored by the time of the regime
    the rule picks over the better one's, for each pass with its own constants (forward, backward of
    input-contracting shapes, backward of input-expanding ones); combo cells and other tables left out. With --bag, the
    gather/dense forward cells scored for a threshold in (token, slot) pairs, against dense above it or, where the
    table has grouped's forward, the regime a kind's rule picks; with --gather-backward, the gather's
    backward cells for a threshold per kind of shape, against the regime each kind's rule picks above it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    names = ("regime_fit", "kernels")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        import regime_fit
    finally:  # the benchmarks' top-level names stay out of other tests' way
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
    table = """
| case | N | gather fwd | gather bwd | dense fwd | dense bwd | auto fwd / bwd |
|---|---|---|---|---|---|---|
| 47M O | 16 | 9.0 | 9.0 | 1.0 | 1.0 | gather / dense |

| case | N | dense fwd | dense bwd | grouped fwd | grouped bwd | old | auto fwd / bwd |
|---|---|---|---|---|---|---|---|
| 47M O | 16 | 1.0 | 1.0 | 2.0 | 4.0 | - | - |
| 47M O | 512 | 3.0 | 3.0 | 2.0 | 6.0 | - | - |
| 47M V | 64 | 1.0 | 1.0 | 2.0 | 3.0 | - | - |
| 47M V | 512 | 1.0 | 9.0 | 2.0 | 1.0 | - | - |
| 47M V | 4096 | 1.0 | 1.0 | 5.0 | 5.0 | - | - |
"""
    cells = regime_fit.read_cells(table)
    shapes = [("47M O", 16), ("47M O", 512), ("47M V", 64), ("47M V", 512), ("47M V", 4096)]
    assert [(c[0].name, c[1], c[2]) for c in cells] == [(name, n, bwd) for name, n in shapes for bwd in (False, True)]
    # Constants fixed here (the scoring is under test, not the constants): the default kind's as fitted before grouped
    # had the grouped GEMM, and the Intel kind's.
    default = torch_paths.CPU_COSTS["default"]._replace(per_expert=(1.75e6, 1.75e6, 1.25e6), per_element=(28, 28, 8))
    intel = torch_paths.CPU_COSTS["intel-avx512"]
    # default: dense at N = 16 and 64, grouped at 512 (every pass), combo at 4096 (not scored)
    mean, worst, where, count = regime_fit.score(cells, default, 0)
    assert (count, worst, where) == (4, 2.0, "47M V N=512") and mean == pytest.approx(2 ** (1 / 4))
    mean, worst, where, count = regime_fit.score(cells, default, 1)
    assert (count, worst, where) == (2, 2.0, "47M O N=512") and mean == pytest.approx(2**0.5)
    assert regime_fit.score(cells, default, 2) == (1.0, 1.0, "-", 2)
    # intel-avx512 keeps 47M dense at N = 512, and the backward of V-like shapes never dense
    mean, worst, where, count = regime_fit.score(cells, intel, 0)
    assert (count, worst, where) == (4, 1.5, "47M O N=512") and mean == pytest.approx(1.5 ** (1 / 4))
    assert regime_fit.score(cells, intel, 1) == (1.0, 1.0, "-", 2)
    mean, worst, where, count = regime_fit.score(cells, intel, 2)
    assert (count, worst, where) == (2, 3.0, "47M V N=64") and mean == pytest.approx(3**0.5)
    # --bag: the gather/dense table's forward cells, the gather picked up to a number of pairs (47M O: S = 6)
    bag_cells = regime_fit.read_cells(table, bag=True)
    assert [(c[0].name, c[1], c[3], c[4]) for c in bag_cells] == [("47M O", 16, 9.0, 1.0)]
    assert regime_fit.score_bag(bag_cells, 16 * 6) == (pytest.approx(9.0), 9.0, "47M O N=16", 1)
    assert regime_fit.score_bag(bag_cells, 16 * 6 - 1) == (1.0, 1.0, "-", 1)
    three_regimes = """
| case | N | gather fwd | gather bwd | dense fwd | dense bwd | grouped fwd | grouped bwd | auto fwd / bwd |
|---|---|---|---|---|---|---|---|---|
"""  # the header of `--regimes gather dense grouped` tables
    # --bag on gather/dense/grouped tables: above the bag, the regime a kind's rule picks without it (262M V: S = 8)
    bag_table = three_regimes + """| 262M V | 11 | 4.0 | 1.0 | 1.0 | 1.0 | 2.0 | 1.0 | - |
| 47M O | 1 | 1.0 | 1.0 | 3.0 | 1.0 | 5.0 | 1.0 | - |
"""
    bag_cells = regime_fit.read_cells(bag_table, bag=True)
    assert [(c[0].name, *c[1:]) for c in bag_cells] == [
        ("262M V", 11, False, 4.0, 1.0, 2.0), ("47M O", 1, False, 1.0, 3.0, 5.0)
    ]
    eager = default._replace(per_expert=(0.0,) * 3, per_element=(0.0,) * 3)  # grouped wherever dense wastes MACs
    for costs in (None, default, eager):
        assert regime_fit.score_bag(bag_cells, 6, costs) == (1.0, 1.0, "-", 2)
    assert regime_fit.score_bag(bag_cells, 88, None) == (pytest.approx(2.0), 4.0, "262M V N=11", 2)
    assert regime_fit.score_bag(bag_cells, 88, default) == (pytest.approx(2.0), 4.0, "262M V N=11", 2)
    assert regime_fit.score_bag(bag_cells, 88, eager) == (pytest.approx(2**0.5), 2.0, "262M V N=11", 2)
    assert regime_fit.score_bag(bag_cells, 5, default) == (pytest.approx(3**0.5), 3.0, "47M O N=1", 2)
    assert regime_fit.score_bag(bag_cells, 5, eager) == (pytest.approx(5**0.5), 5.0, "47M O N=1", 2)
    # --gather-backward: the gather's backward beside dense's and grouped's, each kind of shape with its own threshold
    # in pairs (47M V and O: S = 6), above it the regime the kind's rule picks (47M V at N = 2: dense on default,
    # grouped on intel-avx512)
    backward_table = three_regimes + """| 47M V | 2 | 1.0 | 1.0 | 1.0 | 8.0 | 1.0 | 2.0 | - |
| 47M O | 1 | 1.0 | 3.0 | 1.0 | 1.0 | 1.0 | 8.0 | - |
"""
    gb_cells = regime_fit.read_cells(backward_table, gather_backward=True)
    assert [(c[0].name, *c[1:]) for c in gb_cells] == [
        ("47M V", 2, True, 1.0, 8.0, 2.0), ("47M O", 1, True, 3.0, 1.0, 8.0)
    ]
    assert regime_fit.score_gather_backward(gb_cells, 12, 5, default) == (1.0, 1.0, "-", 2)
    assert regime_fit.score_gather_backward(gb_cells, 11, 5, default) == (pytest.approx(8**0.5), 8.0, "47M V N=2", 2)
    assert regime_fit.score_gather_backward(gb_cells, 11, 5, intel) == (pytest.approx(2**0.5), 2.0, "47M V N=2", 2)
    assert regime_fit.score_gather_backward(gb_cells, 12, 6, default) == (pytest.approx(3**0.5), 3.0, "47M O N=1", 2)


def test_cuda_prefers_dense_follows_its_documented_rule():
    """On CUDA, dense_forward replaces the kernels' forward for half inputs contracted over I > R rows, from
    CUDA_DENSE_MIN_TOKENS tokens, while its GEMM plus CUDA_DENSE_OVERHEAD_MACS costs less than S*D_out atomic adds
    at CUDA_ATOMIC_MACS each; never for fp32, V-like shapes (I <= R) or fewer tokens."""
    tp = torch_paths
    o = dict(n_in=4, slots=8, n_out=1, d_in=112, d_out=1024)  # 262M O: 4 heads, k = 2
    budget = o["slots"] * o["d_out"] * tp.CUDA_ATOMIC_MACS - tp.CUDA_DENSE_OVERHEAD_MACS
    max_experts = math.ceil(budget / (o["d_in"] * o["d_out"])) - 1  # the most experts dense still beats
    assert 16 <= max_experts  # 262M O itself (16 experts) is a dense shape
    n = tp.CUDA_DENSE_MIN_TOKENS
    for dtype in (torch.bfloat16, torch.float16):
        assert tp.cuda_prefers_dense(n, **o, n_experts=max_experts, dtype=dtype)
        assert not tp.cuda_prefers_dense(n, **o, n_experts=max_experts + 1, dtype=dtype)
        assert not tp.cuda_prefers_dense(n - 1, **o, n_experts=16, dtype=dtype)
        # inputs expanded (I <= R): never, even where the cost model alone would pick dense (I > R, same sizes)
        cheap = dict(slots=8, n_out=4, n_experts=1, d_in=16, d_out=1024, dtype=dtype)
        assert tp.cuda_prefers_dense(n, n_in=8, **cheap)
        assert not tp.cuda_prefers_dense(n, n_in=4, **cheap)
        assert not tp.cuda_prefers_dense(n, n_in=1, **cheap)
    assert not tp.cuda_prefers_dense(n, **o, n_experts=16, dtype=torch.float32)
    # 47M O and sigma-MoE down: the kernels
    assert not tp.cuda_prefers_dense(n, 2, 6, 1, 10, 76, 412, torch.bfloat16)
    assert not tp.cuda_prefers_dense(n, 4, 4, 1, 16, 128, 412, torch.bfloat16)


@pytest.mark.parametrize("n, slots, cells", [(1, 1, 1), (5, 3, 2), (37, 8, 5), (64, 6, 40)])
def test_cell_sums_match_a_loop(n, slots, cells):
    """The per-cell gate sums the dense regime scatters on CUDA (deterministic where slots meet) against a loop
    over slots, with many slots sharing a cell when cells are few."""
    gen = torch.Generator().manual_seed(n * slots + cells)
    pos = torch.randint(cells, (n, slots), generator=gen)
    val = torch.randn(n, slots, generator=gen, dtype=torch.float64)
    want = torch.zeros(n, slots, dtype=torch.float64)
    for t, s, s2 in itertools.product(range(n), range(slots), range(slots)):
        if pos[t, s] == pos[t, s2]:
            want[t, s] += val[t, s2]
    torch.testing.assert_close(torch_paths.cell_sums(pos, val), want)
    dense = torch.zeros(n, cells, dtype=torch.float64).scatter_(1, pos, torch_paths.cell_sums(pos, val))
    torch.testing.assert_close(dense, torch.zeros(n, cells, dtype=torch.float64).scatter_add_(1, pos, val))


def test_cuda_prefers_dense_backward_is_the_forward_rule_on_the_transposed_shape():
    """grad_x of a shape expanding I < R rows is the forward of the transposed shape (R rows in, I out, D_out ->
    D_in): cuBLAS takes the backward where the forward's rule takes that forward, from
    CUDA_DENSE_BACKWARD_MIN_TOKENS tokens; never below, for fp32 or for shapes contracting rows."""
    tp = torch_paths
    n = tp.CUDA_DENSE_BACKWARD_MIN_TOKENS
    assert n >= tp.CUDA_DENSE_MIN_TOKENS
    v = dict(n_in=1, slots=8, n_out=4, d_in=1024, d_out=112)  # 262M V: 4 heads, k = 2
    budget = v["slots"] * v["d_in"] * tp.CUDA_ATOMIC_MACS - tp.CUDA_DENSE_OVERHEAD_MACS
    max_experts = math.ceil(budget / (v["d_in"] * v["d_out"])) - 1  # grad_x adds D_in-wide rows, atomically
    assert 16 <= max_experts  # 262M V itself (16 experts) is a dense shape
    for dtype in (torch.bfloat16, torch.float16):
        assert tp.cuda_prefers_dense_backward(n, **v, n_experts=max_experts, dtype=dtype)
        assert not tp.cuda_prefers_dense_backward(n, **v, n_experts=max_experts + 1, dtype=dtype)
        assert not tp.cuda_prefers_dense_backward(n - 1, **v, n_experts=16, dtype=dtype)
        assert tp.cuda_prefers_dense_backward(n, **v, n_experts=16, dtype=dtype)
        # the forward of 262M O (its transpose) is dense, its backward is not; nor is one with I = R
        assert tp.cuda_prefers_dense(n, 4, 8, 1, 16, 112, 1024, dtype)
        assert not tp.cuda_prefers_dense_backward(n, 4, 8, 1, 16, 112, 1024, dtype)
        assert not tp.cuda_prefers_dense_backward(n, 1, 8, 1, 1, 112, 1024, dtype)
    assert not tp.cuda_prefers_dense_backward(n, **v, n_experts=16, dtype=torch.float32)
    # 47M V and sigma-MoE up: the kernels
    assert not tp.cuda_prefers_dense_backward(4 * n, 1, 6, 2, 10, 412, 76, torch.bfloat16)
    assert not tp.cuda_prefers_dense_backward(4 * n, 1, 4, 4, 16, 412, 128, torch.bfloat16)


def test_op_where_cuda_runs_dense_backward_matches_naive_loop(monkeypatch):
    """A shape whose backward the automatic choice runs with grad_x and the weight gradient by cuBLAS on CUDA (and
    the gate gradient by the kernels): output and gradients against the float64 loop. On the CPU the same call
    takes the PyTorch paths."""
    from switchhead.kernels import ops

    monkeypatch.delenv("SWITCHHEAD_KERNEL", raising=False)
    # fewer tokens than the rule's minimum, which the float64 loop would take minutes over on the CPU
    monkeypatch.setattr(torch_paths, "CUDA_DENSE_MIN_TOKENS", 40)
    monkeypatch.setattr(torch_paths, "CUDA_DENSE_BACKWARD_MIN_TOKENS", 40)
    shape = Shape(43, 1, 8, 4, 8, 520, 24)
    exact, cast = make(shape, torch.bfloat16)
    x, w, index, _, _ = on_device(cast)
    dims = shape.n, shape.n_in, shape.slots, shape.n_out, shape.experts, shape.d_in, shape.d_out
    assert torch_paths.cuda_prefers_dense_backward(*dims, torch.bfloat16)  # the shape tests what it says
    rule = torch_paths.cuda_prefers_dense_backward
    assert ops._dense_on_cuda(x, w, index, shape.n_out, rule) == (DEVICE == "cuda")
    assert_matches(via_op(shape, cast), naive_all(shape, exact), torch.bfloat16)
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")  # forced: the kernels, whatever the shape
    assert not ops._dense_on_cuda(x, w, index, shape.n_out, rule)


def test_op_where_cuda_runs_dense_matches_naive_loop(monkeypatch):
    """A shape the automatic choice runs as dense_forward on CUDA (and the Triton backward): output and gradients
    against the float64 loop. On the CPU the same call takes the PyTorch paths."""
    from switchhead.kernels import ops

    monkeypatch.delenv("SWITCHHEAD_KERNEL", raising=False)
    shape = Shape(torch_paths.CUDA_DENSE_MIN_TOKENS + 3, 4, 8, 1, 8, 24, 520)
    exact, cast = make(shape, torch.bfloat16)
    x, w, index, _, _ = on_device(cast)
    dims = shape.n, shape.n_in, shape.slots, shape.n_out, shape.experts, shape.d_in, shape.d_out
    assert torch_paths.cuda_prefers_dense(*dims, torch.bfloat16)  # the shape tests what it says
    assert ops._dense_on_cuda(x, w, index, shape.n_out) == (DEVICE == "cuda")
    assert_matches(via_op(shape, cast), naive_all(shape, exact), torch.bfloat16)
    monkeypatch.setenv("SWITCHHEAD_KERNEL", "triton")  # forced: the kernels, whatever the shape
    assert not ops._dense_on_cuda(x, w, index, shape.n_out)


def test_rows_that_do_not_divide_the_slots_or_a_misshapen_gate_are_rejected():
    _, (x, w, index, gate, _) = make(SHAPES[3])  # S = 6
    with pytest.raises(RuntimeError, match=r"dividing S; got x \(5, 4, 20\)"):  # I = 4 does not divide S
        expert_projection(torch.cat([x] * 4, 1), w, index, gate, 2)
    for bad in (gate[:, :-1], gate[:-1], gate.reshape(6, 5)):
        got = re.escape(str(tuple(bad.shape)))
        with pytest.raises(RuntimeError, match=rf"expected floating-point x .* gate {got}, n_out 2"):
            expert_projection(x, w, index, bad, 2)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.float64, None], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fake_backward_has_the_real_gradients_dtypes(dtype, gate_dtype, backend):
    """The gate gradient takes the gate's dtype (the model routes in fp32 beside half inputs), or x's without a
    gate, in the fake backward as in the real one (torch.compile builds its graph from the fake)."""
    backend("torch")
    _, (x, w, index, gate, grad) = make(SHAPES[3], dtype)
    gate = gate.to(gate_dtype) if gate_dtype is not None else None
    args = (grad, x, w, index, gate, gate is not None, True)
    real = _backward_matching_its_fake(args)
    assert [real[0].dtype, real[1].dtype, real[2].dtype] == [dtype, dtype, gate_dtype or dtype]


def _every_other(t):
    """t's values in a view whose last dimension has stride 2 (as `[..., ::2]` of a wider tensor)."""
    return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


# The gather kernel's N, and tiled with widths that need no padding (so no padded copy makes x contiguous)
@pytest.mark.parametrize("shape", [Shape(3, 2, 4, 2, 5, 16, 16), Shape(12, 2, 4, 1, 5, 16, 32)], ids=str)
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_strided_inputs_match_naive_loop(shape, name, backend):
    """x with a non-unit stride along D_in and a transposed weight (as nn.Linear stores its own)."""
    backend(name)
    exact, cast = make(shape)
    x, w, index, gate, grad = on_device(cast)
    x = _every_other(x).requires_grad_()
    w = w.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    index, gate = (t.t().contiguous().t() for t in (index, gate))  # column-major, as from a transposed [S, N]
    assert x.stride(-1) == 2 and w.stride(-1) != 1 and index.stride(0) == 1 and gate.stride(0) == 1
    gate.requires_grad_()
    out = expert_projection(x, w, index, gate, shape.n_out)
    got = [out.detach(), *torch.autograd.grad(out, [x, w, gate], grad)]
    assert_matches([t.cpu() for t in got], naive_all(shape, exact), torch.float32)


def _random_case(seed: int, large: bool):
    """A configuration that varies everything the op's callers vary, all at once, drawn from `seed`: the shape (with
    `large`, token counts and widths through every CPU regime's range), the routing, the dtype, x's strides, a
    transposed or frozen weight, the gate's dtype and whether it trains, and the index dtype. Returns the shape,
    float64 inputs for the naive loop, the op's arguments (leaves that require grad where they train) and the
    output's gradient."""
    rng = random.Random(seed)
    n_in = rng.choice([1, 1, 2, 3, 4])
    slots = n_in * rng.choice([1, 2, 3]) * rng.choice([1, 2])
    shape = Shape(
        n=rng.choice([1, 2, 5, 17, 40] + ([130, 300, 700] if large else [])),
        n_in=n_in,
        slots=slots,
        n_out=rng.choice([r for r in range(1, slots + 1) if slots % r == 0]),
        experts=rng.randint(1, 9),
        d_in=rng.choice([1, 3, 16, 33] + ([76, 412] if large else [])),
        d_out=rng.choice([1, 5, 8, 17] + ([64, 112] if large else [])),
        gated=rng.random() < 0.8,
        routing=rng.choice(["random", "random", "one_expert", "some_empty"]),
    )
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    exact, (x, w, index, gate, grad) = make(shape, dtype, seed)
    if rng.random() < 0.3:
        x = _every_other(x)
    if rng.random() < 0.3:  # as nn.Linear stores its own
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    frozen = rng.random() < 0.25
    if gate is not None and rng.random() < 0.5:
        gate = gate.to(dtype)
    if rng.random() < 0.5:
        index = index.int()
    if rng.random() < 0.3:  # column-major, as from a transposed [S, N]
        index = index.t().contiguous().t()
    gate_trains = gate is not None and rng.random() < 0.8
    args = [x.requires_grad_(), w.requires_grad_(not frozen), index]
    args.append(gate.requires_grad_(gate_trains) if gate is not None else None)
    return shape, exact, args, grad


@functools.cache
def _random_case_loop(seed: int, large: bool) -> dict[str, torch.Tensor]:
    """The float64 loop's output and gradients for `_random_case(seed, large)`, computed once for every call."""
    shape, exact, *_ = _random_case(seed, large)
    return dict(zip(("out", "grad_x", "grad_weight", "grad_gate"), naive_all(shape, exact)))


def _trained(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    """The inputs that train, each with the name of its gradient."""
    inputs = [("grad_x", x), ("grad_weight", w)] + ([("grad_gate", gate)] if gate is not None else [])
    return [(name, t) for name, t in inputs if t.requires_grad]


def _assert_random_case(got: list[torch.Tensor], x: torch.Tensor, trained: list[tuple[str, torch.Tensor]], seed: int,
                        large: bool):
    """`got` (the output, then the gradients of `trained`) in x's and the inputs' dtypes, against the float64 loop."""
    assert [t.dtype for t in got] == [x.dtype] + [t.dtype for _, t in trained]
    names = ["out"] + [name for name, _ in trained]
    want = _random_case_loop(seed, large)
    assert_matches([t.cpu() for t in got], [want[n] for n in names], x.dtype, names)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_op_on_random_configurations(name, seed, backend):
    """Each backend, through the op and autograd, on configurations that combine what the other tests vary one at a
    time: the output and the gradients of what trains, with their dtypes, against the float64 loop."""
    backend(name)
    shape, _, args, grad = _random_case(seed, large=name != "triton")
    x, w, index, gate = (t.to(DEVICE) if t is not None else None for t in args)
    out = expert_projection(x, w, index, gate, shape.n_out)
    trained = _trained(x, w, gate)
    grads = torch.autograd.grad(out, [t for _, t in trained], grad.to(out.device))
    _assert_random_case([out.detach(), *grads], x, trained, seed, name != "triton")


@pytest.mark.parametrize("seed", range(10, 18))
@pytest.mark.parametrize("regime", [*REGIMES, "grouped_mm"])
def test_torch_regimes_on_random_configurations(regime, seed):
    """Every PyTorch regime called directly (the op picks one by shape) on the same kind of configurations, asked
    for just the gradients of what trains, as the op asks."""
    shape, _, (x, w, index, gate), grad = _random_case(seed, large=True)
    need_gate, need_weight = gate is not None and gate.requires_grad, w.requires_grad
    with torch.no_grad():
        out = torch_paths.forward(x, w, index, gate, shape.n_out, regime)
        gx, gw, gg = torch_paths.backward(grad, x, w, index, gate, need_gate, need_weight, regime=regime)
    got = [out, gx] + [gw] * need_weight + [gg] * need_gate
    _assert_random_case(got, x, _trained(x, w, gate), seed, True)


class _Dispatches(TorchDispatchMode):
    """Records every op dispatched under it, with its arguments (observing, not replacing, the real calls)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gate_trains", [True, False])
def test_backward_is_asked_for_the_gradients_that_are_needed(gate_trains):
    """The backward op is asked for a gate gradient only where the gate requires one (without, the Triton kernels
    skip their gate-gradient epilogue and the PyTorch paths a reduction per pair), and for a weight gradient only
    where the weight requires one."""
    _, (x, w, index, gate, grad) = make(SHAPES[4])
    x.requires_grad_()
    gate.requires_grad_(gate_trains)
    out = expert_projection(x, w, index, gate, SHAPES[4].n_out)
    with _Dispatches() as seen:
        torch.autograd.grad(out, [x] + ([gate] if gate_trains else []), grad)
    backward = torch.ops.switchhead.expert_projection_backward.default
    assert [tuple(args[5:7]) for func, args in seen.calls if func is backward] == [(gate_trains, False)]


@pytest.mark.parametrize("need", [(True, True), (False, True), (True, False), (False, False)], ids=str)
@pytest.mark.parametrize("name", ["reference", "torch", "triton"])
def test_backward_returns_just_the_gradients_asked_for(name, need, backend):
    """Each backend's backward leaves the gate's and the weight's gradient empty where they are not asked for, as
    the fake backward says (torch.compile builds its graph from the fake), and computes the others."""
    backend(name)
    shape = SHAPES[4]
    exact, cast = make(shape)
    grad, x, w, index, gate = on_device([cast[4], *cast[:4]])
    args = (grad, x, w, index, gate, *need)
    real = _backward_matching_its_fake(args)
    _, want_x, want_w, want_gate = naive_all(shape, exact)
    wanted = [want_x] + [want_w] * need[1] + [want_gate] * need[0]
    got = [real[0]] + [real[1]] * need[1] + [real[2]] * need[0]
    for g, want in zip(got, wanted):
        torch.testing.assert_close(g.cpu().double(), want, rtol=2e-5, atol=1e-4)
    assert [real[1].numel() > 0, real[2].numel() > 0] == [need[1], need[0]]


def _with_grads(out: torch.Tensor, inputs: list, grad_out: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    return out, torch.autograd.grad(out, inputs, grad_out)


def _dispatched(fn) -> tuple[object, bool]:
    """fn()'s result, and whether the custom op or its backward op went through the dispatcher (the profiler records
    them there)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    names = ("switchhead::expert_projection", "switchhead::expert_projection_backward")
    return out, any(e.name in names for e in prof.events())


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")  # torch's own use, and the trace below
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4], SHAPES[6]], ids=str)
def test_project_skips_the_dispatcher_only_where_nothing_needs_it(shape, backend):
    """The model's entry point calls the op's implementation without the dispatcher in eager calls (the dispatch is
    a large part of a decode step's op), on the CPU and the suite's device, with the op's exact result: directly
    where no graph is recorded, and through an autograd.Function with the op's exact gradients where one is. It
    calls the op itself wherever a dispatch or function mode, a tensor subclass, jit tracing, dynamo, forward-mode
    AD or a meta tensor is about."""
    from switchhead.kernels.ops import project

    backend("torch")
    _, (x, w, index, gate, _) = make(shape)
    args = (x, w, index, gate, shape.n_out)
    with torch.no_grad():
        want = expert_projection(*args)
    for context in (torch.inference_mode, torch.no_grad):
        with context():
            got, dispatched = _dispatched(lambda: project(*args))
        assert not dispatched
        assert torch.equal(got, want)
    # on the suite's device too (CUDA with SWITCHHEAD_TEST_DEVICE=cuda), whose host time the dispatch would add to;
    # there slots that share a row may be added by atomics in any order, so to rounding
    on_dev = (*on_device((x, w, index, gate)), shape.n_out)
    with torch.no_grad():
        want_dev = expert_projection(*on_dev)
    with torch.inference_mode():
        got, dispatched = _dispatched(lambda: project(*on_dev))
    assert not dispatched
    torch.testing.assert_close(got, want_dev, rtol=1e-6, atol=1e-6)
    trained = [t.detach().requires_grad_() for t in (x, w)]
    with torch.no_grad():  # requires grad, but no graph is recorded
        got, dispatched = _dispatched(lambda: project(*trained, index, gate, shape.n_out))
    assert not dispatched and torch.equal(got, want) and not got.requires_grad
    # Recording a graph (eager training): still no dispatch, forward or backward, with the op's result and gradients.
    trained_gate = None if gate is None else gate.detach().requires_grad_()
    inputs = [*trained] + ([trained_gate] if gate is not None else [])
    grad_out = torch.randn_like(want)
    op_out = expert_projection(*trained, index, trained_gate, shape.n_out)
    want_grads = torch.autograd.grad(op_out, inputs, grad_out)
    (got, grads), dispatched = _dispatched(lambda: _with_grads(project(*trained, index, trained_gate, shape.n_out),
                                                               inputs, grad_out))
    assert not dispatched and got.requires_grad and torch.equal(got.detach(), want)
    for g, w_ in zip(grads, want_grads):
        assert torch.equal(g, w_)
    frozen = project(trained[0], w, index, gate, shape.n_out)  # only x trains: the weight gets no gradient
    assert torch.equal(torch.autograd.grad(frozen, trained[0], grad_out)[0], want_grads[0])
    # Once differentiable, as the op: a second backward through the gradient is refused, not silently zero. (It is
    # run with backward(): autograd.grad towards an input would fail first for another reason, that the input is
    # not in the refusing node's graph.)
    refusals = {"op": "no autograd formula was registered", "project": "differentiate twice a function"}
    for entry, fn in (("op", expert_projection), ("project", project)):
        out = fn(*trained, index, trained_gate, shape.n_out)  # a fresh graph (op_out's was freed by its backward)
        g, = torch.autograd.grad(out, trained[0], grad_out.detach().requires_grad_(), create_graph=True)
        with pytest.raises(RuntimeError, match=refusals[entry]):
            g.sum().backward()

    with torch.inference_mode(), _Dispatches() as seen:
        assert torch.equal(project(*args), want)
    assert torch.ops.switchhead.expert_projection.default in [func for func, _ in seen.calls]
    with torch.no_grad(), torch.device("cpu"):  # a function mode
        assert _dispatched(lambda: project(*args))[1]

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        assert _dispatched(lambda: project(x.as_subclass(Sub), w, index, gate, shape.n_out))[1]
    with torch.no_grad():
        traced = torch.jit.trace(lambda x: project(x, w, index, gate, shape.n_out), x)
    assert "switchhead::expert_projection" in str(traced.graph)
    graph = []

    def record(gm, example_inputs):
        graph.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    with torch.no_grad():  # dynamo traces the op, not the CPU paths behind it
        assert torch.equal(torch.compile(project, backend=record, fullgraph=True)(*args), want)
    assert torch.ops.switchhead.expert_projection.default in graph
    with torch.autograd.forward_ad.dual_level(), torch.no_grad():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        got, dispatched = _dispatched(lambda: project(dual, w, index, gate, shape.n_out))
    assert dispatched and torch.equal(torch.autograd.forward_ad.unpack_dual(got).primal, want)
    meta = [t.to("meta") for t in (x, w, index)] + [gate.to("meta") if gate is not None else None]
    assert project(*meta, shape.n_out).shape == want.shape  # the op's fake implementation, not the CPU paths


def _dense_n(n_in: int, slots: int, n_out: int, experts: int, d_in: int, d_out: int, start: int = 2) -> int:
    """A token count from `start` on for which the PyTorch paths pick the dense regime, forward and backward, on
    this CPU."""
    return next(n for n in range(start, 2000) if all(
        torch_paths.choose_regime(n, n_in, slots, n_out, experts, d_in, d_out, backward) == "dense"
        for backward in (False, True)))


@pytest.mark.parametrize("n_in,n_out", [(1, 2), (2, 1), (1, 1)])
def test_a_non_finite_expert_that_no_token_chose_stays_out_of_every_result(n_in, n_out, backend):
    """The dense regime multiplies every expert before zero coefficients drop the unchosen ones, and 0 * nan is
    nan: a dead (or uninitialised) expert made the whole batch's output and input gradient nan. The formula never
    reads it, so every result matches the float64 loop."""
    backend("torch")
    shape = Shape(_dense_n(n_in, 4, n_out, 3, 12, 8), n_in, 4, n_out, 3, 12, 8, routing="some_empty")
    exact, cast = make(shape)  # only experts 0 and 2 are chosen
    for w in (exact[1], cast[1]):
        w[1] = float("nan")
    x, w, index, gate, grad = (t.clone().requires_grad_(t.is_floating_point()) for t in cast)
    out = expert_projection(x, w, index, gate, shape.n_out)
    got = [out.detach(), *torch.autograd.grad(out, [x, w, gate], grad)]
    assert_matches(got, naive_all(shape, exact), torch.float32)


def test_a_non_finite_input_row_stays_out_of_the_rows_that_do_not_read_it(backend):
    """Dense mixes a token's input rows before zero coefficients separate them: an inf in one row turned the
    token's other output rows (which never read it) into nan."""
    backend("torch")
    # a few dozen tokens: with a handful the nan did not always show
    shape = Shape(_dense_n(4, 4, 2, 3, 8, 8, start=40), 4, 4, 2, 3, 8, 8)
    exact, cast = make(shape)
    exact[0][0, 3, 0] = cast[0][0, 3, 0] = float("inf")  # read by output row 1 of token 0 only
    got = expert_projection(*cast[:4], shape.n_out)
    want = naive(*exact[:4], shape.n_out)
    finite = torch.isfinite(want)
    assert not finite[0, 1].all() and finite[0, 0].all() and finite[1:].all()
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got.double()[finite], want[finite], rtol=2e-5, atol=1e-4)
