"""Pure-PyTorch expert projection (``SWITCHHEAD_KERNEL=torch``; the default for non-CUDA tensors).

Four regimes, each with its own forward and backward, picked per call by `choose_regime`:

- ``gather``: one vector-matrix product per (token, slot) pair against the selected expert (on the CPU in
  fp32/fp64 all of them as one embedding_bag; the backward gathers the selected matrices). It reads only the
  weights that are used and copies none of them, which is what matters at decode time (N*S = a few pairs).
- ``dense``: run every expert as one big GEMM and gate afterwards (or scale the inputs by the gates first
  and contract over experts in one GEMM, whichever side has fewer rows). Wastes E*min(I, R)/S times the
  useful MACs but issues one large matmul instead of many small ones plus gathers; wins for small N (on the
  CPU now mostly where its waste is small, or in bf16 on CPUs that multiply bf16 natively).
- ``grouped``: sort (token, slot) pairs by expert and run one GEMM per block of an expert's pairs: no wasted
  MACs, but gathers, index_adds and small GEMMs whose cost per expert is roughly fixed. With few pairs per
  expert it runs all experts in one call of torch's grouped GEMM instead (one gather and one index_add per
  call), which makes it the regime from a few dozen tokens up. Its backward gets the gate gradient from the
  input-gradient GEMM, so it never recomputes the forward.
- ``combo``: grouped over segments instead of pairs (a segment is a head's k slots, which share an input and
  an output row), sorted by the set of experts each chose: a row is gathered once for its k products, which
  add up in the GEMMs, and index-added once. Fewer gathers and scatters, but one group per expert set
  (C(5, 3) = 10 per head for 47M), so it pays only when every set has a few hundred segments.

Rows are gathered with ``index_select``, never advanced indexing: for whole rows on the CPU ``x[idx]`` goes
through the generic indexing kernel, which is much slower.

The thresholds in `choose_regime` come from `benchmarks/kernels.py` run on 2-core CPUs, one set per kind of CPU
(`CPU_COSTS`, docs/BENCHMARKS.md); re-measure before changing them.
"""

from __future__ import annotations

import functools
import itertools
import math
import platform
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from switchhead.devices import native_half

Regime = Literal["gather", "dense", "grouped", "combo", "grouped_mm"]
Grads = tuple[Tensor, Tensor, Tensor]

# Thresholds measured on 2-core CPUs, one torch thread, with `python benchmarks/kernels.py --threads 1 --n ...
# --regimes ...` (docs/BENCHMARKS.md; the machines are shared and noisy: re-measure before trusting small
# differences). Up to this many (token, slot) pairs a plain loop of vector-matrix products wins the forward: it reads
# only the selected experts and copies nothing (batch-1 decode: N*S = 6..8 for the paper models).
GATHER_MAX_PAIRS = 8

class CpuCosts(NamedTuple):
    """What the fp32 regimes cost beside their useful multiply-adds on one kind of CPU, in multiply-adds at the rate
    of dense's one big GEMM. Dense wastes (E*min(I, R)/S - 1) times the useful MACs, while grouped pays a roughly
    fixed cost per expert (sort, launches, small GEMMs) and one per element of each pair's input and output row
    (gathers, index_adds, GEMMs narrower than dense's): dense while the waste costs less. Three passes, each with
    its constants (`cost_pass`): the forward, the backward of input-contracting shapes, and that of input-expanding
    ones, whose dense backward also recomputes the forward for the gate gradient (per_expert -inf: never dense).
    Below all that the gather runs: the forward up to `bag_max_pairs` (token, slot) pairs as one embedding_bag
    (`_bag_forward`: fp32/fp64), up to GATHER_MAX_PAIRS otherwise; the backward (a matrix-vector product and a rank-1
    update per pair, each expert read and written in place) up to `gather_backward_max_pairs`. The dense forward of
    input-expanding shapes multiplies by the experts as they lie up to `broadcast_max_rows` input rows
    (`_all_experts`). grouped and combo pad narrow GEMM rows (GEMM_ALIGN) once the experts have `gemm_pad_min_pairs`
    (token, slot) pairs each on average, and combo's forward takes over from grouped's at `combo_forward_min_per_set`
    segments per expert set."""

    per_expert: tuple[float, float, float]  # forward, contracting backward, expanding backward
    per_element: tuple[float, float, float]  # forward, contracting backward, expanding backward
    bag_max_pairs: int
    gather_backward_max_pairs: dict[str, int]  # by dense_expands_inputs: "expand" / "contract"
    broadcast_max_rows: dict[str, int]  # by D_out: "aligned" to VECTOR_FLOATS, "unaligned"
    gemm_pad_min_pairs: int
    combo_forward_min_per_set: int  # segments per expert set from which combo's forward beats grouped's


def cost_pass(backward: bool, n_in: int, n_out: int) -> int:
    """The index of this pass's constants in `CpuCosts`: 0 forward, 1 backward contracting inputs, 2 expanding."""
    return 0 if not backward else 2 if dense_expands_inputs(n_in, n_out) else 1


CPU_COSTS = {
    # AMD EPYC VMs, with AVX2 or with AVX-512 (see "intel-avx512" for why not by instruction set). per_expert and
    # per_element fitted on an AVX2 EPYC (Zen 3) VM, once grouped ran few pairs per expert through the grouped GEMM
    # (GROUPED_MM_MAX_ELEMENTS), to four `--regimes dense grouped` runs (`--n 16 24 32 48 64 96 128 192 256 384
    # 512`, the same to 1024, `--n 20 40 56 80 112 160 224 320 448 640`, `--n 3 4 6 8 12`) by
    # `benchmarks/regime_fit.py --grid`, and checked on the same four run again once the grouped GEMM's thresholds were
    # final: over those the forward takes 1.011x the better regime's time in the geometric mean (worst 1.27x, 47M V
    # at N = 192), the backward 1.020x (O-like; worst 1.41x, 47M O at N = 128) and 1.002x (V-like; worst 1.23x, 47M V
    # at N = 3), the grid's best there 1.011x, 1.019x and 1.002x; the constants fitted before the grouped GEMM
    # (1.75e6 / 1.75e6 / 1.25e6 per expert, 28 / 28 / 8 per element, which kept 47M dense to N ~ 400) take 1.066x,
    # 1.122x and 1.145x there. Now grouped's backward wins from a few tokens (dense only where its waste is tiny),
    # its forward from N ~ 48 for 47M (first run: 47M V dense 0.549 vs grouped 0.664 ms at N = 32, 0.838 vs 0.821 at
    # 48) and from fewer for 262M (262M V 1.250 vs 1.147 at N = 16). docs/BENCHMARKS.md, "grouped through torch's
    # grouped GEMM".
    # The bag: `--n 1 2 4 8 16 32 64 --regimes gather dense` twice and `--n 3 5 6 10 12` once, scored by
    # `benchmarks/regime_fit.py --bag`: up to 64 pairs it takes 1.025x the better forward's time in the geometric
    # mean (worst 1.43x, sigma-MoE down at N = 32, where the bag is still ahead), up to 16 (the Intel VM's count)
    # 1.139x (worst 2.23x, sigma-MoE up at N = 5), up to 32 or 128 1.060x and 1.038x: dense's GEMMs run slower
    # here than there while the bag's row reads do not. Scored again beside grouped with the grouped GEMM (`--n 1 2 3
    # 4 5 6 8 10 11 12 16 21 24 32 --regimes gather dense grouped` twice, and once to 16): 64 pairs 1.016x the better
    # of the bag and the rule's pick above it, 48 1.020x, 96 1.029x.
    # The backward's gather: up to 8 pairs for both kinds of shape, fitted beside grouped with the grouped GEMM: `--n
    # 1 2 3 4 6 8 --regimes gather dense grouped` twice, `regime_fit.py --gather-backward`: 1.010x the better
    # regime's time in the geometric mean (worst 1.26x, 47M O at N = 1), against 1.075x with the 16 pairs for both
    # fitted beside the dense backward before (worst 1.71x, 47M V at N = 2).
    # The broadcast: `--n 32 64 96 128 192 256 --regimes dense --against 8bbca23` (broadcast up to 256 rows at every
    # width), twice, with and without `--case` shapes of other widths: see "The dense forward's broadcast, by width" in
    # docs/BENCHMARKS.md.
    # The padded GEMM rows: 47M's 76-wide ones pay from ~460 pairs per expert here (forward 0.86-0.92x the time from
    # N = 1024, backward 0.89-1.02x; `--n 512 ... 3072 --regimes grouped combo --against f915112`, twice): see
    # "Padded GEMM rows" in docs/BENCHMARKS.md.
    # combo's forward where grouped is the alternative: `--n 512 640 768 896 1024 1152 1280 1536 --regimes grouped
    # combo` with the 47M and 262M cases, twice: combo / grouped forward 47M V 1.08-1.10 and O 1.12-1.16 at N = 1024
    # (102 segments per set), V 1.00-1.02 and O 1.05-1.07 at 1152-1280, V 0.97-0.99 and O 1.01 at 1536; 262M V
    # 0.98 and O 1.01 at 640 (107), 0.97 and 1.00-1.01 at 768, O 0.97-0.98 from 1024.
    "default": CpuCosts(
        per_expert=(8.8e4, 1e5, 5e4), per_element=(36.0, 0.0, 0.0), bag_max_pairs=64,
        gather_backward_max_pairs={"expand": 8, "contract": 8}, broadcast_max_rows={"aligned": 256, "unaligned": 64},
        gemm_pad_min_pairs=512, combo_forward_min_per_set=128,
    ),
    # Intel Xeon VMs (Cascade Lake, AVX-512), where MKL's fp32 GEMMs run up to 2.3x faster than on the EPYC VMs,
    # the one with AVX-512 included (the 47M O baseline `[4096, 456] @ [456, 412]`: 14.4 ms here, 32.8 ms there),
    # while the gathers take longer. `--n 16 32 ... 2048` and `--n 24 48 ... 3072 --regimes dense grouped`: round
    # constants among those that lose least over both runs and an earlier one (`benchmarks/regime_fit.py --grid`;
    # geometric mean 1.003-1.009x the better regime's time forward, 1.002-1.003x backward; the most in one cell
    # 1.25x, 262M O forward at N = 64: the model gives 262M V and O one crossover, measured at 64-96 and ~30).
    # Crossovers: 47M beyond N = 2000, where combo takes over (the backward at 2226; 47M O at N = 1024: dense 6.56 vs
    # 8.52 ms forward, 15.49 vs 15.29 ms backward); 262M and sigma-MoE forward at N ~ 70 (262M V 2.76 vs 3.54 ms at
    # N = 64, 6.38 vs 4.96 at 128), their O-like backward at N ~ 270 and 165 (262M O 10.87 vs 13.81 ms at N = 128;
    # sigma-MoE down 5.09 vs 6.12 at 128, 9.59 vs 7.30 at 256).
    # The bag: `python benchmarks/kernels.py --threads 1 --n 1 2 4 8 16 32 --regimes gather dense`, three runs
    # scored by `python benchmarks/regime_fit.py --bag` (docs/BENCHMARKS.md, "The embedding_bag's threshold in
    # shuffled order"): the crossover lies between 6 pairs (47M O) and 32 (sigma-MoE up); up to 16 pairs the bag
    # loses 1.008x the better regime's time in the geometric mean (worst 1.25x, 47M O at N = 2), up to 64 1.199x
    # (worst 3.14x, 262M O at N = 8).
    # The backward's gather: `python benchmarks/kernels.py --threads 1 --n 1 2 3 4 6 8 --regimes gather dense
    # grouped`, two runs, and one with `--dtype bfloat16 --n 1 2 3 4 6`, scored by `python benchmarks/regime_fit.py
    # --gather-backward` (docs/BENCHMARKS.md, "The backward's gather"): up to (32, 4) pairs the picked backward takes
    # 1.003x the better one's time in fp32 (worst 1.07x, 262M O at N = 1) and 1.014x in bf16 (worst 1.24x), against
    # 1.079x and 1.203x with 8 pairs for every shape (worst 1.65x, 47M V at N = 2, and 2.14x).
    # The backward of input-expanding shapes stays grouped: at 92d429a (before that dense backward multiplied the
    # experts in place at a few rows: DENSE_SPLIT_MAX_ROWS) `--n 6 8 12 16 24 32 48 64` and `--n 128 256 512 1024
    # 2048` gave 47M V dense 0.56-0.97x grouped's time from N = 6 to 128 and 1.00-1.06x from 256 to 2048, but 262M V
    # grouped from N ~ 8 (dense 1.13-1.58x its time at N = 24-64) and sigma-MoE up about even up to N ~ 32
    # (0.94-1.08x); not measured since.
    # The broadcast: `--n 96 128 192 256 384 --regimes dense --against REV` with REV broadcasting at every size, two
    # runs: the copy took 1.04-1.22x the broadcast's forward time for 47M V (76 wide) at N = 96, 1.13-1.42x for 262M V
    # and 1.22-1.68x for sigma-MoE up up to 256 rows; from 512 rows it is 47M V's better (0.90-0.94x).
    # The padded GEMM rows from 2048 pairs per expert: padding every width at every count took 1.01-1.39x the time
    # for the 47M and sigma-MoE backwards (`--n 256 1024 4096 --regimes grouped combo --against REV`, two runs).
    "intel-avx512": CpuCosts(
        per_expert=(2.5e6, 5e6, -math.inf), per_element=(40.0, 68.0, 0.0), bag_max_pairs=16,
        gather_backward_max_pairs={"expand": 32, "contract": 4}, broadcast_max_rows={"aligned": 256, "unaligned": 256},
        gemm_pad_min_pairs=2048, combo_forward_min_per_set=100,
    ),
}


def cpu_kind(vendor: str, capability: str) -> str:
    """The `CPU_COSTS` entry for a CPU of this vendor (its CPUID string) on which PyTorch uses these instructions
    (`torch.backends.cpu.get_cpu_capability()`); kinds not measured get the default."""
    return "intel-avx512" if vendor == "GenuineIntel" and capability == "AVX512" else "default"


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:  # not Linux: Windows names the vendor here, macOS does not (it gets the default)
        return "GenuineIntel" if "GenuineIntel" in platform.processor() else ""


@functools.cache
def this_cpu() -> str:
    """The kind of CPU this is: a `CPU_COSTS` key."""
    return cpu_kind(_cpu_vendor(), torch.backends.cpu.get_cpu_capability())


# The forward (fp32) runs combo ahead of every other regime when each expert set is expected to have at least this many
# segments: tokens / C(experts per head, k). `python benchmarks/kernels.py --threads 1 --n 512 2048 4096 8192 --regimes
# grouped combo`, grouped vs combo forward / backward ms, on an AMD EPYC VM: 47M O (10 sets) 22.6 / 45.3 vs 20.1 / 42.5
# at N = 4096 (410 per set), 11.1 / 22.6 vs 10.5 / 22.0 at N = 2048 (205 per set), 2.8 / 5.9 vs 3.4 / 7.0 at N = 512;
# 262M O (6 sets) 47.7 / 94.9 vs 46.4 / 94.1 at N = 2048 (341 per set), 12.5 / 25.4 vs 12.5 / 24.9 at N = 512. On an
# Intel Xeon VM (`--n 32 64 128 256 512 1024 2048 4096 --regimes dense grouped combo`, two runs) combo pays earlier and
# by more: 47M V 15.5-16.4 / 42.8-46.9 vs 14.1-14.2 / 38.5-39.1 and 47M O 17.1-17.4 / 30.1-30.6 vs 13.9 / 31.1-31.7
# at N = 2048; 262M V 28.1-28.6 / 80.5-84.1 vs 25.6-25.7 / 68.5-71.6 at N = 1024 (171 per set).
COMBO_MIN_SEGMENTS_PER_SET = 200
# combo's forward pays from fewer segments than its backward where grouped is the alternative (not dense):
# `CpuCosts.combo_forward_min_per_set`, on the Intel kind 100 from this run: `python
# benchmarks/kernels.py --threads 1 --n 512 768 1024 1280 1536 1792 2048 --regimes grouped combo` on an Intel Xeon VM
# (calls in shuffled order), combo / grouped forward: 262M V 0.95 at N = 512 (85 per set), 0.86-0.91 from 768; 262M O
# 0.99 at 512, 0.89-0.95 from 768; 47M V and O 1.05 and 1.00 at N = 1024 (102 per set), 0.85-0.96 from 1280, where
# the backward still wants more (47M O: 1.06-1.85 up to N = 2048).
# combo's backward (fp32) pays once a set's segments fill this share of one of grouped's blocks (`block_rows`): its
# GEMMs (two per expert of the set) are that much thinner than grouped's, the price of gathering and adding each head's
# rows once. `python benchmarks/kernels.py --threads 1 --n 384 512 ... 3072 --regimes grouped combo --case ...` on an
# Intel Xeon VM, the model shapes and the same sizes with k = 3 of 4 and k = 2 of 5 experts per head, combo / grouped
# backward crosses 1 between 0.32 and 0.36 of a block for all six: 262M (256-row blocks) 0.94-1.13 at 85 segments per
# set (O-like 1.11-1.13), 0.92-0.97 at 96, 0.83-0.95 at 96-192 with k = 3; 47M (636-row blocks) 0.97-1.05 at 179 per
# set, 0.96-1.01 at 205, 0.93 at 230 and 0.88-0.94 at 256. The backward used to share the forward's 200 segments per
# set: too many for 262M's wider rows (was grouped to N = 1,200, now combo from 538).
COMBO_BACKWARD_BLOCK_SHARE = 0.35
# The dense forward of input-expanding shapes multiplies by the [E, D_in, D_out] weight as a broadcast batched matmul
# up to `CpuCosts.broadcast_max_rows` input rows; above it, copying the weight once into a [D_in, E*D_out] matrix
# for one big GEMM pays off. The broadcast writes its products [E, rows, D_out] and copies them into row order, the
# copy moves the weight: alike at rows ~ D_in, earlier where the E narrow GEMMs run slower than the one wide GEMM,
# which on AVX2 is where D_out is not a multiple of VECTOR_FLOATS (a partial vector at the end of every row).
VECTOR_FLOATS = 8


def broadcast_max_rows(d_out: int, costs: CpuCosts | None = None) -> int:
    """Up to how many input rows `_all_experts` multiplies by the experts as they lie on this kind of CPU."""
    costs = costs or CPU_COSTS[this_cpu()]
    return costs.broadcast_max_rows["unaligned" if d_out % VECTOR_FLOATS else "aligned"]


# Up to this many input rows the dense backward of input-expanding shapes takes grad_x and the weight gradient as
# one small product per expert against the weight where it lies (grad_x summed over the experts, the weight gradient
# written in its own layout); above it, as one GEMM each against the experts side by side, which first copies the
# weight into that layout and then the gradient back out of it: at a few rows the two weight-sized copies cost more
# than the products, and their time swung up to 2x between runs (docs/BENCHMARKS.md). CPU only. `python
# benchmarks/kernels.py --threads 1 --n 1 2 4 8 16 32 48 64 96 --regimes dense --against 58594bd` (copies at every
# size), twice on an AMD EPYC VM: the dense backward in 0.31-0.40x the time for 262M V at N = 1, 0.65-0.85x from
# 2 to 16, 0.92-0.95x at 32; sigma-MoE up 0.41-0.84x from 1 to 32; 47M V 0.32-0.97x; even (0.97-1.03x) from 48 rows,
# where the copies have caught up. fp32/fp64 only: at half precision each expert's partial sum would be rounded.
DENSE_SPLIT_MAX_ROWS = 48
# grouped and combo work on blocks of segments with the same experts, of at most this many elements in their widest
# operand (see `_plan`): 256 rows for 262M, 1024 for d_model 256. Swept by
# `python benchmarks/kernels.py --threads 1 --n 256 4096 --block-elements 65536 262144 1048576 0`: at N = 4096
# the fastest or within 3 % of it in every case, while each other size was ~20 % behind somewhere.
GROUPED_BLOCK_ELEMENTS = 256 * 1024
# The GEMMs of grouped and combo write rows narrower than GEMM_PAD_MAX_WIDTH padded to a multiple of GEMM_ALIGN
# elements (zero-padded weight and gradient, sliced at the end) where that adds at most 1/16 to the width and the
# experts have enough pairs to repay copying the weight (`CpuCosts.gemm_pad_min_pairs`). `python
# benchmarks/kernels.py --threads 1 --n 256 1024 4096 --gemm-widths` (an AVX2 CPU, MKL): one expert's GEMMs took
# 0.83-1.00x the time with 76-wide results padded to 80 and 0.82-1.00x with 412 padded to 416. In the whole regimes
# (docs/BENCHMARKS.md, "Padded GEMM rows") the gain is at most that: 47M at N = 4096 (2457 pairs per expert) took
# 0.85-0.98x; below, the weight copy and the final slice take back part of it (how much differs by kind of CPU).
GEMM_ALIGN = 16
GEMM_PAD_MAX_WIDTH = 256
# grouped and combo write each block's temporaries into views of buffers shared by all blocks of a call where the
# widest is at least this many elements (128 KiB in fp32, glibc's default mmap threshold), and allocate them fresh
# below. `python benchmarks/kernels.py --threads 1 --n 64 256 1024 4096 --regimes grouped combo --against ff84840`
# (an Intel Xeon VM, two runs): backward 0.86-0.87x the time for 47M V grouped at N = 1024, 0.93-0.95x for sigma-MoE
# up and 0.94x for 262M V combo at N = 4096, 0.93-1.05x elsewhere; forward 0.93-1.06x. With the buffers at any size
# (BUFFER_MIN_ELEMENTS = 0), blocks of a few dozen rows (N = 16-64) took up to 1.14x the time they take with this.
BUFFER_MIN_ELEMENTS = 32 * 1024

# bf16 inputs on a CPU that multiplies bf16 natively (AVX512-BF16 or AMX): one big bf16 GEMM runs at about twice
# the fp32 rate, while grouped and combo keep their gathers, fp32 conversions and index_adds around thinner GEMMs,
# so dense stays ahead up to 7-20x more tokens than in fp32, and in the forward of O-like shapes (inputs
# contracted, I > R) at every N measured. `python benchmarks/kernels.py --threads 1 --n 128 256 512 1024 2048 4096
# 8192 --regimes dense grouped combo --dtype bfloat16`, dense vs the better of grouped and combo, ms:
#   forward: 47M V 4.09 vs 5.13 at N = 2048, 12.38 vs 9.19 at 4096; 262M V 3.02 vs 3.25 at 256, 10.81 vs 8.83 at
#   1024; sigma-MoE up 1.30 vs 1.86 at 128, 2.58 vs 1.96 at 512; 47M O 15.12 vs 22.83 at 8192; 262M O 38.87 vs
#   39.82 at 4096;
#   backward: 47M V 6.11 vs 6.42 at 1024, 17.13 vs 12.45 at 2048; 47M O 3.48 vs 4.30 at 512, 10.81 vs 9.51 at
#   2048; 262M V 5.12 vs 5.60 at 128, 8.92 vs 7.67 at 256; sigma-MoE down 1.73 vs 3.09 at 128, 5.99 vs 4.63 at 512.
# Model: dense iff (waste - 1 - extra) * useful MACs <= E * overhead, where `extra` is the share of the useful work
# that the blocked regimes spend beyond dense's GEMM rate (forward only; at or above waste - 1, dense always wins).
BF16_FORWARD_EXTRA = {"expand": 0.4, "contract": 1.0}  # by dense_expands_inputs: V-like / O-like
BF16_OVERHEAD_MACS_PER_EXPERT = {"forward": 14e6, "backward": 12e6}
# In bf16 combo pays later than in fp32: 47M V / O backward 13.51 / 9.82 (grouped) vs 15.90 / 12.51 ms (combo) at
# N = 2048, 30.40 / 17.72 vs 25.31 / 18.15 at 4096 (the command above).
BF16_COMBO_MIN_SEGMENTS_PER_SET = 256


def choose_regime(
    n: int,
    n_in: int,
    slots: int,
    n_out: int,
    n_experts: int,
    d_in: int,
    d_out: int,
    backward: bool = False,
    dtype: torch.dtype = torch.float32,
    bag: bool = False,
    costs: CpuCosts | None = None,
) -> Regime:
    """The regime for these shapes; `bag`: the forward's gather would run as one embedding_bag; `costs`: those of
    this kind of CPU (`this_cpu()`) unless given."""
    costs = costs or CPU_COSTS[this_cpu()]
    shape_kind = "expand" if dense_expands_inputs(n_in, n_out) else "contract"
    if backward:
        gather_max = costs.gather_backward_max_pairs[shape_kind]
    else:
        gather_max = costs.bag_max_pairs if bag else GATHER_MAX_PAIRS
    if n * slots <= gather_max:
        return "gather"
    waste = n_experts * min(n_in, n_out) / slots
    useful_macs = n * slots * d_in * d_out
    native_bf16 = dtype == torch.bfloat16 and native_half(torch.bfloat16)
    if native_bf16:
        min_per_set = BF16_COMBO_MIN_SEGMENTS_PER_SET
    elif backward:
        min_per_set = COMBO_BACKWARD_BLOCK_SHARE * block_rows(d_in, d_out)
    else:
        min_per_set = COMBO_MIN_SEGMENTS_PER_SET
    per_set = _segments_per_set(n, n_in, slots, n_out, n_experts)
    blocked = "combo" if per_set >= min_per_set else "grouped"
    if native_bf16:
        # dense is weighed first here: O-like forwards stay dense even where combo would pay
        extra = 0.0 if backward else BF16_FORWARD_EXTRA[shape_kind]
        overhead = BF16_OVERHEAD_MACS_PER_EXPERT["backward" if backward else "forward"]
        return "dense" if (waste - 1 - extra) * useful_macs <= n_experts * overhead else blocked
    if blocked == "combo":
        return "combo"
    p = cost_pass(backward, n_in, n_out)
    moved = costs.per_element[p] * n * slots * (d_in + d_out)
    if (waste - 1) * useful_macs - moved <= n_experts * costs.per_expert[p]:
        return "dense"
    return "combo" if not backward and per_set >= costs.combo_forward_min_per_set else "grouped"


# On CUDA the Triton kernels run every call, except the forward of shapes that contract their inputs (I > R, the
# O projections) in fp16/bf16 where cuBLAS running dense_forward is faster (and the backward of the transposed
# shapes, see cuda_prefers_dense_backward): the kernels' forward there is bound by
# its fp32 atomic adds (S*D_out per token), dense's by one GEMM of R*E*D_in*D_out MACs per token plus the gated
# inputs it builds first (a per-token cost of about CUDA_DENSE_OVERHEAD_MACS). `python benchmarks/kernels.py --n
# 4096 16384 --regimes dense --device cuda --dtype bfloat16` with and without `--case` shapes (docs/BENCHMARKS.md),
# on an H200, GPU time of the kernels vs dense at N = 16384: 262M O 0.373 vs 0.195 ms (0.65x at 4096); the same
# with 2 / 3 / 6 / 8 experts per head 0.43x / 0.48x / 0.79x / 0.85x; but 47M O 0.140 vs 0.165, 47M O with 4 / 8
# experts 1.12x / 1.36x, sigma-MoE down with 8 experts 1.9x (and with 16, 2.5x). fp16 the same; in fp32 dense's
# forward is slower (262M O 1.09x). Every V-like shape stays with the kernels (dense 1.8-8x slower). Fewer tokens
# (`--n 256 1024 4096 16384`, the model's shapes): 262M O dense 0.91x the kernels at N = 1024, 1.41x at 256.
CUDA_ATOMIC_MACS = 750  # one atomic fp32 add of the kernels' forward costs about as much as this many dense MACs
CUDA_DENSE_OVERHEAD_MACS = 2.4e6  # per token: the coefficients, gated inputs and launches of dense_forward
CUDA_DENSE_MIN_TOKENS = 1024


def cuda_prefers_dense(
    n: int, n_in: int, slots: int, n_out: int, n_experts: int, d_in: int, d_out: int, dtype: torch.dtype
) -> bool:
    """Whether the forward of this shape on CUDA runs faster as dense_forward (cuBLAS) than as the Triton kernels."""
    if dtype not in (torch.float16, torch.bfloat16) or dense_expands_inputs(n_in, n_out) or n < CUDA_DENSE_MIN_TOKENS:
        return False
    dense_macs = n_out * n_experts * d_in * d_out + CUDA_DENSE_OVERHEAD_MACS
    return dense_macs < slots * d_out * CUDA_ATOMIC_MACS


# `python benchmarks/kernels.py --n 1024 4096 16384 --regimes dense --device cuda --dtype bfloat16`, two runs on
# H200s, GPU time of the backward with grad_x and the weight gradient by cuBLAS vs the kernels: 262M V 0.61-0.79x
# from 4096 tokens but 1.07x at 1024; 47M V (its transpose not dense either) 0.88-0.97x at 16384, 1.03-1.22x at
# 4096; every other model shape 1.8-12x (docs/BENCHMARKS.md).
CUDA_DENSE_BACKWARD_MIN_TOKENS = 4096


def cuda_prefers_dense_backward(
    n: int, n_in: int, slots: int, n_out: int, n_experts: int, d_in: int, d_out: int, dtype: torch.dtype
) -> bool:
    """Whether the backward of this shape on CUDA runs faster with grad_x and the weight gradient by cuBLAS
    (`dense_expanded_grads`) than by the Triton kernels. grad_x of a shape expanding I < R rows is the forward of
    the transposed shape (R rows in, I out, D_out -> D_in): the same atomic adds in the kernels, the same GEMM in
    cuBLAS, so the forward's rule decides, from CUDA_DENSE_BACKWARD_MIN_TOKENS tokens (the gate gradient then costs
    the kernels a pass of their own)."""
    if n < CUDA_DENSE_BACKWARD_MIN_TOKENS:
        return False
    return cuda_prefers_dense(n, n_out, slots, n_in, n_experts, d_out, d_in, dtype)


def block_rows(d_in: int, d_out: int) -> int:
    """Segments in one of grouped's (or combo's) blocks at most."""
    return max(1, GROUPED_BLOCK_ELEMENTS // max(d_in, d_out))


def _segments_per_set(n: int, n_in: int, slots: int, n_out: int, n_experts: int) -> float:
    """How many segments each expert set a head can choose is expected to hold (0 for one-slot segments, which
    combo cannot group)."""
    seg = segment_length(slots, n_in, n_out)
    sets = math.comb(max(seg, round(n_experts * seg / slots)), seg)
    return n / sets if seg > 1 else 0.0


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


def _bags(x: Tensor, weight: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64)


def gather_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    if _bags(x, weight):
        return _bag_forward(x, weight, index, gate, n_out)
    n, slots = index.shape
    if n == 0:  # torch.stack takes no empty list
        return x.new_zeros(0, n_out, weight.shape[2])
    in_per = slots // x.shape[1]
    experts = index.tolist()  # a handful of pairs: one vector-matrix product each, no weight copies
    # (weight may be narrower than x: see `_plan_call`)
    y = torch.stack([x[t, s // in_per] @ weight[experts[t][s]].to(x.dtype) for t in range(n) for s in range(slots)])
    return _reduce_slots(_gated(y.view(n, slots, -1).to(_acc_dtype(x)), gate), n_out).to(x.dtype)


def _bag_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """The same products as one embedding_bag: x @ W[e] is the sum of W[e]'s rows weighted by x, so each output
    row is the bag of its slots' expert rows, weighted by gate * x. One call instead of a product per pair, and
    still only the experts used are read (docs/BENCHMARKS.md: 0.58-0.83x the loop's time at N = 1)."""
    n, slots = index.shape
    n_in, d_in, d_out = x.shape[1], *weight.shape[1:]
    # At a few pairs the call is a few dozen microseconds, most of it the small ops that build the bag's arguments,
    # so they are as few as possible: the weight of every expert row, [N, I, S/I, D_in], in one broadcast multiply,
    # the row ids in one add, the bag offsets cached; and the embedding_bag op without its functional wrapper.
    x_per_slot = x.unsqueeze(2).expand(n, n_in, slots // n_in, d_in)
    rows = x_per_slot if gate is None else x_per_slot * gate.reshape(n, n_in, slots // n_in, 1).to(x.dtype)
    ids = torch.add(_steps(d_in, 1, x.device), index.unsqueeze(-1), alpha=d_in).view(-1)  # e * D_in + [0, D_in)
    bags = _steps(n * slots * d_in, slots // n_out * d_in, x.device)  # one per output row
    table = weight.reshape(-1, d_out)
    out = torch.embedding_bag(table, ids, bags, mode=0, per_sample_weights=rows.reshape(-1))[0]  # mode 0: "sum"
    return out.view(n, n_out, d_out)


@functools.lru_cache(maxsize=256)
def _steps(stop: int, step: int, device: torch.device) -> Tensor:
    """torch.arange(0, stop, step): the same few per model and batch size. Made as a normal tensor even inside
    inference mode, so that a later call that records autograd may use it too."""
    with torch.inference_mode(False):
        return torch.arange(0, stop, step, device=device)


def gather_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> Grads:
    n, slots = index.shape
    acc = _acc_dtype(x)
    d_in, d_out = weight.shape[1:]  # named, not -1: with no tokens a -1 would be ambiguous
    experts = index.reshape(-1).tolist()
    xs = _per_slot(x, slots).reshape(n * slots, d_in)
    gs = _per_slot(grad, slots).reshape(n * slots, d_out).to(x.dtype)
    # One matrix-vector product per pair, each expert's matrix read where it lies (no copy of the P matrices).
    # Un-gated: <x, u> is the gate gradient.
    u = torch.stack([weight[e].to(x.dtype) @ gs[p] for p, e in enumerate(experts)]) if experts else xs[:0]
    u = u.to(acc)
    grad_gate = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    g = gate.reshape(-1, 1).to(acc) if gate is not None else None
    if g is not None:
        if need_gate_grad:
            grad_gate = (u * xs.to(acc)).sum(-1).view(n, slots).to(gate.dtype)
        u = u * g
    grad_x = _reduce_slots(u.view(n, slots, d_in), x.shape[1]).to(x.dtype)
    if not need_weight_grad:
        return grad_x, weight.new_empty(0), grad_gate
    gs = gs.to(acc) * g if g is not None else gs.to(acc)  # the weight gradient's side of the gate
    # One rank-1 update per pair into the zeroed gradient: no [P, D_in, D_out] outer products to add in afterwards.
    grad_w = weight.new_zeros(weight.shape, dtype=acc)
    for p, e in enumerate(experts):
        grad_w[e].addr_(xs[p].to(acc), gs[p])
    grad_w = grad_w.to(weight.dtype)
    return grad_x, grad_w, grad_gate


# ----------------------------------------------------------------------------------------------------------
# dense: every expert in one GEMM


def dense_expands_inputs(n_in: int, n_out: int) -> bool:
    """Run all experts on the inputs (cost ~ I*E) rather than contract gated inputs (cost ~ R*E)?"""
    return n_in <= n_out


def _gate_matrix(gate: Tensor | None, pos: Tensor, cells: int, dtype, reproducible: bool = False) -> Tensor:
    """[N, cells]: each slot's gate (1 without gates) added at its position in `pos` ([N, S]). `reproducible`: the
    same bits every run on CUDA too (for the gradients; see below)."""
    val = gate.to(dtype) if gate is not None else torch.ones(pos.shape, dtype=dtype, device=pos.device)
    out = torch.zeros(pos.shape[0], cells, dtype=dtype, device=pos.device)
    if not (pos.is_cuda and reproducible):
        return out.scatter_add_(1, pos, val)
    # CUDA's scatter_add_ adds the slots that meet in one cell atomically, in no fixed order: three or more then
    # round differently from run to run, and so would the weight gradients built from them. Each cell's sum is
    # taken first, and written by every slot that meets there (the same value, whichever write lands). The forward
    # keeps the one scatter_add_, as reproducible as the kernels' forward (while at most two slots meet; top-k
    # routing never puts two in one cell, a head's experts being distinct) and 9-18 us cheaper for the 262M O dense
    # forward on an H200 than the three extra launches.
    return out.scatter_(1, pos, cell_sums(pos, val))


def cell_sums(pos: Tensor, val: Tensor) -> Tensor:
    """[N, S]: for each slot, the sum of `val` over the slots of its row at the same position (its own included),
    reduced in a fixed order."""
    same = pos.unsqueeze(2) == pos.unsqueeze(1)  # [N, S, S]
    return torch.where(same, val.unsqueeze(1), 0).sum(2)


def _coefficients(
    index: Tensor, gate: Tensor | None, n_in: int, n_out: int, n_experts: int, dtype, reproducible: bool = False
) -> Tensor:
    """C[n, r * E + e, i] = sum of the gates of the slots that read row i through expert e into output row r."""
    pos = _expert_rows(index, n_out, n_experts) * n_in + _slot_rows(index.shape[1], n_in, index.device)
    c = _gate_matrix(gate, pos, n_out * n_experts * n_in, dtype, reproducible)
    return c.view(index.shape[0], n_out * n_experts, n_in)


def _expert_rows(index: Tensor, rows: int, n_experts: int) -> Tensor:
    """[N, S]: row * E + expert for each slot, its row among `rows` (input rows: the row of a token's `_all_experts`
    it reads; output rows: the row of dense_backward's grad_z it takes)."""
    return _slot_rows(index.shape[1], rows, index.device) * n_experts + index


def _all_experts(x: Tensor, weight: Tensor) -> Tensor:
    """[N, I*E, D_out]: every expert applied to every input row, row i * E + e of a token for row i and expert e."""
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    if n * n_in <= broadcast_max_rows(d_out):
        # detached: for inputs that require grad, matmul takes a 2-3x slower broadcast route (262M V, N = 16)
        y_all = torch.matmul(x.reshape(1, n * n_in, d_in).detach(), weight.detach())  # [E, N*I, D_out]
        return y_all.view(n_experts, n, n_in, d_out).permute(1, 2, 0, 3).reshape(n, n_in * n_experts, d_out)
    return (x.reshape(n * n_in, d_in) @ _experts_side_by_side(weight)).view(n, n_in * n_experts, d_out)


def _output_gates(
    index: Tensor, gate: Tensor | None, n_in: int, n_out: int, n_experts: int, dtype, reproducible: bool = False
) -> Tensor:
    """[N, R, I*E]: the gates that carry each row of `_all_experts` into each output row (summed where slots meet)."""
    n, slots = index.shape
    pos = _slot_rows(slots, n_out, index.device) * (n_in * n_experts) + _expert_rows(index, n_in, n_experts)
    return _gate_matrix(gate, pos, n_out * n_in * n_experts, dtype, reproducible).view(n, n_out, n_in * n_experts)


def dense_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    if dense_expands_inputs(n_in, n_out):
        # The slots' rows picked, gated and summed per output row as one small bmm per token with the gates spread
        # over [R, I*E]: one pass over the products instead of a copy of S rows, a multiply and a sum.
        acc = _acc_dtype(x)
        c = _output_gates(index, gate, n_in, n_out, n_experts, acc)
        return torch.bmm(c, _all_experts(x, weight).to(acc)).to(x.dtype)
    c = _coefficients(index, gate, n_in, n_out, n_experts, x.dtype)
    z = torch.bmm(c, x) if n_in > 1 else c * x  # [N, R*E, D_in]: gated inputs per (output row, expert)
    out = z.view(n * n_out, n_experts * d_in) @ weight.reshape(n_experts * d_in, d_out)
    return out.view(n, n_out, d_out)


def _experts_side_by_side(weight: Tensor) -> Tensor:
    """[D_in, E*D_out]: the expert matrices next to each other (columns e*D_out.. of expert e)."""
    n_experts, d_in, d_out = weight.shape
    return weight.permute(1, 0, 2).reshape(d_in, n_experts * d_out)


def dense_expanded_grads(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_grad_x: bool,
    need_weight_grad: bool, dtype=None,
) -> tuple[Tensor, Tensor]:
    """grad_x and the weight gradient (each empty unless asked for) as dense_backward computes them for
    input-expanding shapes (any shape is right): grad_y [N*I, E*D_out], for each input row and expert the gated sum
    of the output gradients its slots send back through that expert (zero where no slot chose it), summed in
    `dtype` and rounded to x's dtype; then grad_x = grad_y @ (the experts side by side)^T and grad_w = x^T @ grad_y,
    one GEMM each, every row written once (no atomics); on the CPU at up to DENSE_SPLIT_MAX_ROWS rows, one product
    per expert against the weight as it lies instead. `dtype` defaults to x's: at half precision the gates are
    then rounded as dense_forward's coefficients are, and no fp32 copies of the sums are made (they have at most R
    terms)."""
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    dtype = dtype or x.dtype
    c = _output_gates(index, gate, n_in, grad.shape[1], n_experts, dtype, reproducible=True)
    grad_y = torch.bmm(c.transpose(1, 2), grad.to(dtype)).view(n * n_in, n_experts * d_out).to(x.dtype)
    x_t = x.reshape(n * n_in, d_in).t()
    if n * n_in <= DENSE_SPLIT_MAX_ROWS and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        gy = grad_y.view(n * n_in, n_experts, d_out).transpose(0, 1)  # [E, N*I, D_out]
        grad_x = torch.bmm(gy, weight.transpose(1, 2)).sum(0).view_as(x) if need_grad_x else x.new_empty(0)
        if not need_weight_grad:
            return grad_x, weight.new_empty(0)
        return grad_x, torch.bmm(x_t.unsqueeze(0).expand(n_experts, d_in, n * n_in), gy)
    grad_x = (grad_y @ _experts_side_by_side(weight).t()).view_as(x) if need_grad_x else x.new_empty(0)
    if not need_weight_grad:
        return grad_x, weight.new_empty(0)
    return grad_x, (x_t @ grad_y).view(d_in, n_experts, d_out).permute(1, 0, 2).contiguous()


def _contracted_weight_grad(c: Tensor, x: Tensor, g2: Tensor, weight: Tensor) -> Tensor:
    """The weight gradient from the gated inputs z [N*R, E*D_in] (`_coefficients` times x): z^T @ grad, one GEMM."""
    _, n_in, d_in = x.shape
    z = torch.bmm(c, x) if n_in > 1 else c * x
    return (z.view(-1, weight.shape[0] * d_in).t() @ g2).view_as(weight)


def dense_weight_grad(grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None) -> Tensor:
    """The weight gradient alone as dense_backward computes it: one GEMM against the gated output gradients
    (input-expanding shapes) or of the gated inputs (input-contracting ones), whichever has fewer rows per token;
    gates rounded to x's dtype."""
    n_in, n_out = x.shape[1], grad.shape[1]
    if dense_expands_inputs(n_in, n_out):
        return dense_expanded_grads(grad, x, weight, index, gate, False, True)[1]
    c = _coefficients(index, gate, n_in, n_out, weight.shape[0], x.dtype, reproducible=True)
    return _contracted_weight_grad(c, x, grad.reshape(-1, weight.shape[2]).to(x.dtype), weight)


def dense_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> Grads:
    n, n_in, d_in = x.shape
    n_experts, _, d_out = weight.shape
    n_out = grad.shape[1]
    slots = index.shape[1]
    acc = _acc_dtype(x)
    no_gate_grad = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    if dense_expands_inputs(n_in, n_out):
        g = grad.to(acc)
        grad_gate = no_gate_grad
        if gate is not None and need_gate_grad:
            # every row of `_all_experts` dotted with every output row's gradient, then the slots' dots picked
            dots = torch.bmm(_all_experts(x, weight).to(acc), g.transpose(1, 2))  # [N, I*E, R]
            pick = _expert_rows(index, n_in, n_experts) * n_out + _slot_rows(slots, n_out, x.device)
            grad_gate = dots.view(n, n_in * n_experts * n_out).gather(1, pick).to(gate.dtype)
        grad_x, grad_w = dense_expanded_grads(g, x, weight, index, gate, True, need_weight_grad, acc)
        return grad_x, grad_w, grad_gate
    c = _coefficients(index, gate, n_in, n_out, n_experts, x.dtype, reproducible=True)
    g2 = grad.reshape(n * n_out, d_out).to(x.dtype)
    w_flat = weight.reshape(n_experts * d_in, d_out)
    grad_w = _contracted_weight_grad(c, x, g2, weight) if need_weight_grad else weight.new_empty(0)
    grad_z = (g2 @ w_flat.t()).view(n, n_out * n_experts, d_in)
    grad_x = torch.bmm(c.transpose(1, 2), grad_z)
    grad_gate = no_gate_grad
    if gate is not None and need_gate_grad:
        # Each slot's row of grad_z taken with one index_select over the flattened rows (gather along dim 1 is
        # the generic indexing kernel, several times slower); a head's slots read the same input row and lie
        # side by side, so one small bmm per (token, input row) dots them with it, without copying x's rows.
        sel = _expert_rows(index, n_out, n_experts)
        pick = (torch.arange(n, device=x.device).unsqueeze(1) * (n_out * n_experts) + sel).view(-1)
        gz = grad_z.reshape(-1, d_in).index_select(0, pick).to(acc).view(n * n_in, slots // n_in, d_in)
        grad_gate = torch.bmm(gz, x.to(acc).reshape(n * n_in, d_in, 1)).view(n, slots).to(gate.dtype)
    return grad_x, grad_w, grad_gate


# ----------------------------------------------------------------------------------------------------------
# grouped and combo: one GEMM per block of segments that chose the same experts
#
# A segment is a run of consecutive slots of one token that share an input and an output row. grouped treats
# every slot as its own segment (blocks of one expert's pairs); combo takes the longest such runs (a head's k
# slots), so a block's rows are gathered once for all k experts, the k products add up in the GEMMs and the
# result is index-added once.


class _Plan(NamedTuple):
    """Segments sorted by their (sorted) experts, and what the two regimes need of them."""

    slot: Tensor  # [P, seg] flat slot id (n*S + s) of each segment's slots, in expert order within the segment
    src: Tensor  # input row of each segment
    dst: Tensor  # output row of each segment
    gates: Tensor | None  # [P, seg] in the accumulation dtype
    blocks: list[tuple[list[int], slice]]  # (the segment's experts, slice of the sorted segments)


def segment_length(slots: int, n_in: int, n_out: int) -> int:
    """Length of the runs of consecutive slots that share both their input and their output row."""
    return math.gcd(slots // n_in, slots // n_out)


def _plan(index: Tensor, gate: Tensor | None, weight: Tensor, n_in: int, n_out: int, acc, seg: int) -> _Plan:
    """Blocks hold at most GROUPED_BLOCK_ELEMENTS / (widest side) segments so that every temporary stays small: on
    the CPU a fresh [N*S, D] buffer is zero-filled page by page on first touch, a cost of the order of the GEMMs,
    while block-sized ones are recycled by the allocator and stay in cache between gather and GEMM."""
    slots = index.shape[1]
    n_experts = weight.shape[0]
    if seg == 1:  # every slot is a segment of its own: its expert is its group
        experts, within, group = index.reshape(-1, 1), None, index.reshape(-1)
    else:
        experts, within = index.reshape(-1, seg).sort(-1)  # [segments, seg]
        if n_experts**seg < 2**62:  # one integer per set: torch.unique over rows (dim=0) is much slower
            key = (experts * n_experts ** torch.arange(seg, device=index.device)).sum(-1)
            _, group = torch.unique(key, return_inverse=True)
        else:
            _, group = torch.unique(experts, dim=0, return_inverse=True)
    order = torch.argsort(group, stable=True)  # stable: the weight gradient adds up in a fixed order
    slot = order.unsqueeze(1) if within is None else order.unsqueeze(1) * seg + within.index_select(0, order)
    rows = block_rows(*weight.shape[1:])
    # Each group's experts read off its first segment, for all groups in one tolist() rather than one per group.
    starts = list(itertools.accumulate(torch.bincount(group).tolist(), initial=0))
    used = [g for g in range(len(starts) - 1) if starts[g + 1] > starts[g]]
    firsts = order.index_select(0, torch.tensor([starts[g] for g in used], dtype=torch.long, device=order.device))
    sets = experts.index_select(0, firsts).tolist()
    blocks = []
    for g, es in zip(used, sets):
        blocks += [(es, slice(b, min(b + rows, starts[g + 1]))) for b in range(starts[g], starts[g + 1], rows)]
    first = order * seg
    gates = None if gate is None else gate.reshape(-1).index_select(0, slot.reshape(-1)).view(slot.shape).to(acc)
    return _Plan(slot, first // (slots // n_in), first // (slots // n_out), gates, blocks)


def _one_segment_per_row(slots: int, rows: int, seg: int) -> bool:
    """Is every row (of the output, or of x for its gradient) exactly one segment's? Then the products are written in
    the segments' order and gathered back into row order at the end (`_unsorted`): no zero fill, no read of the row
    they would be added to, and a gather instead of a scatter: on the CPU 1.6-2.3x faster for rows 412 to 76 wide
    (docs/BENCHMARKS.md, "gathered back instead of scattered")."""
    return slots // rows == seg


def _product(a: Tensor, b: Tensor, acc: torch.dtype, out: Tensor | None) -> Tensor:
    """a @ b in the accumulation dtype, written into `out` where one is given."""
    if out is None:
        y = a @ b
        return y if y.dtype == acc else y.to(acc)
    return torch.mm(a, b, out=out) if a.dtype == acc else out.copy_(a @ b)


def _unsorted(rows_sorted: Tensor, order: Tensor, width: int) -> Tensor:
    """The first `width` columns of the rows, moved from the segments' order back to row order (order[i] = the row
    of sorted row i, a permutation)."""
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=order.device))
    return rows_sorted[:, :width].index_select(0, inverse)


def aligned(d: int, align: int = GEMM_ALIGN) -> int:
    """d rounded up to a multiple of `align` (default GEMM_ALIGN)."""
    return -(-d // align) * align


def _gemm_width(d: int, x: Tensor, index: Tensor, n_experts: int) -> int:
    """Width of the rows the blocked regimes' GEMMs write (see GEMM_ALIGN): d, or d padded on the CPU in fp32."""
    padded = aligned(d)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 16 * (padded - d) <= d < GEMM_PAD_MAX_WIDTH:
        return d
    return padded if index.numel() >= CPU_COSTS[this_cpu()].gemm_pad_min_pairs * n_experts else d


def _padded(t: Tensor, width: int) -> Tensor:
    """t with its last dimension zero-padded to `width`."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


class _Buffers:
    """Block-sized work buffers of one call, each reused by every block, where the blocks' temporaries are large
    (BUFFER_MIN_ELEMENTS): fresh memory for every block, which the allocator may have handed back to the system in
    between, was measured slower than the same memory used again."""

    def __init__(self, blocks: list[tuple[list[int], slice]], widest: int, device: torch.device):
        self.rows = max((b.stop - b.start for _, b in blocks), default=0)
        self.on = self.rows * widest >= BUFFER_MIN_ELEMENTS
        self.device = device
        self.made: dict[str, Tensor] = {}

    def get(self, name: str, m: int, width: int, dtype: torch.dtype) -> Tensor | None:
        """An [m, width] view of the buffer called `name` (made at the first call), or None: allocate as you go."""
        if not self.on:
            return None
        if name not in self.made:  # each name keeps one width and dtype for the whole call
            self.made[name] = torch.empty(self.rows, width, dtype=dtype, device=self.device)
        return self.made[name][:m]


# Written into the buffer where there is one (`_Buffers`); without one, the plain calls: with out=None these cost a few
# microseconds more per call, enough to show in blocks of a few dozen rows.
def _rows(t: Tensor, index: Tensor, out: Tensor | None) -> Tensor:
    return t.index_select(0, index) if out is None else torch.index_select(t, 0, index, out=out)


def _mul(a: Tensor, b: Tensor, out: Tensor | None) -> Tensor:
    return a * b if out is None else torch.mul(a, b, out=out)


def _segments_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int, seg: int) -> Tensor:
    n, slots = index.shape
    d_in, d_out = weight.shape[1:]
    acc = _acc_dtype(x)
    x2 = x.reshape(-1, d_in)
    _, src, dst, gates, blocks = _plan(index, gate, weight, x.shape[1], n_out, acc, seg)
    # Gate whichever side of the product is narrower (for fp32; half inputs are gated after the cast to fp32).
    gate_rows = gate is not None and x.dtype == acc and d_in < d_out
    width = _gemm_width(d_out, x, index, weight.shape[0])
    weight = _padded(weight, width)
    own = _one_segment_per_row(slots, n_out, seg)  # a V-like head in combo, sigma-MoE up
    out = (torch.empty if own else torch.zeros)(n * n_out, width, dtype=acc, device=x.device)  # own: sorted rows
    buf = _Buffers(blocks, max(d_in, width), x.device)
    for experts, b in blocks:
        m = b.stop - b.start
        rows = _rows(x2, src[b], buf.get("rows", m, d_in, x.dtype))  # once for the segment's experts
        y = out[b] if own else buf.get("y", m, width, acc)
        for j, e in enumerate(experts):
            g = None if gates is None else gates[b, j : j + 1]
            if gate_rows:  # the products add up inside the GEMMs
                last = j == len(experts) - 1
                gated = rows.mul_(g) if last else _mul(rows, g, buf.get("gated", m, d_in, acc))
                y = _product(gated, weight[e], acc, y) if j == 0 else y.addmm_(gated, weight[e])
            elif j == 0:
                y = _product(rows, weight[e], acc, y)
                if g is not None:
                    y.mul_(g)
            elif g is None and x.dtype == acc:
                y.addmm_(rows, weight[e])
            else:
                t = _product(rows, weight[e], acc, buf.get("t", m, width, acc))
                y.add_(t) if g is None else y.addcmul_(t, g)
        if not own:
            out.index_add_(0, dst[b], y)
    if own:
        return _unsorted(out, dst, d_out).view(n, n_out, d_out).to(x.dtype)
    return out.view(n, n_out, width)[..., :d_out].to(x.dtype).contiguous()


def _segments_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool, seg: int,
) -> Grads:
    n, slots = index.shape
    d_in, d_out = weight.shape[1:]
    acc = _acc_dtype(x)
    # Result rows padded where `_gemm_width` says so: grad_x's (weight padded along D_in) and the weight gradient's
    # (grad padded along D_out; the products with grad read its first D_out columns only).
    in_w, out_w = (_gemm_width(d, x, index, weight.shape[0]) for d in (d_in, d_out))
    out_w = out_w if need_weight_grad else d_out
    x2, g2 = x.reshape(-1, d_in), _padded(grad.reshape(-1, d_out).to(x.dtype), out_w)
    slot, src, dst, gates, blocks = _plan(index, gate, weight, x.shape[1], grad.shape[1], acc, seg)
    weight = torch.nn.functional.pad(weight, (0, 0, 0, in_w - d_in)) if in_w != d_in else weight
    own = _one_segment_per_row(slots, x.shape[1], seg)  # an O-like head in combo, sigma-MoE down
    grad_x = (torch.empty if own else torch.zeros)(n * x.shape[1], in_w, dtype=acc, device=x.device)  # own: sorted rows
    grad_w = torch.zeros(weight.shape[0], d_in, out_w, dtype=acc, device=x.device) if need_weight_grad else None
    need_gate_grad = need_gate_grad and gates is not None
    gate_grad_sorted = torch.empty(slot.shape, dtype=acc, device=x.device) if need_gate_grad else None
    buf = _Buffers(blocks, max(in_w, out_w), x.device)
    for experts, b in blocks:
        m = b.stop - b.start
        xs = _rows(x2, src[b], buf.get("xs", m, d_in, x.dtype))
        gs = _rows(g2, dst[b], buf.get("gs", m, out_w, x.dtype))
        gx = grad_x[b] if own else buf.get("gx", m, in_w, acc)
        for j, e in enumerate(experts):
            # The un-gated input gradient u = g @ W^T of each pair also gives its gate gradient <x, u>
            # (= <x @ W, g>), so the forward is never recomputed: three GEMMs per expert, as for a linear layer.
            u = _product(gs[:, :d_out], weight[e].t(), acc, gx if j == 0 else buf.get("u", m, in_w, acc))
            if j == 0:
                gx = u  # gx itself where there was a buffer
            g = gates[b, j : j + 1] if gates is not None else None
            if g is not None and need_gate_grad:
                gate_grad_sorted[b, j] = _mul(u[:, :d_in], xs, buf.get("dot", m, d_in, acc)).sum(-1)
            if j == 0:
                if g is not None:
                    gx.mul_(g)
            else:
                gx.add_(u) if g is None else gx.addcmul_(u, g)
            if not need_weight_grad:
                continue
            xs_j, gs_j = xs, gs
            if g is not None and d_in < d_out:  # gate the narrower side of the weight-gradient product
                xs_j = _mul(xs, g, buf.get("gated", m, d_in, acc)).to(x.dtype)
            elif g is not None:
                gs_j = _mul(gs, g, buf.get("gated", m, out_w, acc)).to(x.dtype)
            if x.dtype == acc:
                grad_w[e].addmm_(xs_j.t(), gs_j)
            else:
                grad_w[e] += (xs_j.t() @ gs_j).to(acc)
        if not own:
            grad_x.index_add_(0, src[b], gx)
    grad_gate = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    if need_gate_grad:
        grad_gate = torch.empty(n * slots, dtype=gate.dtype, device=x.device)
        grad_gate.index_copy_(0, slot.reshape(-1), gate_grad_sorted.reshape(-1).to(gate.dtype))
        grad_gate = grad_gate.view(n, slots)
    grad_x = (_unsorted(grad_x, src, d_in) if own else grad_x[:, :d_in]).reshape(x.shape).to(x.dtype).contiguous()
    if grad_w is None:
        return grad_x, weight.new_empty(0), grad_gate
    return grad_x, grad_w[..., :d_out].to(weight.dtype).contiguous(), grad_gate


# grouped runs its experts as one call of torch's grouped GEMM (`F.grouped_mm`, whose loop over the experts runs in
# C++) instead of one GEMM call per expert and block, with its gathers, gate products and index_adds once per call,
# while each expert's pairs fill at most GROUPED_MM_MAX_ELEMENTS elements of the widest operand (pairs x
# max(D_in, D_out); GROUPED_MM_BACKWARD_MAX_ELEMENTS in the backward): there the per-expert calls (and their Python)
# are what the regime costs beyond its GEMMs. Beyond it the blocks are as fast or faster: they pad narrow GEMM rows,
# reuse their buffers and keep them in cache, while the grouped GEMM's call-sized temporaries are fresh memory (the
# backward's most: 47M V's took 0.53-0.64x the blocks' time at 26K elements per expert, 0.65-1.36x at 32K, 0.91-1.39x
# at 40K, while its forward and the other shapes' backward still gained at 64K). CPU, fp32, widths that are multiples
# of 4 (the grouped GEMM needs 16-byte row strides). `python benchmarks/kernels.py --threads 1 --n ... --grouped-mm`
# (docs/BENCHMARKS.md, "grouped through torch's grouped GEMM").
GROUPED_MM_MAX_ELEMENTS = 64 * 1024
GROUPED_MM_BACKWARD_MAX_ELEMENTS = 28 * 1024
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None)


@functools.cache
def _grouped_mm_on_cpu() -> bool:
    """Whether this torch runs the grouped GEMM on the CPU in fp32 (tried once; a torch without it, or with it for
    CUDA only, keeps the blocks)."""
    if _GROUPED_MM is None:
        return False
    try:
        y = _GROUPED_MM(torch.ones(3, 4), torch.ones(2, 4, 4), offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return y.shape == (3, 4) and bool((y == 4).all())


def grouped_mm_elements(pairs: int, n_experts: int, d_in: int, d_out: int) -> float:
    """What the grouped GEMM's thresholds are set in: each expert's (expected) pairs x the wider width."""
    return pairs * max(d_in, d_out) / n_experts


def _grouped_mm_fits(x: Tensor, weight: Tensor, index: Tensor, backward: bool = False) -> bool:
    d_in, d_out = weight.shape[1:]
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not _grouped_mm_on_cpu():
        return False
    if d_in % 4 or d_out % 4 or not weight.is_contiguous() or index.numel() == 0:
        return False
    limit = GROUPED_MM_BACKWARD_MAX_ELEMENTS if backward else GROUPED_MM_MAX_ELEMENTS
    return grouped_mm_elements(index.numel(), *weight.shape) <= limit


def _by_expert(index: Tensor, n_experts: int, pairs_per_row: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pairs in expert order (stable), where each expert's pairs end in that order (int32, as the grouped GEMM
    takes them), and each sorted pair's input and output row (`pairs_per_row`: slots per input row, per output
    row)."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: the weight gradient adds up in a fixed order
    ends = torch.bincount(flat, minlength=n_experts).cumsum(0).to(torch.int32)
    return order, ends, order // pairs_per_row[0], order // pairs_per_row[1]


def _grouped_mm_operands(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """x's rows [N*I, D_in] and the weight, zero-padded to the 16-byte row strides the grouped GEMM needs (the
    automatic CPU path takes only widths that need none)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise RuntimeError(f"the grouped_mm regime takes float32, bfloat16 or float16 inputs, not {x.dtype}")
    align = 16 // x.element_size()
    d_in, d_out = weight.shape[1:]
    d_in_p, d_out_p = aligned(d_in, align), aligned(d_out, align)
    if (d_in_p, d_out_p) != (d_in, d_out):
        weight = torch.nn.functional.pad(weight, (0, d_out_p - d_out, 0, d_in_p - d_in))
    return _padded(x.reshape(-1, d_in), d_in_p), weight.contiguous()


def _as_rows(t: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """t's first `width` columns, contiguous, in `dtype` (t itself where it is that already)."""
    return t if t.shape[1] == width and t.dtype == dtype else t[:, :width].to(dtype).contiguous()


def grouped_mm_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    """grouped's experts in one call of torch's grouped GEMM, at any size and on any device where torch has it:
    what the CPU's grouped regime runs below its thresholds, and (`regime="grouped_mm"`) a regime of its own to
    time elsewhere. On CUDA its index_add_ adds with atomics, so there it is not reproducible bit for bit."""
    n, slots = index.shape
    n_experts, d_in, d_out = weight.shape
    acc = _acc_dtype(x)
    order, ends, src, dst = _by_expert(index, n_experts, (slots // x.shape[1], slots // n_out))
    x2, w = _grouped_mm_operands(x, weight)
    rows = x2.index_select(0, src)
    gates = None if gate is None else gate.reshape(-1, 1).index_select(0, order).to(acc)
    gate_rows = gates is not None and x.dtype == acc and d_in < d_out  # gate the narrower side (half: the result)
    if gate_rows:
        rows.mul_(gates)
    y = _GROUPED_MM(rows, w, offs=ends).to(acc)
    if gates is not None and not gate_rows:
        y.mul_(gates)
    if _one_segment_per_row(slots, n_out, 1):  # sigma-MoE up: each output row is one pair's
        out = _unsorted(y, dst, d_out)
    else:
        out = torch.zeros(n * n_out, y.shape[1], dtype=acc, device=x.device).index_add_(0, dst, y)
    return _as_rows(out, d_out, x.dtype).view(n, n_out, d_out)


def grouped_mm_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> Grads:
    n, slots = index.shape
    n_experts, d_in, d_out = weight.shape
    acc = _acc_dtype(x)
    order, ends, src, dst = _by_expert(index, n_experts, (slots // x.shape[1], slots // grad.shape[1]))
    x2, w = _grouped_mm_operands(x, weight)
    xs = x2.index_select(0, src)
    gs = _padded(grad.reshape(-1, d_out).to(x.dtype), w.shape[2]).index_select(0, dst)
    gates = None if gate is None else gate.reshape(-1, 1).index_select(0, order).to(acc)
    # The un-gated input gradient u = g @ W^T of each pair also gives its gate gradient <x, u> (= <x @ W, g>).
    u = _GROUPED_MM(gs, w.transpose(1, 2), offs=ends).to(acc)
    grad_gate = x.new_empty(0, dtype=gate.dtype if gate is not None else x.dtype)
    if need_gate_grad and gate is not None:
        sorted_grad = torch.linalg.vecdot(u, xs.to(acc))
        grad_gate = torch.empty_like(sorted_grad).index_copy_(0, order, sorted_grad).view(n, slots).to(gate.dtype)
    if gates is not None:
        u.mul_(gates)
    if _one_segment_per_row(slots, x.shape[1], 1):  # sigma-MoE down: each input row is one pair's
        grad_x = _unsorted(u, src, d_in)
    else:
        grad_x = torch.zeros(x2.shape, dtype=acc, device=x.device).index_add_(0, src, u)
    grad_w = weight.new_empty(0)
    if need_weight_grad:
        if gates is not None:  # the narrower side, this call's own copy (half: rounded, as the other regimes do)
            (xs if d_in < d_out else gs).mul_(gates)
        # [E, D_in, D_out], zero for experts without pairs
        grad_w = _GROUPED_MM(xs.t(), gs, offs=ends)
        if grad_w.shape[1:] != weight.shape[1:] or grad_w.dtype != weight.dtype:
            grad_w = grad_w[:, :d_in, :d_out].to(weight.dtype).contiguous()
    return _as_rows(grad_x, d_in, x.dtype).view(x.shape), grad_w, grad_gate


def grouped_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    if _grouped_mm_fits(x, weight, index):
        return grouped_mm_forward(x, weight, index, gate, n_out)
    return _segments_forward(x, weight, index, gate, n_out, 1)


def grouped_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> Grads:
    if _grouped_mm_fits(x, weight, index, backward=True):
        return grouped_mm_backward(grad, x, weight, index, gate, need_gate_grad, need_weight_grad)
    return _segments_backward(grad, x, weight, index, gate, need_gate_grad, need_weight_grad, 1)


def combo_forward(x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, n_out: int) -> Tensor:
    return _segments_forward(x, weight, index, gate, n_out, segment_length(index.shape[1], x.shape[1], n_out))


def combo_backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True,
) -> Grads:
    seg = segment_length(index.shape[1], x.shape[1], grad.shape[1])
    return _segments_backward(grad, x, weight, index, gate, need_gate_grad, need_weight_grad, seg)


FORWARD = {"gather": gather_forward, "dense": dense_forward, "grouped": grouped_forward, "combo": combo_forward}
BACKWARD = {"gather": gather_backward, "dense": dense_backward, "grouped": grouped_backward, "combo": combo_backward}
# Never picked by `choose_regime`; for `regime=` and `benchmarks/kernels.py --regimes grouped_mm`.
FORWARD["grouped_mm"], BACKWARD["grouped_mm"] = grouped_mm_forward, grouped_mm_backward


def _widened(x: Tensor, widen: bool | None) -> bool:
    """Compute in float32? For half inputs on a CPU without instructions for their dtype (`widen` None), where
    PyTorch multiplies half matrices by a slow generic route: a regime in bf16 took 12-68x the op's time computed
    in float32 at N = 256 on an AVX2 CPU (docs/BENCHMARKS.md, "bf16"). bf16 and fp16 products are exact in
    float32, so nothing is lost."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False
    return widen if widen is not None else x.device.type == "cpu" and not native_half(x.dtype)


def _plan_call(x: Tensor, weight: Tensor, index: Tensor, n_out: int, backward: bool, regime: Regime | None,
               widen: bool | None) -> tuple[Regime, bool, Tensor]:
    """The regime, whether to compute in float32, and the weight to compute with (the gather regime converts just
    the few experts it reads; the others read every expert, so it is converted once)."""
    wide = _widened(x, widen)
    regime = regime or choose_regime(
        x.shape[0], x.shape[1], index.shape[1], n_out, *weight.shape, backward,
        dtype=torch.float32 if wide else x.dtype, bag=not wide and _bags(x, weight),
    )
    return regime, wide, weight.float() if wide and regime != "gather" else weight


# Non-finite values and the dense regime: it multiplies every expert, and mixes a token's input rows, before zero
# coefficients drop what the formula does not read; 0 * inf and 0 * nan are nan, so a non-finite weight of an
# expert no token chose (a dead or uninitialised one), input row or output gradient would spread to results that
# never read it. Where the dense regime was chosen automatically, results that are not all finite are computed
# again by the grouped regime, which reads only what the formula reads. The checks are sums of the results (a sum
# is finite unless a term is not, or finite terms overflow, which only costs the rerun): about 0.02 ms per dense
# forward, 7-9 % of the 47M shapes' at N = 16 (docs/BENCHMARKS.md, "Non-finite values and the dense regime"). The
# weight itself is not summed (that costs as much as the products at small N): a leak from it shows in the
# results. On the CPU only: elsewhere each check would be a host sync.


def _finite(*tensors: Tensor) -> bool:
    # math.isfinite of the sum's value: torch.isfinite on a 0-d tensor costs more than the sum at these sizes
    return all(t.device.type != "cpu" or math.isfinite(t.sum(dtype=_acc_dtype(t)).item()) for t in tensors)


def _forward_in(regime: Regime, x: Tensor, w: Tensor, index: Tensor, gate: Tensor | None, n_out: int,
                wide: bool) -> Tensor:
    if not wide:
        return FORWARD[regime](x, w, index, gate, n_out)
    return FORWARD[regime](x.float(), w, index, gate, n_out).to(x.dtype)


def forward(
    x: Tensor,
    weight: Tensor,
    index: Tensor,
    gate: Tensor | None,
    n_out: int,
    regime: Regime | None = None,
    widen: bool | None = None,
) -> Tensor:
    index = index.contiguous()  # the regimes flatten it with views (a transposed one is legal input)
    auto = regime is None
    regime, wide, w = _plan_call(x, weight, index, n_out, False, regime, widen)
    out = _forward_in(regime, x, w, index, gate, n_out, wide)
    if auto and regime == "dense" and not _finite(out):  # see "Non-finite values" above
        out = _forward_in("grouped", x, w, index, gate, n_out, wide)
    return out


def _backward_in(regime: Regime, grad: Tensor, x: Tensor, weight: Tensor, w: Tensor, index: Tensor,
                 gate: Tensor | None, need_gate_grad: bool, need_weight_grad: bool, wide: bool) -> Grads:
    if not wide:
        return BACKWARD[regime](grad, x, w, index, gate, need_gate_grad, need_weight_grad)
    gx, gw, gg = BACKWARD[regime](grad.float(), x.float(), w, index, gate, need_gate_grad, need_weight_grad)
    return gx.to(x.dtype), gw.to(weight.dtype), gg if gate is not None else gg.to(x.dtype)


def backward(
    grad: Tensor, x: Tensor, weight: Tensor, index: Tensor, gate: Tensor | None, need_gate_grad: bool,
    need_weight_grad: bool = True, regime: Regime | None = None, widen: bool | None = None,
) -> Grads:
    index = index.contiguous()
    auto = regime is None
    regime, wide, w = _plan_call(x, weight, index, grad.shape[1], True, regime, widen)
    args = grad, x, weight, w, index, gate, need_gate_grad, need_weight_grad, wide
    # see "Non-finite values" above: x and grad reach the weight gradient of every expert, the weight reaches
    # grad_x and the gate's gradient
    if auto and regime == "dense" and not _finite(x, grad):
        regime = "grouped"
    grads = _backward_in(regime, *args)
    if auto and regime == "dense" and not _finite(grads[0], grads[2]):
        grads = _backward_in("grouped", *args)
    return grads
