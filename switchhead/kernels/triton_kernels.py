"""Triton kernels for the expert projection (the default for CUDA tensors; see `ops` for the semantics).

Three kernels, each followed by its launcher, after the sort of the pairs by expert that the first two need (a
counting sort: `_count_pairs_kernel`, a cumsum, `_place_pairs_kernel`):

1. `_grouped_matmul_kernel` (forward, and gradient w.r.t. the input): the (token, slot) pairs are sorted by
   expert and every expert's pairs are cut into BLOCK_M tiles, so each program runs one dense tile GEMM
   against a single expert: no masked multi-expert loop, padding only in each expert's last tile. Rows are
   gathered straight from x, the gate multiply and the slot/head reduction happen in the epilogue: no
   [N, S, D_out] intermediate is ever written. When several slots feed one output row the epilogue adds into
   an fp32 buffer with atomics: bitwise reproducible only while at most two slots share a row (fp32 addition
   is commutative, not associative). Under torch.use_deterministic_algorithms(True) each pair gets a row of
   its own instead, summed in a fixed order afterwards. The same kernel computes grad_x with the weight
   transposed, and its epilogue also yields the gate gradient (gate_grad = <x, grad @ W^T> is exactly the
   un-gated grad_x contribution dotted with x), so the backward needs no recomputation of the forward. With
   STORE off it writes nothing but that gate gradient (forward-oriented: <x @ W, grad>), for a backward whose
   grad_x cuBLAS computes (`backward(dense_grad_x=True)`).
2. `_weight_grad_kernel`: one program per (expert, D_in tile, D_out tile) walks that expert's pairs in a
   fixed order: deterministic, no atomics (the authors' CVMM uses atomics here). When that is too few programs
   for the GPU, each expert's pairs are cut into chunks with one program each, whose partial sums are added
   in a fixed order afterwards.
3. `_gather_kernel` for a handful of tokens (batch-1 decode), where tiles of 64 sorted pairs would be almost
   empty: one program per output row and column block loads the selected expert columns directly.

Autotuning keys use the pair count rounded up to a power of two (`_bucket`), so a new sequence length does
not trigger a new tuning run; each precision has its own tiles (tensor cores, or FMA units for fp32 without
TF32). Widths and row strides are compile-time constants, so that every build gets aligned, pipelined tile
loads; rows are zero-padded to a multiple of 16 elements (`ALIGN`) where measurements showed it pays, while the
results (output, grad_x, weight gradient) are written at their own widths, so no copy slices the padding off.
`gpu_build` builds the kernels for a GPU without one to check both. Under TRITON_INTERPRET=1 (CPU
tests) a single small config is used. Every launch goes through `_launch`, which launches a build directly once
Triton's own launch path has chosen it for the same arguments: a call's host time is what the GPU waits on at
these sizes.

TRITON_INTERPRET is read by ``triton.jit`` when this module is imported; `load` re-imports the module when
the variable changed since, so tests can switch to the interpreter at run time.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
from types import ModuleType

import numpy
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from switchhead.kernels import torch_paths
from switchhead.kernels.ops import KernelBackendError

_INTERPRETED: bool = knobs.runtime.interpret

# The tiled kernels see rows (and the expert matrices' rows) zero-padded to a multiple of this many elements (1:
# not padded). The padded zeros add nothing to any result. Widths and row strides are compile-time constants of
# every kernel, so Triton knows how rows are aligned whatever the width: unpadded, the 47M model's 412 and 76 get
# async copies at 16-bit precisions, of 8 bytes at most (as plain arguments, which Triton specialises only when
# divisible by 16, they gave scalar loads without async copies, 255 registers and spills). On an H100
# (docs/BENCHMARKS.md) the narrower copies cost less than padding only where the padded tensor is large and the
# kernel reads it once: the forward's input rows when they are wide. Unpadded, the 47M V and sigma-MoE up
# forwards (412-wide rows) took 0.79x and 0.58x the GPU time; the 47M O forward (76-wide rows) 1.06x, the weight
# gradients up to 1.7x.
ALIGN = 16
# The forward leaves rows unpadded when its input rows are at least this wide (412: faster unpadded, 76: slower;
# 128-wide rows, aligned already, were no different).
UNPADDED_FORWARD_MIN_WIDTH = 256

# Build options fixed rather than left to Triton's defaults: FMA contraction of a*b+c, on until Triton 3.9 and
# announced to turn off in 3.10 (3.9 warns when it is unset), stays on so results do not change with the version.
_BUILD = {"enable_fp_fusion": True}

# Up to this many tokens the gather kernel runs the forward (no sorting, no tiles). A guess from the tile
# geometry (a 64-row tile of sorted pairs is < 10% full below it), not a timing: the cut-over has not been
# compared with the tiled path on a GPU (a whole N = 1 forward takes 3.3-8.6 us of GPU time on an H100).
GATHER_MAX_TOKENS = 8

# The weight gradient has one program per (expert, D_in tile, D_out tile). When that is few programs for the GPU
# (47M: 10 experts x 7 x 2 tiles of 64 = 140 programs for 132 SMs on an H100 or H200), each expert's pairs are
# split into chunks, summed in a fixed order afterwards: as many as come closest to WEIGHT_GRAD_PROGRAMS_PER_SM
# programs per SM, at most WEIGHT_GRAD_MAX_SPLITS, and only while chunks average at least WEIGHT_GRAD_MIN_PAIRS of
# the pair count rounded up to a power of two (the autotune bucket). Fitted to `gpu.sh splits` on an H200
# (docs/BENCHMARKS.md, bf16): the 47M shapes' backward at N = 16384 took 0.87-0.90x the GPU time in 4 chunks
# that it took in 2 (8: within 4 % of 4); 512 programs (262M) ran fastest unsplit; and the fp32 partial sums
# and their reduction cost more than they saved at 1024 bucketed pairs per expert (sigma-MoE, N = 4096:
# 1.08-1.13x the unsplit backward in 2 chunks), but not at 3277 (47M, N = 4096: 0.79-0.83x in 4).
WEIGHT_GRAD_PROGRAMS_PER_SM = 4
WEIGHT_GRAD_MAX_SPLITS = 8
WEIGHT_GRAD_MIN_PAIRS = 768
# A chunk count that replaces the geometry above when > 0, so that `benchmarks/kernels.py --weight-grad-splits`
# can time each count on a GPU.
WEIGHT_GRAD_SPLITS = 0
# SM count assumed where there is no CUDA device to ask (the interpreter and `gpu_build`): an H100's.
NOMINAL_SMS = 132


def load() -> ModuleType:
    """This module, re-imported if TRITON_INTERPRET changed since it was imported."""
    module = sys.modules[__name__]
    if knobs.runtime.interpret != _INTERPRETED:
        module = importlib.reload(module)
    return module


# Host-side arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 work in kernels too, and cost about
# 2 us a call on the host in Triton 3.9 (`python -m timeit`, docs/BENCHMARKS.md "Direct launches").
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _bucket(n: int) -> int:
    """Autotune key for a row count: the next power of two, so nearby sizes share one tuning result."""
    return _next_power_of_2(n)


def _precision(dtype: torch.dtype) -> str:
    # tl.dot rounds fp32 inputs to tf32 by default; follow torch's own setting so fp32 results match cuBLAS.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _dot_fp32(dtype: torch.dtype) -> bool:
    # The interpreter's tl.dot reads bf16 operands as raw integers (triton 3.7); widen them first there. On a GPU
    # the bf16 dot stays on the tensor cores (its products are exact in fp32 either way).
    return _INTERPRETED and dtype == torch.bfloat16


# Tiles (block sizes, warps, stages) the autotuner tries. Every one was built for sm_90 at the paper's shapes by
# `python benchmarks/kernel_resources.py` (docs/BENCHMARKS.md) and kept only if it needs no register spills.
# fp32 without TF32 (PRECISION "ieee") runs tl.dot on the FMA units, where each thread holds whole rows and
# columns of its operands: the tensor-core tiles spilled there (`--every-tile`, triton 3.9: 44 of 162 builds, up to
# 11 KB of stack per thread for the weight gradient), so that precision gets smaller tiles of its own. Tiles that
# spilled in one Triton version gave way to 8-warp ones: (64, 32, 64) in grad_x (3.8 with 4 warps, 3.6 with 8 on
# unpadded 76-wide rows), (32, 64, 32) (3.9: 16 bytes in the sigma-MoE up grad_x with 4 warps), the 4-warp
# weight-gradient tiles (3.6: 8-304 bytes).
_MATMUL_TILES = {  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    "mma": [(64, 64, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (128, 128, 32, 8, 3), (64, 32, 64, 4, 4)],
    "fma": [(64, 64, 32, 4, 4), (32, 64, 32, 8, 4), (32, 32, 64, 8, 4), (32, 32, 32, 4, 4)],
}
_WEIGHT_GRAD_TILES = {  # BLOCK_P, BLOCK_K, BLOCK_N, warps, stages
    "mma": [(32, 64, 64, 4, 4), (64, 64, 64, 4, 3), (32, 128, 64, 4, 4), (64, 128, 128, 8, 3), (32, 32, 64, 4, 4)],
    "fma": [(16, 64, 64, 8, 4), (32, 32, 64, 8, 4), (32, 64, 32, 8, 4), (16, 32, 64, 4, 4)],
}


def _unit(precision: str) -> str:
    return "fma" if precision == "ieee" else "mma"


def _configs(names: tuple[str, str, str], tiles: dict[str, list[tuple]]) -> dict[str, list[triton.Config]]:
    if _INTERPRETED:
        one = [triton.Config(dict.fromkeys(names, 16), num_warps=1)]
        return {"mma": one, "fma": one}
    return {
        unit: [triton.Config(dict(zip(names, t[:3])), num_warps=t[3], num_stages=t[4]) for t in unit_tiles]
        for unit, unit_tiles in tiles.items()
    }


_MATMUL_CONFIGS = _configs(("BLOCK_M", "BLOCK_N", "BLOCK_K"), _MATMUL_TILES)
_WEIGHT_GRAD_CONFIGS = _configs(("BLOCK_P", "BLOCK_K", "BLOCK_N"), _WEIGHT_GRAD_TILES)


def _pruner(by_unit: dict[str, list[triton.Config]]):
    """early_config_prune: only the tiles made for the precision of this launch."""
    return lambda configs, named_args, **kwargs: by_unit[_unit(kwargs.get("PRECISION", named_args.get("PRECISION")))]


def _all(by_unit: dict[str, list[triton.Config]]) -> list[triton.Config]:
    """Every config once (the interpreter's single config is shared by both units)."""
    return list({id(c): c for configs in by_unit.values() for c in configs}.values())


def _oriented(weight: Tensor, transpose_weight: bool) -> tuple[int, int, int]:
    """A tiled product's output width and the (K, N) strides it reads the weight with: W, or W^T in place."""
    stride_wk, stride_wn = weight.stride(1), weight.stride(2)
    if transpose_weight:
        return weight.shape[1], stride_wn, stride_wk
    return weight.shape[2], stride_wk, stride_wn


def _gate_grad_partials(n_dim: int, n_pairs: int, configs: dict[str, list[triton.Config]], device) -> Tensor:
    """The zeroed fp32 [column blocks, pairs] buffer of a gate-gradient epilogue's per-block partial sums, with
    as many blocks as the narrowest of `configs`' tiles cuts the output width into."""
    block_n = min(c.kwargs["BLOCK_N"] for c in _all(configs))
    return torch.zeros(_cdiv(n_dim, block_n), n_pairs, dtype=torch.float32, device=device)


def _require_runnable(t: Tensor) -> None:
    if not t.is_cuda and not _INTERPRETED:
        raise KernelBackendError(
            "the Triton kernels need CUDA tensors; set TRITON_INTERPRET=1 to run them (slowly) on the CPU"
        )
    if _INTERPRETED and (clash := interpreter_clash(triton.__version__, numpy.__version__)):
        raise KernelBackendError(clash)


# Launches go through `_launch` rather than `kernel[grid]`; with this off, through Triton's own launch path every
# time (`benchmarks/kernels.py --launch` times both).
FAST_LAUNCH = True


def _launch(kernel, grid):
    """`kernel[grid]` (call it with the kernel's arguments), launched directly once the arguments' autotune key
    and specialisation have a build.

    Triton's launch path does several microseconds of Python per call on top of specialising the arguments (the
    autotuner's key, the kernel cache's key, option and global checks, the driver's device and stream), and
    on a GPU the host time is what small calls wait on. The direct launch keeps the part that decides which
    binary runs, Triton's own specialisation of these arguments (dtypes, pointer alignment, integers equal to
    1 or divisible by 16), and the autotuner's chosen config, and launches the very build Triton's path chose for
    them the first time: the same binary, grid and arguments. It does not see a Triton knob (TRITON_DEBUG, ...)
    changed after that first launch, and the kernels read no globals (Triton would check those each call)."""
    if not FAST_LAUNCH or _INTERPRETED:
        return kernel[grid]
    launcher = _launchers.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        if not isinstance(kernel, (Autotuner, JITFunction)):  # a stand-in (gpu_build records launches)
            return kernel[grid]
        launcher = _launchers[id(kernel)] = _DirectLauncher(kernel)
    return lambda *args, **kwargs: launcher(grid, args, kwargs)


class _DirectLauncher:
    def __init__(self, kernel):
        self.kernel = kernel
        self.tuned = isinstance(kernel, Autotuner)
        self.jit = kernel.fn if self.tuned else kernel
        self.builds: dict[tuple, object] = {}  # (device, specialisation, options) -> the build Triton launched
        self.direct = 0  # launches made directly (what the tests check)
        if self.tuned:
            self.key_at = [(kernel.arg_names.index(name), name) for name in kernel.keys]

    def __call__(self, grid, args: tuple, kwargs: dict):
        if self.jit.pre_run_hooks:  # hooks someone added to the kernel, which Triton's path runs before each launch
            return self.kernel[grid](*args, **kwargs)
        config = {}
        if self.tuned:
            configs = self.kernel.configs
            if len(configs) > 1:  # the key Triton's autotuner files its choice under: named values, then dtypes
                key = tuple(args[i] if i < len(args) else kwargs[name] for i, name in self.key_at)
                chosen = self.kernel.cache.get(key + tuple(str(a.dtype) for a in args if isinstance(a, Tensor)))
            else:
                chosen = configs[0]
            if chosen is None or chosen.pre_hook is not None:  # not tuned yet, or a hook to run: Triton's path
                return self.kernel[grid](*args, **kwargs)
            config = chosen.all_kwargs()
        device = driver.active.get_current_device()
        bound, specialization, options = self.jit.device_caches[device][4](*args, **kwargs, **config)
        key = (device, tuple(specialization), tuple(options.items()))
        build = self.builds.get(key)
        if build is None:
            build = self.kernel[grid](*args, **kwargs)
            if build is not None:
                self.builds[key] = build
            return build
        # The launch as Triton's path makes it with a build it has (JITFunction.run), whose launch metadata is only
        # for a launch hook (None without one).
        grid = grid(bound) if callable(grid) else grid  # the arguments by name, as Triton passes them
        values, stream = tuple(bound.values()), driver.active.get_current_stream(device)
        enter_hook = knobs.runtime.launch_enter_hook
        metadata = build.launch_metadata(grid, stream, *values) if enter_hook is not None else None
        g0, g1, g2 = (*grid, 1, 1)[:3]
        build.run(g0, g1, g2, stream, build.function, build.packed_metadata, metadata, enter_hook,
                  knobs.runtime.launch_exit_hook, *values)  # fmt: skip
        self.direct += 1
        return build


_launchers: dict[int, _DirectLauncher] = {}


def interpreter_clash(triton_version: str, numpy_version: str) -> str | None:
    """Why the Triton interpreter cannot run here, or None. Before Triton 3.7 the interpreter turns one-element
    arrays into loop bounds with int(), which NumPy 2.4 made an error (it was deprecated since 1.25); the
    compiled kernels are not affected."""

    def major_minor(version: str) -> tuple[int, int]:
        major, minor = re.findall(r"\d+", version)[:2]
        return int(major), int(minor)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (
            f"the Triton {triton_version} interpreter cannot run with NumPy {numpy_version}: "
            "install triton>=3.7 or numpy<2.4 to run the Triton kernels on the CPU"
        )
    return None


def _sort_pairs(index: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """Pair ids (n*S + s) sorted by expert (int32), and offsets[e]..offsets[e+1] = the pairs of expert e.

    The sort is stable so that the weight gradient sums every expert's pairs in the same order each run.
    Nothing is copied to the host: the kernels find their tiles from `offsets` themselves. Up to
    COUNTING_SORT_MAX_EXPERTS experts it is a counting sort in three launches (`_count_pairs_kernel`, a cumsum,
    `_place_pairs_kernel`); above, torch.sort.
    """
    flat = index.reshape(-1).contiguous()  # the counting kernels read it with unit stride (reshape may give a view)
    if n_experts <= COUNTING_SORT_MAX_EXPERTS:
        return _counting_sort(flat, n_experts)
    # The narrowest key that holds every expert id and E itself: CUDA's radix sort makes one pass per key byte
    # (two instead of eight for int64). (torch.bincount would count the pairs per expert in one op, but on CUDA it
    # reads the largest index on the host first: a sync per call.)
    key_dtype = torch.int16 if n_experts < 2**15 else flat.dtype
    keys, order = torch.sort(flat.to(key_dtype), stable=True)
    bounds = torch.arange(n_experts + 1, dtype=keys.dtype, device=keys.device)
    return order.to(torch.int32), torch.searchsorted(keys, bounds, out_int32=True)


# ----------------------------------------------------------------------------------------------------------
# The kernels avoid triton.language's own @jit helpers (tl.cdiv, tl.zeros, tl.sum, tl.cumsum): when triton
# was imported before TRITON_INTERPRET=1 was set (torch imports it early), those stay compiled-mode functions
# that the interpreter cannot call. Builtins (tl.full, tl.reduce, tl.associative_scan, tl.dot) work in both.
#
# The combine function of every sum: triton's own (a + b). The interpreter recognises it and sums or scans with
# NumPy, where a function of ours is called once per element (the counting sort's scans took minutes in tests).
_add = tl.standard._sum_combine


# ----------------------------------------------------------------------------------------------------------
# 0. Counting sort of the pairs by expert


# Experts up to which pairs are sorted by counting. Each block of pairs is compared with every expert at once
# (a [block, experts] one-hot), so the block shrinks as experts grow: past this many, the [experts, blocks]
# count table grows larger than the pairs, and torch.sort takes over.
COUNTING_SORT_MAX_EXPERTS = 64


def _counting_block(n_experts: int) -> int:
    # 2**12 one-hot cells per program: with 2**14 the sm_90 build of the placing kernel spilled (4 warps).
    # 2**8 under the interpreter, which runs the programs one at a time (tests then see several blocks).
    cells = 2**8 if _INTERPRETED else 2**12
    return max(16, cells // _next_power_of_2(n_experts + 1))


@triton.jit
def _one_hot(index_ptr, n_pairs, n_experts, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """Pair ids of this program's block and their [BLOCK, E_PAD] one-hot expert rows: all zero past the end and
    for an expert id outside [0, E) (CUDA indices are not checked; such pairs are left out, not misplaced)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(index_ptr + offs, mask=offs < n_pairs, other=-1).to(tl.int32)
    e = tl.arange(0, E_PAD)
    hot = ((expert[:, None] == e[None, :]) & (e[None, :] < n_experts)).to(tl.int32)
    return offs, hot


@triton.jit
def _count_pairs_kernel(index_ptr, counts_ptr, n_pairs, n_experts, n_blocks, BLOCK: tl.constexpr, E_PAD: tl.constexpr):
    """counts[e, b] = pairs of block b on expert e: expert-major, so that its flat cumsum gives every (expert,
    block) its first place in the sorted order."""
    _, hot = _one_hot(index_ptr, n_pairs, n_experts, BLOCK, E_PAD)
    e = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e * n_blocks + tl.program_id(0), tl.reduce(hot, 0, _add), mask=e < n_experts)


@triton.jit
def _place_pairs_kernel(
    index_ptr, counts_ptr, ends_ptr, order_ptr, offsets_ptr, n_pairs, n_experts, n_blocks,
    BLOCK: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """Writes each pair id of block b at its place: the first place of (its expert, b), plus the pairs of that
    expert before it in the block. Block 0 also writes the offsets (the first place of each expert)."""
    b = tl.program_id(0)
    offs, hot = _one_hot(index_ptr, n_pairs, n_experts, BLOCK, E_PAD)
    e = tl.arange(0, E_PAD)
    # ends = inclusive cumsum of counts: the first place of (e, b) is ends[e, b] - counts[e, b].
    first = tl.load(ends_ptr + e * n_blocks + b, mask=e < n_experts, other=0)
    first -= tl.load(counts_ptr + e * n_blocks + b, mask=e < n_experts, other=0)
    before = tl.associative_scan(hot, 0, _add) - hot  # pairs of the same expert earlier in the block
    place = tl.reduce(hot * (first[None, :] + before), 1, _add)
    tl.store(order_ptr + place, offs.to(tl.int32), mask=tl.reduce(hot, 1, _add) > 0)
    if b == 0:  # offsets[E] = every pair counted (n_pairs, unless some expert id was out of range)
        total = tl.load(ends_ptr + n_experts * n_blocks - 1)
        tl.store(offsets_ptr + e, tl.where(e < n_experts, first, total), mask=e <= n_experts)


def _counting_sort(flat: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    n_pairs = flat.numel()
    if n_pairs == 0:  # no block to launch, and block 0 is what writes the offsets
        return flat.new_empty(0, dtype=torch.int32), flat.new_zeros(n_experts + 1, dtype=torch.int32)
    block = _counting_block(n_experts)
    n_blocks = _cdiv(n_pairs, block)
    e_pad = _next_power_of_2(n_experts + 1)  # E and one more, so that offsets[E] has a lane
    counts = torch.empty(n_experts * n_blocks, dtype=torch.int32, device=flat.device)
    order = torch.empty(n_pairs, dtype=torch.int32, device=flat.device)
    offsets = torch.empty(n_experts + 1, dtype=torch.int32, device=flat.device)
    _launch(_count_pairs_kernel, (n_blocks,))(
        flat, counts, n_pairs, n_experts, n_blocks, BLOCK=block, E_PAD=e_pad, **_BUILD
    )
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    _launch(_place_pairs_kernel, (n_blocks,))(
        flat, counts, ends, order, offsets, n_pairs, n_experts, n_blocks, BLOCK=block, E_PAD=e_pad, **_BUILD
    )
    return order, offsets


# ----------------------------------------------------------------------------------------------------------
# 1. Grouped matmul over expert-sorted pairs (forward and grad_x)


@triton.jit
def _tile_owner(tile, offsets_ptr, n_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Expert and pair range of the tile-th tile when every expert's pairs are cut into BLOCK_M tiles.

    Computed per program from the [E+1] offsets (a vector scan over the experts) instead of a tile table
    built on the host, which would need the counts copied to the host and a sync before every launch.
    Returns expert -1 for the spare programs of the worst-case grid.
    """
    e = tl.arange(0, E_PAD)
    lo = tl.load(offsets_ptr + e, mask=e < n_experts, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=e < n_experts, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    last = tl.associative_scan(tiles, 0, _add)
    first = last - tiles
    hit = (tile >= first) & (tile < last)  # true for at most one expert
    expert = tl.reduce(tl.where(hit, e + 1, 0), 0, _add) - 1
    start = tl.reduce(tl.where(hit, lo + (tile - first) * BLOCK_M, 0), 0, _add)
    end = tl.reduce(tl.where(hit, hi, 0), 0, _add)
    return expert, start, end


@triton.jit
def _tile_product(
    a_ptr, a_row, mask_m, w_ptr, expert, offs_n, mask_n, K_DIM: tl.constexpr,
    stride_a: tl.constexpr, stride_we: tl.constexpr, stride_wk: tl.constexpr, stride_wn: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] tile of a[a_row] @ W[expert][:, offs_n] (masked rows and columns come out zero)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k in range(0, (K_DIM + BLOCK_K - 1) // BLOCK_K):
        mask_k = offs_k < K_DIM - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.autotune(
    configs=_all(_MATMUL_CONFIGS),
    key=["K_DIM", "N_DIM", "M_BUCKET", "n_experts", "A_PER", "C_PER", "PRECISION", "STORE"],
    prune_configs_by={"early_config_prune": _pruner(_MATMUL_CONFIGS)},
    # Tuning runs every config: with ATOMIC the output accumulates, and a config with narrower BLOCK_N fills
    # more rows of the gate-gradient partials than the winner will; both are zeroed between runs.
    reset_to_zero=["c_ptr", "gate_grad_ptr"],
)
@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, c_ptr, order_ptr, offsets_ptr, gate_ptr, partner_ptr, gate_grad_ptr,
    n_experts, n_pairs, K_DIM: tl.constexpr, N_DIM: tl.constexpr, C_WIDTH: tl.constexpr, M_BUCKET, A_PER, C_PER,
    STORE_PER, stride_a: tl.constexpr, stride_we: tl.constexpr, stride_wk: tl.constexpr, stride_wn: tl.constexpr,
    stride_c: tl.constexpr, stride_partner: tl.constexpr,
    HAS_GATE: tl.constexpr, GATE_GRAD: tl.constexpr, STORE: tl.constexpr, ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert, start, end = _tile_owner(tl.program_id(0), offsets_ptr, n_experts, BLOCK_M, E_PAD)
    if expert < 0:  # the grid is sized for the worst case (every expert ends in a partial tile)
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    pair = tl.load(order_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    # pair = n*S + s, and I, R divide S, so row n*I + s // (S/I) is simply pair // (S/I).
    a_row = pair // A_PER
    c_row = pair // C_PER
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N_DIM
    acc = _tile_product(
        a_ptr, a_row, mask_m, w_ptr, expert, offs_n, mask_n, K_DIM, stride_a, stride_we, stride_wk, stride_wn,
        PRECISION, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip

    mask_c = mask_m[:, None] & mask_n[None, :]
    if GATE_GRAD:
        # Partial <x row, un-gated grad_x contribution> over this column block; summed over blocks on the host
        # side (a deterministic reduction of a [column blocks, pairs] buffer).
        partner = tl.load(partner_ptr + c_row[:, None] * stride_partner + offs_n[None, :], mask=mask_c, other=0.0)
        partial = tl.reduce(acc * partner.to(tl.float32), 1, _add)
        tl.store(gate_grad_ptr + tl.program_id(1) * n_pairs + pair, partial, mask=mask_m)
    if not STORE:  # the gate gradient was all the caller wanted
        return
    if HAS_GATE:
        acc *= tl.load(gate_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    # STORE_PER is C_PER, or 1 when the caller wants one row per pair (to add them up in a fixed order itself).
    c_ptrs = c_ptr + (pair // STORE_PER)[:, None] * stride_c + offs_n[None, :]
    mask_c = mask_m[:, None] & (offs_n < C_WIDTH)[None, :]  # c has no padded columns
    if ATOMIC:
        # Several slots add into one output row (heads of O, slots of a head); c is an fp32 buffer. Only the
        # adds must be atomic; nothing reads c before the kernel ends, so no ordering is needed. Relaxed adds
        # instead of the default acq_rel ones made this kernel 1.4-2.1x faster on an H100 (docs/BENCHMARKS.md).
        tl.atomic_add(c_ptrs, acc, mask=mask_c, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


def _grouped_matmul(
    a: Tensor,
    a_per: int,
    weight: Tensor,
    transpose_weight: bool,
    c_rows: int,
    c_per: int,
    order: Tensor,
    offsets: Tensor,
    gate: Tensor | None,
    partner: Tensor | None = None,
    store: bool = True,
    width: int | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """c[pair // c_per] += gate[pair] * a[pair // a_per] @ W[expert(pair)] (W^T if transpose_weight).

    Returns c (fp32 if rows receive several pairs, else a's dtype; None unless `store`), only its first `width`
    columns (default: all) when the weight is zero-padded, and, when `partner` is given, the per-pair dot product
    of the un-gated result with partner[pair // c_per] (fp32, [pairs]).

    Several pairs per row are added with atomics, in whatever order the tiles finish. Under
    torch.use_deterministic_algorithms(True) every pair gets a row of its own instead, and the rows are then
    summed in pair order: bitwise reproducible, at the cost of an fp32 [pairs, D] buffer.
    """
    n_experts = weight.shape[0]
    k_dim, (n_dim, stride_wk, stride_wn) = a.shape[1], _oriented(weight, transpose_weight)
    n_pairs = order.numel()
    width = n_dim if width is None else width
    per_pair = store and c_per > 1 and torch.are_deterministic_algorithms_enabled()
    atomic = store and c_per > 1 and not per_pair
    store_per = 1 if per_pair else c_per
    gate_grad = None if partner is None else _gate_grad_partials(n_dim, n_pairs, _MATMUL_CONFIGS, a.device)
    if store:
        c = (torch.zeros if atomic else torch.empty)(
            n_pairs if per_pair else c_rows, width, dtype=torch.float32 if c_per > 1 else a.dtype, device=a.device
        )
    else:  # nothing is written to c; the autotuner zeroes whatever is passed for it, so not an input
        assert gate_grad is not None, "a product that stores nothing computes the gate gradient"
        c = gate_grad

    def grid(meta: dict) -> tuple[int, int]:
        tiles = _cdiv(n_pairs, meta["BLOCK_M"]) + n_experts
        return tiles, _cdiv(n_dim, meta["BLOCK_N"])

    _launch(_grouped_matmul_kernel, grid)(
        a, weight, c, order, offsets,
        gate if gate is not None else a, partner if partner is not None else a,
        gate_grad if gate_grad is not None else c,
        n_experts, n_pairs, k_dim, n_dim, width, _bucket(n_pairs), a_per, c_per, store_per,
        a.stride(0), weight.stride(0), stride_wk, stride_wn, c.stride(0) if store else 0,
        partner.stride(0) if partner is not None else 0,
        HAS_GATE=gate is not None, GATE_GRAD=partner is not None, STORE=store, ATOMIC=atomic,
        PRECISION=_precision(a.dtype), DOT_FP32=_dot_fp32(a.dtype), E_PAD=_next_power_of_2(n_experts), **_BUILD,
    )  # fmt: skip
    if per_pair:
        c = c.view(c_rows, c_per, width).sum(1)
    return (c if store else None), (gate_grad.sum(0) if gate_grad is not None else None)


# ----------------------------------------------------------------------------------------------------------
# 2. Expert-grouped weight gradient (deterministic)


@triton.autotune(
    configs=_all(_WEIGHT_GRAD_CONFIGS),
    key=["D_IN", "D_OUT", "M_BUCKET", "n_experts", "SPLITS", "PRECISION"],
    prune_configs_by={"early_config_prune": _pruner(_WEIGHT_GRAD_CONFIGS)},
)
@triton.jit
def _weight_grad_kernel(
    x_ptr, g_ptr, gate_ptr, order_ptr, offsets_ptr, dw_ptr,
    n_experts, D_IN: tl.constexpr, D_OUT: tl.constexpr, W_IN: tl.constexpr, W_OUT: tl.constexpr, M_BUCKET, SPLITS,
    X_PER, G_PER,
    stride_x: tl.constexpr, stride_g: tl.constexpr, stride_we: tl.constexpr, stride_wk: tl.constexpr,
    stride_wn: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    # This program's chunk of the expert's pairs (whole BLOCK_P steps; chunks past the end come out empty).
    chunk = ((end - start + SPLITS - 1) // SPLITS + BLOCK_P - 1) // BLOCK_P * BLOCK_P
    start = start + split * chunk
    end = tl.minimum(end, start + chunk)
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < D_IN
    mask_n = offs_n < D_OUT

    # One program owns the whole [BLOCK_K, BLOCK_N] block of dW[expert] (of its chunk's partial sum when split)
    # and visits its pairs in sorted order, so the float summation order is fixed: bit-identical run to run.
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    # The pair ids of each step are loaded one step ahead, into a loop-carried value. Loaded in the step that
    # uses them, they made the row loads indirect, and Triton's pipeliner then kept no tile load in flight across
    # the wait at the top of the loop (`gpu_build.Build.copies_in_flight`); carried, the row loads are pipelined
    # like the grouped kernel's.
    offs_p = start + tl.arange(0, BLOCK_P)
    pair_next = tl.load(order_ptr + offs_p, mask=offs_p < end, other=0)
    for i in range(0, (end - start + BLOCK_P - 1) // BLOCK_P):
        offs_p = start + i * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < end
        pair = pair_next.to(tl.int64)
        pair_next = tl.load(order_ptr + offs_p + BLOCK_P, mask=offs_p + BLOCK_P < end, other=0)
        xt = tl.load(
            x_ptr + (pair // X_PER)[None, :] * stride_x + offs_k[:, None],
            mask=mask_k[:, None] & mask_p[None, :],
            other=0.0,
        )
        g = tl.load(
            g_ptr + (pair // G_PER)[:, None] * stride_g + offs_n[None, :],
            mask=mask_p[:, None] & mask_n[None, :],
            other=0.0,
        )
        if HAS_GATE:
            gv = tl.load(gate_ptr + pair, mask=mask_p, other=0.0).to(tl.float32)
            if PRECISION == "ieee":  # FMA units: scaling x instead spilled an fp32 tile (the sm_90 build test)
                g = (g.to(tl.float32) * gv[:, None]).to(xt.dtype)
            else:
                # On tensor cores the gate scales x, the dot's first operand, which a Hopper wgmma may read from
                # registers. Scaling g, which it reads only from shared memory, stored the scaled tile back there
                # and waited for each wgmma in turn: no overlap with the loads (`gpu_build.Build.mma_in_flight`).
                # 16-bit inputs: rounded to their dtype, where in fp16 a gate * x below 6.1e-5 loses precision.
                xt = (xt.to(tl.float32) * gv[None, :]).to(g.dtype)
        if DOT_FP32:
            xt = xt.to(tl.float32)
            g = g.to(tl.float32)
        acc = tl.dot(xt, g, acc, input_precision=PRECISION)

    # dW (or the partials, [SPLITS, E, W_IN, W_OUT]) has the weight's own widths: the padded rows and columns of
    # x and g are left out here rather than sliced off by a copy afterwards.
    slab = (split * n_experts + expert).to(tl.int64)
    dw_ptrs = dw_ptr + slab * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(offs_k < W_IN)[:, None] & (offs_n < W_OUT)[None, :])


def _weight_grad(
    x2: Tensor, x_per: int, g2: Tensor, g_per: int, gate: Tensor | None, order: Tensor, offsets: Tensor,
    weight_shape: tuple[int, int, int],
) -> Tensor:
    """dW [E, D_in, D_out] (`weight_shape`) from rows of x and g that may be zero-padded beyond D_in, D_out."""
    n_experts, w_in, w_out = weight_shape
    d_in, d_out = x2.shape[1], g2.shape[1]
    bucket = _bucket(order.numel())
    splits = _weight_grad_splits(n_experts, d_in, d_out, bucket, x2.device)
    partial_dtype = x2.dtype if splits == 1 else torch.float32
    dw = torch.empty(splits * n_experts, w_in, w_out, dtype=partial_dtype, device=x2.device)

    def grid(meta: dict) -> tuple[int, int, int]:
        return _cdiv(d_in, meta["BLOCK_K"]), _cdiv(d_out, meta["BLOCK_N"]), n_experts * splits

    _launch(_weight_grad_kernel, grid)(
        x2, g2, gate if gate is not None else x2, order, offsets, dw,
        n_experts, d_in, d_out, w_in, w_out, bucket, splits, x_per, g_per,
        x2.stride(0), g2.stride(0), dw.stride(0), dw.stride(1), dw.stride(2),
        HAS_GATE=gate is not None, PRECISION=_precision(x2.dtype), DOT_FP32=_dot_fp32(x2.dtype), **_BUILD,
    )  # fmt: skip
    if splits == 1:
        return dw
    return dw.view(splits, n_experts, w_in, w_out).sum(0).to(x2.dtype)  # a reduction without atomics


def _weight_grad_splits(n_experts: int, d_in: int, d_out: int, pair_bucket: int, device: torch.device) -> int:
    """Chunks per expert for the weight gradient: the count closest to WEIGHT_GRAD_PROGRAMS_PER_SM programs per SM
    with 64 x 64 tiles, as long as a chunk keeps WEIGHT_GRAD_MIN_PAIRS of the expert's expected pairs. Depends
    only on the shapes and the GPU (and WEIGHT_GRAD_SPLITS)."""
    if WEIGHT_GRAD_SPLITS > 0:
        return WEIGHT_GRAD_SPLITS
    programs = n_experts * _cdiv(d_in, 64) * _cdiv(d_out, 64)
    wanted = round(WEIGHT_GRAD_PROGRAMS_PER_SM * _sm_count(device) / programs)
    affordable = pair_bucket // (n_experts * WEIGHT_GRAD_MIN_PAIRS)
    return max(1, min(wanted, affordable, WEIGHT_GRAD_MAX_SPLITS))


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------------------------------------
# 3. Gather path for a handful of tokens


@triton.jit
def _gather_kernel(
    x_ptr, w_ptr, index_ptr, gate_ptr, out_ptr,
    D_IN, D_OUT: tl.constexpr, X_PER, C_PER,
    stride_x, stride_we: tl.constexpr, stride_wk: tl.constexpr, stride_wn, stride_out,
    HAS_GATE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # D_OUT and the weight's strides are compile-time constants so that Triton knows how the expert rows are
    # aligned: as plain arguments, a width that is not a multiple of 16 (the 47M model's 76 and 412) gave
    # element-by-element weight loads at 16-bit precisions that could not be staged asynchronously. A model has
    # a handful of such widths, so this is a handful of builds.
    #
    # Output row `row` = n*R + r receives the C_PER consecutive pairs row*C_PER .. row*C_PER + C_PER - 1:
    # the slot reduction is part of the loop, deterministic and without atomics. One flat loop over (pair,
    # K block) lets Triton's pipeliner keep the next steps' weight tiles (and expert ids) in flight: this kernel
    # has few programs (one per output row and column block), so it waits on memory latency, not bandwidth.
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D_OUT
    offs_k = tl.arange(0, BLOCK_K)
    k_steps = (D_IN + BLOCK_K - 1) // BLOCK_K
    # Products are added into a [BLOCK_K, BLOCK_N] tile and reduced over K once at the end: reducing every step's
    # tile made each step a cross-warp reduction (shuffles and block barriers).
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for t in tl.range(0, C_PER * k_steps, num_stages=STAGES):
        pair = row * C_PER + t // k_steps
        k0 = (t % k_steps) * BLOCK_K
        expert = tl.load(index_ptr + pair)
        mask_k = offs_k < D_IN - k0
        xv = tl.load(x_ptr + (pair // X_PER) * stride_x + k0 + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if HAS_GATE:
            xv *= tl.load(gate_ptr + pair).to(tl.float32)
        w = tl.load(
            w_ptr + expert * stride_we + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += xv[:, None] * w.to(tl.float32)
    out = tl.reduce(acc, 0, _add)
    tl.store(out_ptr + row * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def _gather(x2: Tensor, x_per: int, weight: Tensor, index: Tensor, gate: Tensor | None, rows: int, c_per: int):
    d_in, d_out = weight.shape[1], weight.shape[2]
    out = torch.empty(rows, d_out, dtype=x2.dtype, device=x2.device)
    block_k, block_n = (16, 16) if _INTERPRETED else (128, 32)
    _launch(_gather_kernel, (rows, _cdiv(d_out, block_n)))(
        x2, weight, index, gate if gate is not None else x2, out,
        d_in, d_out, x_per, c_per,
        x2.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        HAS_GATE=gate is not None, BLOCK_K=block_k, BLOCK_N=block_n, STAGES=3,
        num_warps=1 if _INTERPRETED else 4, **_BUILD,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------
# Entry points used by `ops`


def _rows(t: Tensor, width: int | None = None) -> Tensor:
    """[N, rows, D] -> [N*rows, D] with unit stride along D (the kernels assume it), zero-padded to `width`."""
    t = t.reshape(-1, t.shape[-1])
    if width is not None and width != t.shape[-1]:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    return t if t.stride(-1) == 1 else t.contiguous()


def _aligned(d: int, align: int) -> int:
    return _cdiv(d, align) * align


def _padded_weight(weight: Tensor, d_in: int, d_out: int) -> Tensor:
    if weight.shape[1:] == (d_in, d_out):
        return weight
    return torch.nn.functional.pad(weight, (0, d_out - weight.shape[2], 0, d_in - weight.shape[1]))


def _on_the_tensors_device(fn):
    """`fn` run with the CUDA device of its first argument current: Triton launches on the current device, so a model
    on cuda:1 while cuda:0 is current would have its kernels launched where its tensors are not."""

    @functools.wraps(fn)
    def run(t: Tensor, *args, **kwargs):
        if t.is_cuda and t.get_device() != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(t, *args, **kwargs)
        return fn(t, *args, **kwargs)

    return run


@_on_the_tensors_device
def forward(
    x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int, pairs: list | None = None
) -> Tensor:
    """The forward; where it sorts the pairs by expert (the tiled path), the sort is appended to `pairs` if given,
    for a backward of the same index to take (`backward(pairs=...)`)."""
    _require_runnable(x)
    n, n_in, _ = x.shape
    n_experts, _, d_out = weight.shape
    slots = index.shape[1]
    flat_gate = gate.reshape(-1).contiguous() if gate is not None else None
    if n <= GATHER_MAX_TOKENS:
        flat_index = index.reshape(-1).contiguous()
        out = _gather(_rows(x), slots // n_in, weight, flat_index, flat_gate, n * n_out, slots // n_out)
        return out.view(n, n_out, d_out)
    align = 1 if x.shape[2] >= UNPADDED_FORWARD_MIN_WIDTH else ALIGN
    d_in_p, d_out_p = _aligned(weight.shape[1], align), _aligned(d_out, align)
    x2, w = _rows(x, d_in_p), _padded_weight(weight, d_in_p, d_out_p)
    order, offsets = _sort_pairs(index, n_experts)
    if pairs is not None:
        pairs.extend((order, offsets))
    out, _ = _grouped_matmul(
        x2, slots // n_in, w, False, n * n_out, slots // n_out, order, offsets, flat_gate, width=d_out
    )  # fmt: skip
    return out.to(x.dtype).view(n, n_out, d_out)


@_on_the_tensors_device
def backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True, dense_grad_x: bool = False, dense_grad_w: bool = False, pairs: list | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients w.r.t. x, weight and gate. `dense_grad_x`: grad_x as one cuBLAS GEMM
    (`torch_paths.dense_expanded_grads`) instead of the grouped kernel, which then runs forward-oriented, storing
    nothing, for the gate gradient alone: <x @ W, grad> = <x, grad @ W^T>. `dense_grad_w`: the weight gradient as
    one cuBLAS GEMM (`torch_paths.dense_weight_grad`; for input-expanding shapes with `dense_grad_x`, of the same
    gated gradients) instead of the weight-gradient kernel. `pairs`: the forward's sort of this index, if it made
    one (`forward(pairs=...)`), so that it is not sorted again."""
    _require_runnable(x)
    n, n_in, _ = x.shape
    n_experts, d_in, d_out = weight.shape
    n_out, slots = grad.shape[1], index.shape[1]
    grad = grad.to(x.dtype)
    need_gate_grad = gate is not None and need_gate_grad
    cublas_w = dense_grad_w and need_weight_grad
    grad_x = grad_w = gate_grad = None
    if dense_grad_x:
        # the gated gradients serve the weight gradient too where they are the narrower operand
        shared = cublas_w and torch_paths.dense_expands_inputs(n_in, n_out)
        grad_x, grad_w = torch_paths.dense_expanded_grads(grad, x, weight, index, gate, True, shared)
        grad_w = grad_w if shared else None
    if cublas_w and grad_w is None:
        grad_w = torch_paths.dense_weight_grad(grad, x, weight, index, gate)
    kernel_w = need_weight_grad and not cublas_w
    if grad_x is None or need_gate_grad or kernel_w:  # work left for the kernels
        d_in_p, d_out_p = _aligned(d_in, ALIGN), _aligned(d_out, ALIGN)
        x2, g2 = _rows(x, d_in_p), _rows(grad, d_out_p)
        w = _padded_weight(weight, d_in_p, d_out_p)
        flat_gate = gate.reshape(-1).contiguous() if gate is not None else None
        order, offsets = pairs if pairs else _sort_pairs(index, n_experts)
        if grad_x is None:
            grad_x, gate_grad = _grouped_matmul(
                g2, slots // n_out, w, True, n * n_in, slots // n_in, order, offsets, flat_gate,
                x2 if need_gate_grad else None, width=d_in,
            )  # fmt: skip
            grad_x = grad_x.to(x.dtype).view(x.shape)
        elif need_gate_grad:
            _, gate_grad = _grouped_matmul(
                x2, slots // n_in, w, False, n * n_out, slots // n_out, order, offsets, None, g2, store=False
            )
        if kernel_w:
            grad_w = _weight_grad(x2, slots // n_in, g2, slots // n_out, flat_gate, order, offsets, weight.shape)
    grad_w = grad_w if grad_w is not None else weight.new_empty(0)
    if gate_grad is None:
        return grad_x, grad_w, x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    return grad_x, grad_w, gate_grad.view(n, slots).to(gate.dtype)
