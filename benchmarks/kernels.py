"""Benchmark of the expert projection op (`switchhead.kernels.expert_projection`).

    python benchmarks/kernels.py            # CPU table (and the GPU table when CUDA is available)
    python benchmarks/kernels.py --quick    # fewer repeats
    python benchmarks/kernels.py --no-cpu --gpu-n 4096 16384   # only the GPU table, at these token counts
    python benchmarks/kernels.py --n 256 4096 --block-elements 65536 262144 1048576 0   # grouped block sizes
    python benchmarks/kernels.py --n 16 64 256 --regimes dense grouped   # the regimes' forward and backward
    python benchmarks/kernels.py --n 256 4096 --regimes grouped --against REV   # beside the code at git REV
    python benchmarks/kernels.py --n 16 256 --regimes dense auto --against REV   # the automatic choice too
    python benchmarks/kernels.py --n 256 4096 --anatomy   # where the grouped forward's time goes
    python benchmarks/kernels.py --n 256 1024 4096 --gemm-widths   # one expert's GEMMs, result rows padded or not
    python benchmarks/kernels.py --n 256 4096 --frozen    # forward+backward with the weight trained and frozen
    python benchmarks/kernels.py --n 256 4096 --inductor  # one expert's GEMMs by MKL and by torch.compile's C++
    python benchmarks/kernels.py --n 4096 16384 --regimes dense combo --device cuda --dtype bfloat16   # vs Triton
    python benchmarks/kernels.py --n 4096 --regimes dense --case O6 112 1024 4 1 4 6 2   # --regimes on other shapes
    python benchmarks/kernels.py --n 4096 16384 --weight-grad-splits 1 2 4 8 --dtype bfloat16   # weight-gradient chunks
    python benchmarks/kernels.py --n 1 256 4096 16384 --host --dtype bfloat16   # the op's host time per call on CUDA
    python benchmarks/kernels.py --n 1 16 256 --host --simulated --dtype bfloat16   # the same without a GPU
    python benchmarks/kernels.py --n 1 256 4096 16384 --graphs --dtype bfloat16   # eager calls vs CUDA-graph replays
    python benchmarks/kernels.py --n 1 256 4096 16384 --launch --dtype bfloat16   # Triton's launch path vs direct
    python benchmarks/kernels.py --n 1 16 256 --launch --simulated --dtype bfloat16   # the same without a GPU

CPU: every PyTorch regime (gather / dense / grouped / combo) and the automatic choice, forward and forward+backward,
against a dense matmul with the same active FLOPs (N x S*D_in x D_out), measured side by side in one run.
GPU: the Triton op against a cuBLAS matmul of one expert's size over all N*S pairs (the same FLOPs without
routing), forward and backward, fp16 and bf16, reported as % of cuBLAS speed, in GPU time (the kernels' durations,
from torch.profiler) and in wall time per call (triton.testing.do_bench, host overhead included).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType

import torch

from switchhead.kernels import expert_projection, torch_paths
from switchhead.kernels.ops import expert_projection_backward


@dataclass(frozen=True)
class Case:
    name: str
    d_in: int
    d_out: int
    n_in: int  # I
    n_out: int  # R
    heads: int  # groups of slots with their own experts (SwitchHead heads; 1 for sigma-MoE)
    experts: int  # per group
    k: int
    gated: bool = True

    @property
    def slots(self) -> int:
        return self.heads * self.k


CASES = [
    Case("47M V", 412, 76, 1, 2, 2, 5, 3),
    Case("47M O", 76, 412, 2, 1, 2, 5, 3),
    Case("262M V", 1024, 112, 1, 4, 4, 4, 2),
    Case("262M O", 112, 1024, 4, 1, 4, 4, 2),
    Case("sMoE up", 412, 128, 1, 4, 1, 16, 4, gated=False),
    Case("sMoE down", 128, 412, 4, 1, 1, 16, 4),
]


def make_inputs(case: Case, n: int, dtype: torch.dtype, device: str, grad: bool = False):
    """Inputs routed like the model: each head's slots pick k distinct experts among that head's E."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, case.n_in, case.d_in, generator=g).to(device, dtype)
    w = (torch.randn(case.heads * case.experts, case.d_in, case.d_out, generator=g) / case.d_in**0.5).to(device, dtype)
    scores = torch.rand(n, case.heads, case.experts, generator=g)
    top = scores.topk(case.k, dim=-1).indices + torch.arange(case.heads).view(1, -1, 1) * case.experts
    index = top.reshape(n, case.slots).to(device)
    gate = torch.rand(n, case.slots, generator=g).to(device) if case.gated else None
    if grad:
        x.requires_grad_()
        w.requires_grad_()
        if gate is not None:
            gate.requires_grad_()
    return x, w, index, gate


def projection_args(case: Case, n: int, dtype: torch.dtype, device: str) -> tuple[tuple, list[torch.Tensor]]:
    """The op's arguments for `case` at `n` tokens, inputs requiring grad as in training (`make_inputs`), and the
    tensors a backward differentiates."""
    x, w, index, gate = make_inputs(case, n, dtype, device, grad=True)
    return (x, w, index, gate, case.n_out), [x, w] + ([gate] if gate is not None else [])


def _decoding(fn: Callable, args: tuple) -> Callable[[], object]:
    """`fn(*args)` in inference mode, as the runtime calls the model's projections while decoding."""

    def run() -> object:
        with torch.inference_mode():
            return fn(*args)

    return run


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times in seconds of each function over `repeats` rounds, calling them in turn each round (after one
    warm-up round). The machine is shared: interleaving exposes every candidate to the same background load. Each
    round calls them in a new order (seeded): on the CPU a call pays for what the call before it left behind (memory
    it freed), and in a fixed order the function after the largest one ran up to 10 % slower than an identical
    copy of itself placed elsewhere (docs/BENCHMARKS.md, "Order of the calls")."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names, order = list(fns), random.Random(0)
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def interleaved_min_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time in ms of each function over interleaved rounds: the least disturbed run."""
    return {name: min(ts) * 1e3 for name, ts in interleaved_times(fns, repeats).items()}


def interleaved_us_per_call(
    fns: dict[str, Callable[[], object]], calls: int, repeats: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Microseconds per call of each function: the best of `repeats` interleaved rounds (`interleaved_min_ms`) of
    `calls` calls each, `sync` (e.g. waiting for the GPU) at the end of every round."""

    def rounds_of(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()
            sync()
        return run

    rounds = interleaved_min_ms({name: rounds_of(fn) for name, fn in fns.items()}, repeats)
    return {name: ms * 1e3 / calls for name, ms in rounds.items()}


def _table(header: str) -> list[str]:
    """A markdown table's header and separator, printed at once (the tables stream row by row)."""
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    print(lines[0] + "\n" + lines[1], flush=True)
    return lines


def _add_row(lines: list[str], row: str) -> None:
    lines.append(row)
    print(row, flush=True)


def _auto_regimes(case: Case, n: int, dtype: torch.dtype) -> tuple[str, str]:
    """The regimes the op picks for this case's forward and backward (on the CPU)."""
    shape = (n, case.n_in, case.slots, case.n_out, case.heads * case.experts, case.d_in, case.d_out)
    bag = dtype in (torch.float32, torch.float64)
    return tuple(torch_paths.choose_regime(*shape, backward, dtype=dtype, bag=bag) for backward in (False, True))


def _call(fn: Callable, *args) -> Callable[[], object]:
    return lambda: fn(*args)


def _fwd_bwd(fn: Callable, args: tuple, wrt: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        out = fn(*args)
        torch.autograd.grad(out, wrt, torch.ones_like(out))

    return run


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def _dense_equivalent(case: Case, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense matmul with the op's active FLOPs (N*S*D_in*D_out): the projection without routing."""
    if case.n_out > 1:  # V-like: every token's input row goes through S experts' worth of columns
        shapes = (n, case.d_in), (case.d_in, case.slots * case.d_out)
    else:
        shapes = (n, case.slots * case.d_in), (case.slots * case.d_in, case.d_out)
    return tuple(torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes)


def cpu_table(ns: list[int], repeats: int, dtype: torch.dtype = torch.float32) -> list[str]:
    os.environ["SWITCHHEAD_KERNEL"] = "torch"
    lines = _table(
        "| case | N | matmul fwd ms | gather | dense | grouped | combo | op (regime) | op / matmul "
        "| matmul fwd+bwd ms | op fwd+bwd | op / matmul fwd+bwd |"
    )
    for case in CASES:
        for n in ns:
            x, w, index, gate = make_inputs(case, n, dtype, "cpu", grad=True)
            args = (x, w, index, gate, case.n_out)
            wrt = [x, w] + ([gate] if gate is not None else [])
            xd, wd = _dense_equivalent(case, n, dtype)
            # gather is skipped where it would multiply thousands of (token, slot) pairs one by one
            regimes = ["dense", "grouped", "combo"] + (["gather"] if n * case.slots <= 4096 else [])
            with torch.no_grad():
                fwd = {"matmul": _call(_matmul, xd, wd), "op": _call(expert_projection, *args)}
                fwd.update({r: _call(torch_paths.FORWARD[r], *args) for r in regimes})
                t = interleaved_min_ms(fwd, repeats)
            tb = interleaved_min_ms(
                {"matmul": _fwd_bwd(_matmul, (xd, wd), [xd, wd]), "op": _fwd_bwd(expert_projection, args, wrt)},
                repeats,
            )
            fwd_regime, bwd_regime = _auto_regimes(case, n, dtype)
            cols = " | ".join(f"{t[r]:.3f}" if r in t else "-" for r in ("gather", "dense", "grouped", "combo"))
            _add_row(
                lines,
                f"| {case.name} | {n} | {t['matmul']:.3f} | {cols} | {t['op']:.3f} ({fwd_regime}) "
                f"| {t['op'] / t['matmul']:.2f} | {tb['matmul']:.3f} | {tb['op']:.3f} ({bwd_regime} backward) "
                f"| {tb['op'] / tb['matmul']:.2f} |",
            )
    return lines


def _fwd_bwd_table(
    ns: list[int],
    variants: dict[str, tuple[Callable, Callable]],
    repeats: int,
    dtype: torch.dtype = torch.float32,
    auto: bool = False,
    device: str = "cpu",
    timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]] | None = None,
    cases: list[Case] = CASES,
    extra: tuple[str, Callable[[Case, int], str]] | None = None,
) -> list[str]:
    """Forward and backward (all gradients) of each variant, called directly with a regime's signature; one row
    per shape and N. `timer` maps the calls to ms (default: best of `repeats` interleaved wall times). `auto`: a
    column with the regimes `choose_regime` picks (on the CPU); `extra`: a last column's header and its cells."""
    timer = timer or (lambda fns: interleaved_min_ms(fns, repeats))
    columns = [f"{v} fwd | {v} bwd" for v in variants] + (["auto fwd / bwd"] if auto else [])
    columns += [extra[0]] if extra else []
    lines = _table("| case | N | " + " | ".join(columns) + " |")
    for case in cases:
        for n in ns:
            x, w, index, gate = make_inputs(case, n, dtype, device)
            grad = torch.randn(n, case.n_out, case.d_out).to(device, dtype)
            fns = {}
            for v, (fwd, bwd) in variants.items():
                fns[f"{v} fwd"] = _call(fwd, x, w, index, gate, case.n_out)
                fns[f"{v} bwd"] = _call(bwd, grad, x, w, index, gate, True)
            t = timer(fns)
            cells = " | ".join(f"{t[f'{v} fwd']:.3f} | {t[f'{v} bwd']:.3f}" for v in variants)
            if auto:
                cells += " | {} / {}".format(*_auto_regimes(case, n, dtype))
            if extra:
                cells += f" | {extra[1](case, n)}"
            _add_row(lines, f"| {case.name} | {n} | {cells} |")
    return lines


@cache
def _module_at(rev: str, relpath: str) -> ModuleType:
    """The module in `relpath` (from the repository root) as of git revision `rev`, or as it lies in the directory
    `rev` (an old checkout, for machines where the repository has no git history), to time beside the current one;
    loaded once (its kernels tuned once)."""
    if os.path.isdir(rev):
        try:
            with open(os.path.join(rev, relpath)) as f:
                text = f.read()
        except OSError as e:
            sys.exit(f"--against {rev}: {e}")
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(["git", "show", f"{rev}:{relpath}"], cwd=root, capture_output=True, text=True)
        if source.returncode:
            sys.exit(f"--against {rev}: {source.stderr.strip()}")
        text = source.stdout
    # A file of its own: triton.jit reads its kernels' source back from it.
    path = os.path.join(tempfile.mkdtemp(), os.path.basename(relpath))
    with open(path, "w") as f:
        f.write(text)
    name = f"{os.path.basename(relpath)[:-3]}@{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _paths_at(rev: str) -> ModuleType:
    """switchhead/kernels/torch_paths.py as of `rev` (see `_module_at`)."""
    return _module_at(rev, "switchhead/kernels/torch_paths.py")


def regime_table(
    ns: list[int],
    regimes: list[str],
    repeats: int,
    against: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]] | None = None,
    cases: list[Case] = CASES,
    triton: bool = False,
) -> list[str]:
    """Each named regime, and with `against` the same regime as of that git revision (or old checkout) beside it.
    `triton`: the Triton kernels first (with `against`, beside them the kernels as of `against`), then their
    backward with grad_x ("cuBLAS dx", `dense_grad_x`), the weight gradient ("cuBLAS dw", `dense_grad_w`) or both
    ("cuBLAS dx+dw") by cuBLAS (forward: the kernels'), then the op as SWITCHHEAD_KERNEL sets it (unset on CUDA:
    the kernels, or dense_forward where `torch_paths.cuda_prefers_dense` and "cuBLAS dx+dw" where
    `torch_paths.cuda_prefers_dense_backward`), and no auto column (that is the CPU's choice)."""
    sources = [("", torch_paths)] + ([(f" @{against}", _paths_at(against))] if against and regimes else [])
    variants = {}
    if triton:
        from switchhead.kernels import triton_kernels

        tk = triton_kernels.load()
        variants["triton"] = (tk.forward, tk.backward)
        if against:
            old = _module_at(against, "switchhead/kernels/triton_kernels.py")
            variants[f"triton @{against}"] = (old.forward, old.backward)
        for name, dx, dw in (("cuBLAS dx", True, False), ("cuBLAS dw", False, True), ("cuBLAS dx+dw", True, True)):
            variants[name] = (tk.forward, partial(tk.backward, dense_grad_x=dx, dense_grad_w=dw))
        variants["op"] = (expert_projection, partial(expert_projection_backward, need_weight_grad=True))
    for r in regimes:
        for suffix, paths in sources:
            if r == "auto":  # the automatic choice with what surrounds it (torch_paths.forward / backward)
                variants[r + suffix] = (paths.forward, paths.backward)
                continue
            if r not in paths.FORWARD:
                sys.exit(f"regime {r!r} does not exist at {against}")
            variants[r + suffix] = (paths.FORWARD[r], paths.BACKWARD[r])
    return _fwd_bwd_table(ns, variants, repeats, dtype, not triton, device, timer, cases)


def each_call(timer: Callable[[Callable], float]) -> Callable[[dict[str, Callable[[], object]]], dict[str, float]]:
    """A table timer that times every call on its own with `timer` (ms per call), not interleaved."""
    return lambda fns: {name: timer(fn) for name, fn in fns.items()}


def _with(fn: Callable, name: str, value: int) -> Callable:
    """fn with torch_paths.`name` set to `value` during each call."""

    def run(*args):
        default = getattr(torch_paths, name)
        setattr(torch_paths, name, value)
        try:
            return fn(*args)
        finally:
            setattr(torch_paths, name, default)

    return run


def _with_block_elements(fn: Callable, size: int) -> Callable:
    # blocks of that size, never the grouped GEMM (which has no blocks)
    return _with(_with_grouped_mm(fn, False), "GROUPED_BLOCK_ELEMENTS", size or 1 << 62)


def _with_grouped_mm(fn: Callable, on: bool) -> Callable:
    limit = (1 << 62) * on
    return _with(_with(fn, "GROUPED_MM_MAX_ELEMENTS", limit), "GROUPED_MM_BACKWARD_MAX_ELEMENTS", limit)


def block_table(ns: list[int], sizes: list[int], repeats: int, regimes: tuple[str, ...] = ("grouped",)) -> list[str]:
    """The blocked regimes (grouped, combo) at several block sizes (0: one block per expert set)."""
    variants = {
        (f"{s // 1024}K" if s else "expert") + ("" if regimes == ("grouped",) else f" {r}"): (
            _with_block_elements(torch_paths.FORWARD[r], s),
            _with_block_elements(torch_paths.BACKWARD[r], s),
        )
        for r in regimes
        for s in sizes
    }
    return _fwd_bwd_table(ns, variants, repeats)


def grouped_mm_table(ns: list[int], repeats: int) -> list[str]:
    """grouped with every expert in one grouped GEMM call beside its blocks of one expert's pairs, at every N
    (whatever GROUPED_MM_MAX_ELEMENTS picks, and its backward's), with each expert's pairs x the wider width in the
    last column."""
    variants = {
        name: tuple(_with_grouped_mm(f, on) for f in (torch_paths.grouped_forward, torch_paths.grouped_backward))
        for name, on in (("grouped GEMM", True), ("blocks", False))
    }

    def per_expert(case: Case, n: int) -> str:
        elements = torch_paths.grouped_mm_elements(n * case.slots, case.heads * case.experts, case.d_in, case.d_out)
        return str(int(elements))

    return _fwd_bwd_table(ns, variants, repeats, extra=("per expert: pairs x max(D_in, D_out)", per_expert))


def anatomy_table(ns: list[int], repeats: int) -> list[str]:
    """Where the grouped forward's time goes: its plan (sort, blocks), row gathers, per-block GEMMs and
    index_adds, each timed alone on the same blocks (result rows as wide as the regime makes them), beside the
    same-FLOP matmul; and the same GEMMs with both widths zero-padded to a multiple of 16, and through oneDNN's
    linear instead of torch.mm (whose fp32 GEMM on the CPU build is MKL's)."""
    lines = _table(
        "| case | N | matmul ms | grouped ms | plan | gathers | GEMMs | index_adds | GEMMs, both widths padded to 16 "
        "| GEMMs by oneDNN | matmul GFLOP/s | GEMMs GFLOP/s |"
    )
    for case in CASES:
        for n in ns:
            t = interleaved_min_ms(_anatomy_parts(case, n), repeats)
            gflop = 2 * n * case.slots * case.d_in * case.d_out / 1e9
            cells = " | ".join(f"{t[k]:.3f}" for k in ("matmul", "grouped", "plan", "gathers", "GEMMs", "index_adds"))
            _add_row(
                lines,
                f"| {case.name} | {n} | {cells} | {t['padded']:.3f} | {t['oneDNN']:.3f} "
                f"| {gflop / t['matmul'] * 1e3:.0f} "
                f"| {gflop / t['GEMMs'] * 1e3:.0f} |",
            )
    return lines


def _onednn_linear(x: torch.Tensor, w_out_in: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w_out_in, None, "none", [], "")


def _anatomy_parts(case: Case, n: int) -> dict[str, Callable[[], object]]:
    acc = torch.float32
    x, w, index, gate = make_inputs(case, n, acc, "cpu")
    xd, wd = (t.detach() for t in _dense_equivalent(case, n))
    x2 = x.reshape(-1, case.d_in)
    plan = torch_paths._plan(index, gate, w, case.n_in, case.n_out, acc, 1)
    blocks = [(experts[0], b) for experts, b in plan.blocks]
    rows = [x2.index_select(0, plan.src[b]) for _, b in blocks]
    # the result rows as wide as the regime makes them (padded for narrow rows and many pairs: GEMM_ALIGN)
    width = torch_paths._gemm_width(case.d_out, x, index, w.shape[0])
    w_run = torch_paths._padded(w, width)
    products = [r @ w_run[e] for (e, _), r in zip(blocks, rows)]
    w_linear = w_run.transpose(1, 2).contiguous()  # oneDNN's linear takes [out, in], as nn.Linear does
    d_in, d_out = torch_paths.aligned(case.d_in), torch_paths.aligned(case.d_out)  # GEMM_ALIGN = 16
    w_pad = torch.nn.functional.pad(w, (0, d_out - case.d_out, 0, d_in - case.d_in))
    rows_pad = [torch.nn.functional.pad(r, (0, d_in - case.d_in)) for r in rows]
    out = torch.zeros(n * case.n_out, width)
    gemms = [(e, r) for (e, _), r in zip(blocks, rows)]
    gemms_padded = [(e, r) for (e, _), r in zip(blocks, rows_pad)]
    adds = [(b, y) for (_, b), y in zip(blocks, products)]
    # Each part drops its block's result before the next block, as the regime does: keeping them all alive would
    # time fresh memory (page faults) instead of the operation.
    return {
        "matmul": _call(_matmul, xd, wd),
        "grouped": _call(torch_paths.grouped_forward, x, w, index, gate, case.n_out),
        "plan": _call(torch_paths._plan, index, gate, w, case.n_in, case.n_out, acc, 1),
        "gathers": _call(_each, lambda b: x2.index_select(0, plan.src[b]), [(b,) for _, b in blocks]),
        "GEMMs": _call(_each, lambda e, r: r @ w_run[e], gemms),
        "index_adds": _call(_each, lambda b, y: out.index_add_(0, plan.dst[b], y), adds),
        "padded": _call(_each, lambda e, r: r @ w_pad[e], gemms_padded),
        "oneDNN": _call(_each, lambda e, r: _onednn_linear(r, w_linear[e]), gemms),
    }


def width_table(ns: list[int], repeats: int, cases: list[Case] = CASES) -> list[str]:
    """The GEMMs of one expert in the grouped regime (N*S/E rows) with their result rows as they are and
    zero-padded to a multiple of `torch_paths.GEMM_ALIGN`, for each product of a training step whose result width
    is not a multiple already: the forward, grad_x (the weight transposed) and the weight gradient (the rows
    contracted). The operands are padded beforehand: this times the GEMMs, not the copies."""
    lines = _table("| case | N | rows | product | result width | ms | padded ms | padded / as is |")
    pad = torch.nn.functional.pad
    for case in cases:
        for n in ns:
            rows = n * case.slots // (case.heads * case.experts)
            g = torch.Generator().manual_seed(0)
            x, u = torch.randn(rows, case.d_in, generator=g), torch.randn(rows, case.d_out, generator=g)
            w = torch.randn(case.d_in, case.d_out, generator=g)
            d_in, d_out = torch_paths.aligned(case.d_in), torch_paths.aligned(case.d_out)
            w_out, u_out = pad(w, (0, d_out - case.d_out)), pad(u, (0, d_out - case.d_out))
            w_in = pad(w, (0, 0, 0, d_in - case.d_in))
            products = [  # name, result width, padded width, as is, padded
                ("forward", case.d_out, d_out, _call(torch.mm, x, w), _call(torch.mm, x, w_out)),
                ("grad_x", case.d_in, d_in, _call(torch.mm, u, w.t()), _call(torch.mm, u, w_in.t())),
                ("weight grad", case.d_out, d_out, _call(torch.mm, x.t(), u), _call(torch.mm, x.t(), u_out)),
            ]
            for name, width, padded, as_is, with_pad in products:
                if padded != width:
                    t = interleaved_min_ms({"as is": as_is, "padded": with_pad}, repeats)
                    cells = f"{t['as is']:.3f} | {t['padded']:.3f} | {t['padded'] / t['as is']:.2f}"
                    _add_row(lines, f"| {case.name} | {n} | {rows} | {name} | {width} -> {padded} | {cells} |")
    return lines


class _Expert(torch.nn.Module):
    """One expert's product, optionally gated, as a module: inductor's C++ GEMM template wants the weight as a frozen
    constant (it prepacks it), which only module parameters under inference compilation give it."""

    def __init__(self, w: torch.Tensor, gated: bool):
        super().__init__()
        self.w, self.gated = torch.nn.Parameter(w), gated

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x @ self.w * g[:, None] if self.gated else x @ self.w


def inductor_table(ns: list[int], repeats: int, cases: list[Case] = CASES) -> list[str]:
    """The grouped regime's GEMMs (one per expert, N*S/E rows each) by torch.mm (MKL) and by the C++ GEMM template
    that torch.compile generates on the CPU (max-autotune, that template only, weights frozen: inference), with the
    gate multiply after the GEMM or fused into the template's epilogue, beside the same-FLOP matmul. The template
    is the one generated fused GEMM within the dependencies; it cannot gather its input rows (index_select stays a
    separate kernel), so this asks whether its GEMM and epilogue could beat MKL's at all."""
    import torch._inductor.config as inductor

    lines = _table(
        "| case | N | rows | matmul ms | MKL GEMMs | template GEMMs | template / MKL | MKL + gate | template, gate "
        "fused | fused / MKL + gate | template, rows dynamic | dynamic / MKL |"
    )
    settings = {"max_autotune": True, "max_autotune_gemm_backends": "CPP", "freezing": True}
    for case in cases:
        experts = case.heads * case.experts
        for n in ns:
            rows = n * case.slots // experts
            g = torch.Generator().manual_seed(0)
            x, gate = torch.randn(rows, case.d_in, generator=g), torch.rand(rows, generator=g)
            w = torch.randn(case.d_in, case.d_out, generator=g)
            xd, wd = (t.detach() for t in _dense_equivalent(case, n))
            plain, gated = _Expert(w, False).eval(), _Expert(w, True).eval()
            # Every module shares one forward: past dynamo's recompile limit (8) it would quietly run eager.
            torch.compiler.reset()
            with torch.no_grad(), inductor.patch(settings):
                compiled = {
                    "template": torch.compile(plain, dynamic=False),
                    "fused": torch.compile(gated, dynamic=False),
                    "dynamic": torch.compile(_Expert(w, False).eval(), dynamic=True),
                }
                for name, fn in compiled.items():
                    ref = (gated if name == "fused" else plain)(x, gate)
                    torch.testing.assert_close(fn(x, gate), ref, rtol=1e-4, atol=1e-4 * case.d_in**0.5)
                fns = {"matmul": _call(_matmul, xd, wd), "MKL": _call(_each, plain, [(x, gate)] * experts)}
                fns["MKL + gate"] = _call(_each, gated, [(x, gate)] * experts)
                fns |= {name: _call(_each, fn, [(x, gate)] * experts) for name, fn in compiled.items()}
                t = interleaved_min_ms(fns, repeats)
            cells = " | ".join(
                f"{t[a]:.3f} | {t[b]:.3f} | {t[b] / t[a]:.2f}"
                for a, b in (("MKL", "template"), ("MKL + gate", "fused"))
            )
            _add_row(
                lines,
                f"| {case.name} | {n} | {rows} | {t['matmul']:.3f} | {cells} | {t['dynamic']:.3f} "
                f"| {t['dynamic'] / t['MKL']:.2f} |",
            )
    return lines


def frozen_table(
    ns: list[int],
    timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    cases: list[Case] = CASES,
) -> list[str]:
    """The op's forward and backward (by autograd, the backend chosen as in the model) with every gradient, and
    with the weight frozen (no weight gradient)."""
    lines = _table("| case | N | trained fwd+bwd ms | frozen fwd+bwd ms | frozen / trained |")
    for case in cases:
        for n in ns:
            x, w, index, gate = make_inputs(case, n, dtype, device, grad=True)
            frozen = w.detach()
            given = [x] + ([gate] if gate is not None else [])
            t = timer({
                "trained": _fwd_bwd(expert_projection, (x, w, index, gate, case.n_out), [*given, w]),
                "frozen": _fwd_bwd(expert_projection, (x, frozen, index, gate, case.n_out), given),
            })  # fmt: skip
            cells = f"{t['trained']:.3f} | {t['frozen']:.3f} | {t['frozen'] / t['trained']:.2f}"
            _add_row(lines, f"| {case.name} | {n} | {cells} |")
    return lines


def _each(fn: Callable, calls: list[tuple]) -> None:
    for args in calls:
        fn(*args)


def kernel_times(fn: Callable[[], object], reps: int = 20) -> dict[str, float]:
    """GPU time of one call in ms per kernel name: the durations of every kernel, memset and copy it puts on the
    GPU (torch.profiler), averaged over `reps` calls. Host overhead is not in it; the L2 cache stays warm."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / reps / 1e3
    return times


def kernel_ms(fn: Callable[[], object]) -> float:
    """GPU time of one call in ms, all kernels together (see kernel_times)."""
    return sum(kernel_times(fn).values())


def gpu_table(
    ns: list[int],
    device: str = "cuda",
    cases: list[Case] = CASES,
    bench: Callable[[Callable], float] | None = None,
    gpu_time: Callable[[Callable], float] = kernel_ms,
) -> list[str]:
    """The op vs one expert's matmul, forward and backward, fp16 and bf16, timed two ways: GPU time (`gpu_time`:
    the kernels' durations) and wall time per call (`bench`, default triton.testing.do_bench, which includes the
    host's launch overhead whenever the GPU finishes first). `device`, `cases` and the timers let the table run on
    the CPU with TRITON_INTERPRET=1 and tiny cases, which checks this code without a GPU (timings meaningless)."""
    if bench is None:
        from triton.testing import do_bench as bench

    steps = ["fwd", "bwd"]
    lines = _table("| case | dtype | N | " + " | ".join(
        f"{timer} {step} ms op | cuBLAS | %" for timer in ("GPU", "wall") for step in steps
    ) + " |")  # fmt: skip
    # On CUDA the op as it runs by default (the kernels, or dense_forward where cuda_prefers_dense and cuBLAS grad_x
    # and weight gradient where cuda_prefers_dense_backward); elsewhere the kernels through the interpreter
    with _backend(None if device == "cuda" else "triton"):
        for dtype in (torch.float16, torch.bfloat16):
            for case in cases:
                for n in ns:
                    _add_row(lines, _gpu_row(case, n, dtype, device, bench, gpu_time))
    return lines


def host_table(
    ns: list[int],
    device: str = "cuda",
    cases: list[Case] = CASES,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 20,
    top: int = 8,
) -> list[str]:
    """Host time of the op as it runs by default, forward and backward, through the dispatcher (`expert_projection`)
    and without it (`project`, the model's entry): what the CPU spends issuing one call (Python, the dispatcher,
    autograd, allocations, kernel launches), timed over `calls` calls without waiting for the GPU (they queue far fewer
    launches than the GPU's queue holds), then, for `project`, the `top` functions with the most own time in `calls`
    more calls under cProfile (which slows Python down: compare its rows with each other, not with the host time). On
    the GPU a call whose host time exceeds its GPU time keeps the GPU waiting: the "wall" columns of the GPU table.
    `device` and `cases` let it run on the CPU with tiny cases, which checks this code without a GPU (there the host
    does the arithmetic too, so the numbers mean nothing)."""
    import cProfile
    import pstats

    from switchhead.kernels.ops import project

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lines = _table("| case | N | fwd host ms op | project | bwd host ms op | project |")
    for case in cases:
        for n in ns:
            x, w, index, gate = make_inputs(case, n, dtype, device, grad=True)
            grads = [x, w] + ([gate] if gate is not None else [])
            cells, profiles = {}, []
            for entry in (expert_projection, project):
                fwd = _call(entry, x, w, index, gate, case.n_out)
                out = fwd()
                bwd = _call(torch.autograd.grad, out, grads, torch.randn_like(out), True)
                bwd()  # compiled and tuned before anything is timed
                for step, fn in (("forward", fwd), ("backward", bwd)):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    cells[step, entry] = f"{(time.perf_counter() - t0) / calls * 1e3:.4f}"
                    sync()
                    if entry is not project:
                        continue
                    profile = cProfile.Profile()
                    profile.enable()
                    for _ in range(calls):
                        fn()
                    profile.disable()
                    sync()
                    profiles.append(f"    {step}: " + _own_time(pstats.Stats(profile), calls, top))
            row = [cells[step, entry] for step in ("forward", "backward") for entry in (expert_projection, project)]
            _add_row(lines, f"| {case.name} | {n} | " + " | ".join(row) + " |")
            for line in profiles:
                print(line, flush=True)
    return lines


def simulated_host_table(
    ns: list[int], cases: list[Case] = CASES, dtype: torch.dtype = torch.bfloat16, calls: int = 20, repeats: int = 15
) -> list[str]:
    """Host time per call of the CUDA path without a GPU (`gpu_build.simulated_gpu`: the compiled kernels on CPU
    tensors, launches that do nothing), us: the custom op (`expert_projection`, through the dispatcher) beside
    `project` (the model's entry, which skips it), forward and forward + backward with autograd recording (training)
    and `project` in inference mode (decoding). Each cell is the best of `repeats` interleaved rounds of `calls`
    calls. The host also does the arithmetic of the torch ops between launches here (allocations, casts), which is
    why the token counts should stay small; the cuBLAS routes that the op takes on CUDA for some shapes from 1024
    tokens on are not simulated (they need CUDA tensors)."""
    from switchhead.kernels import gpu_build
    from switchhead.kernels.ops import project

    lines = _table("| case | N | fwd op us | fwd project | project / op | fwd+bwd op | fwd+bwd project | project / op "
                   "| inference project |")  # fmt: skip
    with _backend("triton"), gpu_build.simulated_gpu():
        for case in cases:
            for n in ns:
                args, wrt = projection_args(case, n, dtype, "cpu")
                fns = {
                    "op": _call(expert_projection, *args), "project": _call(project, *args),
                    "op both": _fwd_bwd(expert_projection, args, wrt), "project both": _fwd_bwd(project, args, wrt),
                    "decode": _decoding(project, args),
                }  # fmt: skip
                for fn in fns.values():
                    fn()  # built and tuned before anything is timed
                us = interleaved_us_per_call(fns, calls, repeats)
                cells = [us["op"], us["project"], us["project"] / us["op"], us["op both"], us["project both"],
                         us["project both"] / us["op both"], us["decode"]]  # fmt: skip
                _add_row(lines, f"| {case.name} | {n} | " + " | ".join(
                    f"{c:.2f}" if i in (2, 5) else f"{c:.1f}" for i, c in enumerate(cells)) + " |")  # fmt: skip
    return lines


def _us_in_launches(
    tk: ModuleType, fn: Callable[[], object], calls: int, repeats: int, sync: Callable[[], None]
) -> float:
    """Microseconds per call of `fn` spent in its kernel launches (`tk._launch` and the launch it returns, not the
    arguments' evaluation between them), best of `repeats` rounds of `calls` calls, `sync` after each round."""
    launch, spent = tk._launch, [0.0]

    def timed(kernel, grid):
        t0 = time.perf_counter()
        run = launch(kernel, grid)
        spent[0] += time.perf_counter() - t0

        def call(*args, **kwargs):
            t1 = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t1

        return call

    best = float("inf")
    tk._launch = timed
    try:
        for _ in range(repeats):
            spent[0] = 0.0
            for _ in range(calls):
                fn()
            sync()
            best = min(best, spent[0])
    finally:
        tk._launch = launch
    return best * 1e6 / calls


def launch_table(
    ns: list[int],
    device: str = "cuda",
    cases: list[Case] = CASES,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 20,
    repeats: int = 15,
) -> list[str]:
    """Time per call of `project`, the model's entry, with its kernels launched through Triton's own launch path and
    directly (`triton_kernels.FAST_LAUNCH` off and on, one call each in turn), in inference mode (decoding) and
    forward + backward with autograd (training): each cell of the whole call is the best of `repeats` interleaved
    rounds of `calls` calls, the GPU synchronised at the end of each round (on a GPU, wall time; inside
    `gpu_build.simulated_gpu`, with `device` "cpu", the host time of the CUDA path); "in launches" is the part of a
    call spent launching kernels, timed separately (best of 5 rounds)."""
    from switchhead.kernels import triton_kernels
    from switchhead.kernels.ops import project

    tk = triton_kernels.load()
    saved = tk.FAST_LAUNCH
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    columns = (f"{step} Triton's launch us | direct | direct / Triton's | in launches: Triton's | direct"
               for step in ("decode", "fwd+bwd"))  # fmt: skip
    lines = _table("| case | N | " + " | ".join(columns) + " |")

    def launched(fn: Callable[[], object], direct: bool) -> Callable[[], object]:
        def run() -> object:
            tk.FAST_LAUNCH = direct
            return fn()

        return run

    try:
        for case in cases:
            for n in ns:
                args, wrt = projection_args(case, n, dtype, device)
                steps = {"decode": _decoding(project, args), "fwd+bwd": _fwd_bwd(project, args, wrt)}
                fns = {(step, direct): launched(fn, direct) for step, fn in steps.items() for direct in (False, True)}
                for fn in fns.values():  # built, tuned, and each build seen by the direct launch, before timing
                    fn()
                    fn()
                us = interleaved_us_per_call(fns, calls, repeats, sync)
                inside = {key: _us_in_launches(tk, fn, calls, 5, sync) for key, fn in fns.items()}
                cells = [f"{us[step, False]:.1f} | {us[step, True]:.1f} | {us[step, True] / us[step, False]:.2f} | "
                         f"{inside[step, False]:.1f} | {inside[step, True]:.1f}" for step in steps]  # fmt: skip
                _add_row(lines, f"| {case.name} | {n} | " + " | ".join(cells) + " |")
    finally:
        tk.FAST_LAUNCH = saved
    return lines


def cuda_graph(fn: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """`fn` captured into a CUDA graph, after warm-up calls on the capture's own stream (lazy initialisation, such
    as a cuBLAS handle's for that stream, autotuning and autograd's streams stay outside the capture): a function
    that replays it and returns what the captured call returned, the graph's own tensors, which every replay
    overwrites. The capture fails if `fn` waits for the GPU on the host (a sync) anywhere."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()

    def replay() -> tuple[torch.Tensor, ...]:
        graph.replay()
        return out

    return replay


def graph_table(
    ns: list[int],
    device: str = "cuda",
    cases: list[Case] = CASES,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 20,
    repeats: int = 15,
    capture: Callable[[Callable], Callable] = cuda_graph,
) -> list[str]:
    """Wall time per call of `project`, the model's entry, called eagerly and replayed from a CUDA graph
    (`capture`), in inference mode (decoding) and forward + backward (training): how much of a call's host time a
    graph would take off the GPU's critical path. Every replay's results are first checked against an eager call's;
    a call that cannot be captured (a host sync) gets '-' cells and its error below the table. Each cell is the best
    of `repeats` interleaved rounds of `calls` calls, the GPU synchronised at the end of each round. `device` and
    `capture` let it run without a GPU (a capture returning the function itself), which checks this code, not the
    timings."""
    from switchhead.kernels.ops import project

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lines = _table("| case | N | decode eager us | graph | graph / eager | fwd+bwd eager us | graph | graph / eager |")
    failures = []
    for case in cases:
        for n in ns:
            args, wrt = projection_args(case, n, dtype, device)
            g = torch.Generator(device="cpu").manual_seed(1)
            grad_out = torch.randn(n, case.n_out, case.d_out, generator=g).to(device, dtype)
            decoded = _decoding(project, args)

            def decode(decoded=decoded) -> tuple[torch.Tensor, ...]:
                return (decoded(),)

            def train(args=args, wrt=wrt, grad_out=grad_out) -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(project(*args), wrt, grad_out)

            fns: dict[str, Callable[[], object]] = {}
            for step, fn in (("decode", decode), ("fwd+bwd", train)):
                want, where = [t.clone() for t in fn()], f"{case.name}, N = {n}, {step}"
                fns[step] = fn
                try:
                    replay = capture(fn)
                except RuntimeError as e:
                    failures.append(f"{where}: capture failed: {str(e).splitlines()[0]}")
                    continue
                names = ("out",) if step == "decode" else ("grad_x", "grad_w", "grad_gate")
                for name, got, expected in zip(names, replay(), want):
                    torch.testing.assert_close(got, expected, msg=lambda m, s=f"{where}: the graph's {name}": (
                        f"{s} is not the eager call's: {m}"))  # fmt: skip
                fns[step + " graph"] = replay
            us = interleaved_us_per_call(fns, calls, repeats, sync)
            cells = []
            for step in ("decode", "fwd+bwd"):
                graph = us.get(step + " graph")
                cells += [f"{us[step]:.1f}", "-" if graph is None else f"{graph:.1f}",
                          "-" if graph is None else f"{graph / us[step]:.2f}"]  # fmt: skip
            _add_row(lines, f"| {case.name} | {n} | " + " | ".join(cells) + " |")
    for failure in failures:
        print(failure, flush=True)
    return lines


def _own_time(stats, calls: int, top: int) -> str:
    """'us function (file:line); ...': the `top` functions by own time per call, most first."""
    rows = sorted(((tt, key) for key, (_, _, tt, _, _) in stats.stats.items()), reverse=True)[:top]
    cells = []
    for tt, (path, line, name) in rows:
        where = "" if path == "~" else f" ({os.path.basename(path)}:{line})"  # "~": a builtin, which has no file
        cells.append(f"{tt / calls * 1e6:.1f} {name}{where}")
    return "; ".join(cells)


@contextmanager
def _backend(choice: str | None) -> Iterator[None]:
    """SWITCHHEAD_KERNEL set to `choice` (None: left as it is) inside the block, restored after it."""
    saved = os.environ.get("SWITCHHEAD_KERNEL")
    if choice is not None:
        os.environ["SWITCHHEAD_KERNEL"] = choice
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("SWITCHHEAD_KERNEL", None)
        else:
            os.environ["SWITCHHEAD_KERNEL"] = saved


def geometry_splits(case: Case, n: int, device: torch.device) -> int:
    """The weight gradient's chunks per expert that the op picks for `case` at N tokens: the backward's padded
    widths and pair bucket, on `device`'s SM count (NOMINAL_SMS off CUDA)."""
    from switchhead.kernels import triton_kernels

    tk = triton_kernels.load()
    d_in, d_out = tk._aligned(case.d_in, tk.ALIGN), tk._aligned(case.d_out, tk.ALIGN)
    return tk._weight_grad_splits(case.heads * case.experts, d_in, d_out, tk._bucket(n * case.slots), device)


def split_table(
    ns: list[int],
    splits: list[int],
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    cases: list[Case] = CASES,
    times: Callable[[Callable[[], object]], dict[str, float]] = kernel_times,
) -> list[str]:
    """The Triton backward (every gradient, by the kernels alone: no cuBLAS route) with each expert's pairs cut into
    each of `splits` chunks for the weight gradient (`triton_kernels.WEIGHT_GRAD_SPLITS`), beside the count its
    geometry picks: GPU time of the whole backward (the chunks' reduction included) and of the weight-gradient
    kernel alone. `device` and `times` let the table run under the interpreter (timings meaningless)."""
    from switchhead.kernels import triton_kernels

    lines = _table("| case | dtype | N | splits by geometry | " + " | ".join(
        f"{s} split{'s' * (s > 1)}: bwd ms | dw kernel us" for s in splits
    ) + " |")  # fmt: skip
    with _backend("triton"):
        tk = triton_kernels.load()
        for case in cases:
            for n in ns:
                x, w, index, gate = make_inputs(case, n, dtype, device)
                grad = torch.randn(n, case.n_out, case.d_out, device=device, dtype=dtype)
                auto = geometry_splits(case, n, x.device)
                cells = []
                for s in splits:
                    tk.WEIGHT_GRAD_SPLITS = s
                    try:
                        t = times(_call(expert_projection_backward, grad, x, w, index, gate, gate is not None, True))
                    finally:
                        tk.WEIGHT_GRAD_SPLITS = 0
                    cells.append(f"{sum(t.values()):.4f} | {1e3 * t.get('_weight_grad_kernel', 0.0):.0f}")
                _add_row(lines, f"| {case.name} | {str(dtype)[6:]} | {n} | {auto} | " + " | ".join(cells) + " |")
    return lines


def _gpu_row(
    case: Case,
    n: int,
    dtype: torch.dtype,
    device: str,
    bench: Callable[[Callable], float],
    gpu_time: Callable,
) -> str:
    x, w, index, gate = make_inputs(case, n, dtype, device, grad=True)
    grads = [x, w] + ([gate] if gate is not None else [])
    # One expert's matrix applied to all N*S pairs: the op's FLOPs without routing.
    xd = torch.randn(n * case.slots, case.d_in, device=device, dtype=dtype, requires_grad=True)
    wd = torch.randn(case.d_in, case.d_out, device=device, dtype=dtype, requires_grad=True)
    out = expert_projection(x, w, index, gate, case.n_out)
    dense = xd @ wd
    go, gd = torch.randn_like(out), torch.randn_like(dense)
    pairs = [  # (op, cuBLAS): forward, backward
        (_call(expert_projection, x, w, index, gate, case.n_out), _call(_matmul, xd, wd)),
        (_call(torch.autograd.grad, out, grads, go, True), _call(torch.autograd.grad, dense, [xd, wd], gd, True)),
    ]
    cells = []
    for timer in (gpu_time, bench):
        for op, mm in pairs:
            t_op, t_mm = timer(op), timer(mm)
            cells.append(f"{t_op:.4f} | {t_mm:.4f} | {100 * t_mm / t_op:.0f}%")
    return f"| {case.name} | {str(dtype)[6:]} | {n} | " + " | ".join(cells) + " |"


def parse_case(parser: argparse.ArgumentParser, spec: list[str]) -> Case:
    """A --case: NAME and seven positive sizes, routed as the model routes (k distinct experts per head)."""
    try:
        sizes = [int(v) for v in spec[1:]]
    except ValueError:
        parser.error(f"--case {' '.join(spec)}: the seven sizes must be integers")
    d_in, d_out, n_in, n_out, heads, experts, k = sizes
    if min(sizes) < 1 or k > experts or heads * k % n_in or heads * k % n_out:
        parser.error(f"--case {' '.join(spec)}: sizes must be >= 1, K <= EXPERTS, and HEADS*K slots a multiple of "
                     "N_IN and of N_OUT")  # fmt: skip
    return Case(spec[0], *sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 16, 256, 4096], help="token counts")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU table (the GPU one runs where CUDA is)")
    parser.add_argument(
        "--block-elements",
        type=int,
        nargs="+",
        help="only time the grouped regime (or those of --regimes) at these block sizes (0: whole expert sets)",
    )
    parser.add_argument("--regimes", nargs="+", choices=[*torch_paths.FORWARD, "auto"],
                        help="only time these regimes (auto: the automatic choice, as torch_paths.forward makes it)")
    parser.add_argument(
        "--against",
        metavar="REV",
        help="with --regimes (and with --device cuda, the Triton kernels): also time them as of this git revision or "
        "as they lie in this directory (an old checkout)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="op table and --regimes dtype (--anatomy, --block-elements and --gemm-widths are fp32)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="--regimes on this device; cuda: beside the Triton kernels, in GPU time and in wall time",
    )
    parser.add_argument("--anatomy", action="store_true", help="only break the grouped forward's time down")
    parser.add_argument(
        "--grouped-mm",
        action="store_true",
        help="only time grouped through torch's grouped GEMM beside its per-expert blocks, at every N",
    )
    parser.add_argument(
        "--gemm-widths", action="store_true", help="only time one expert's GEMMs with result rows padded and not"
    )
    parser.add_argument(
        "--frozen", action="store_true", help="only time forward+backward with the weight trained and frozen"
    )
    parser.add_argument(
        "--inductor", action="store_true", help="only time the per-expert GEMMs by MKL and by torch.compile's C++ GEMM"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--case",
        nargs=8,
        action="append",
        metavar=("NAME", "D_IN", "D_OUT", "N_IN", "N_OUT", "HEADS", "EXPERTS", "K"),
        help="with --regimes: time this shape instead of the model's (repeatable; every slot gated)",
    )
    parser.add_argument(
        "--gpu-n", type=int, nargs="+", default=[1, 256, 4096, 16384], help="token counts of the GPU table"
    )
    parser.add_argument(
        "--host",
        action="store_true",
        help="only the op's host time per call on CUDA, forward and backward, and where it goes (cProfile)",
    )
    parser.add_argument(
        "--simulated",
        action="store_true",
        help="with --host or --launch: without a GPU, on CPU tensors through a stand-in for Triton's CUDA driver that "
        "launches nothing (the CUDA path's host time; --host: the op beside project)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="only project's wall time per call on CUDA, eager and replayed from a CUDA graph, decoding and training",
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="only project's time per call on CUDA with its kernels launched through Triton's launch path and "
        "directly (with --simulated: host time without a GPU)",
    )
    parser.add_argument(
        "--weight-grad-splits",
        type=int,
        nargs="+",
        metavar="S",
        help="only time the Triton backward with the weight gradient's pairs in S chunks per expert (CUDA)",
    )
    args = parser.parse_args()
    if min(args.n + args.gpu_n) < 1 or args.threads < 0 or min(args.block_elements or [0]) < 0:
        parser.error("--n and --gpu-n must be at least 1, --threads and --block-elements at least 0")
    if args.against and not (args.regimes or args.device == "cuda"):
        parser.error("--against needs --regimes or --device cuda (it times regimes or kernels beside their old code)")
    if args.case and not (args.regimes or args.against):
        parser.error("--case needs --regimes or --against")
    cases = [parse_case(parser, c) for c in args.case] if args.case else CASES
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()},"
        f" CPU regime costs {torch_paths.this_cpu()}"
    )
    if args.simulated and not (args.host or args.launch):
        parser.error("--simulated goes with --host or --launch")
    repeats = 5 if args.quick else 15  # of the interleaved timing rounds
    if args.launch:
        from switchhead.kernels import gpu_build

        dtype = getattr(torch, args.dtype)
        if not (args.simulated or torch.cuda.is_available()):
            parser.error("--launch needs a CUDA device (or --simulated)")
        where = "Simulated GPU (sm_90 builds, launches that do nothing)" if args.simulated else (
            f"GPU ({torch.cuda.get_device_name()})")  # fmt: skip
        timed = "host time" if args.simulated else "wall time"
        print(f"\n## {where}: project's {timed} per call, kernels launched through Triton's launch path and directly "
              f"({args.dtype}, us, best of {repeats} interleaved rounds of 20 calls)\n")  # fmt: skip
        if args.simulated:
            with _backend("triton"), gpu_build.simulated_gpu():
                launch_table(args.n, "cpu", dtype=dtype, repeats=repeats)
        else:
            launch_table(args.n, dtype=dtype, repeats=repeats)
        return
    if args.host and args.simulated:
        dtype = getattr(torch, args.dtype)
        print(f"\n## Simulated GPU (sm_90 builds, launches that do nothing): host time per call ({args.dtype}, us, "
              f"best of {repeats} interleaved rounds of 20 calls)\n")  # fmt: skip
        simulated_host_table(args.n, dtype=dtype, repeats=repeats)
        return
    if args.host:
        if not torch.cuda.is_available():
            parser.error("--host needs a CUDA device (or --simulated)")
        print(f"\n## GPU ({torch.cuda.get_device_name()}): the op's host time per call ({args.dtype}, ms), and "
              "project's functions with the most own time per call under cProfile (us)\n")  # fmt: skip
        host_table(args.n, dtype=getattr(torch, args.dtype))
        return
    if args.graphs:
        if not torch.cuda.is_available():
            parser.error("--graphs needs a CUDA device")
        print(f"\n## GPU ({torch.cuda.get_device_name()}): project's wall time per call, eager and replayed from a "
              f"CUDA graph ({args.dtype}, us, best of {repeats} interleaved rounds of 20 calls)\n")  # fmt: skip
        graph_table(args.n, dtype=getattr(torch, args.dtype), repeats=repeats)
        return
    if args.weight_grad_splits:
        if min(args.weight_grad_splits) < 1 or not torch.cuda.is_available():
            parser.error("--weight-grad-splits needs counts of at least 1 and a CUDA device")
        print(f"\n## GPU ({torch.cuda.get_device_name()}): the Triton backward by weight-gradient chunks per expert "
              f"({args.dtype}, GPU time)\n")  # fmt: skip
        split_table(args.n, args.weight_grad_splits, getattr(torch, args.dtype))
        return
    if args.device == "cuda" and not ((args.regimes or args.frozen or args.against) and torch.cuda.is_available()):
        parser.error("--device cuda needs --regimes, --against or --frozen, and a CUDA device")
    if args.frozen:
        timed = "GPU time" if args.device == "cuda" else "best of the interleaved repeats"
        print(f"\n## {args.device.upper()} op, weight trained and frozen ({args.dtype}, {timed}, ms)\n")
        timer = each_call(kernel_ms) if args.device == "cuda" else partial(interleaved_min_ms, repeats=repeats)
        frozen_table(args.n, timer, getattr(torch, args.dtype), args.device)
        return
    if (args.regimes or args.against) and args.device == "cuda":
        from triton.testing import do_bench

        dtype = getattr(torch, args.dtype)
        for what, timer in (("GPU time", kernel_ms), ("wall time", do_bench)):
            print(f"\n## GPU ({torch.cuda.get_device_name()}): regimes beside the Triton kernels, forward and "
                  f"backward ({args.dtype}, {what}, ms)\n")  # fmt: skip
            regimes = args.regimes or []
            regime_table(args.n, regimes, 0, args.against, dtype, "cuda", each_call(timer), cases, triton=True)
        return
    if args.block_elements:
        regimes = tuple(args.regimes or ["grouped"])
        if set(regimes) - {"grouped", "combo"} or args.against:
            parser.error("--block-elements times the blocked regimes (grouped, combo) of the current code only")
        print(f"\n## CPU {' and '.join(regimes)} by block size (fp32, best of the interleaved repeats, ms)\n")
        block_table(args.n, args.block_elements, repeats, regimes)
        return
    if args.regimes:
        print(f"\n## CPU regimes, forward and backward ({args.dtype}, best of the interleaved repeats, ms)\n")
        regime_table(
            args.n, args.regimes, repeats, args.against, getattr(torch, args.dtype), cases=cases
        )
        return
    if args.grouped_mm:
        print("\n## CPU grouped: one grouped GEMM or blocks of one expert's pairs (fp32, best of interleaved runs)\n")
        grouped_mm_table(args.n, repeats)
        return
    if args.anatomy:
        print("\n## CPU grouped forward, part by part (fp32, best of the interleaved repeats, ms)\n")
        anatomy_table(args.n, repeats)
        return
    if args.inductor:
        print("\n## CPU per-expert GEMMs by MKL and by inductor's C++ template (fp32, best of the repeats, ms)\n")
        inductor_table(args.n, repeats)
        return
    if args.gemm_widths:
        print("\n## CPU GEMMs of one expert, result rows as they are and padded (fp32, best of interleaved repeats)\n")
        width_table(args.n, repeats)
        return
    if not args.no_cpu:
        print(f"\n## CPU ({args.dtype}, best of the interleaved repeats, ms)\n")
        cpu_table(args.n, repeats, getattr(torch, args.dtype))
    if torch.cuda.is_available():
        print(f"\n## GPU ({torch.cuda.get_device_name()})\n")
        gpu_table(args.gpu_n)
    else:
        print("\n(no CUDA device: GPU part not run)")


if __name__ == "__main__":
    main()
