"""Where the expert projection op's GPU time goes: the durations of the kernels one forward and one backward put
on the GPU (torch.profiler), per shape of `benchmarks/kernels.py`, beside the wall time per call.

    python benchmarks/kernel_profile.py                       # bf16, N = 4096 and 16384
    python benchmarks/kernel_profile.py --n 16384 --tuning    # also the autotuner's time for every tile
    python benchmarks/kernel_profile.py --n 16384 --other     # also each kernel counted as "other"
    SWITCHHEAD_KERNEL=torch python benchmarks/kernel_profile.py   # the PyTorch paths on the GPU

"sort" is the counting sort of the pairs by expert (`_count_pairs_kernel` and `_place_pairs_kernel`; the cumsum
between them is in "other"), "grouped" `_grouped_matmul_kernel` (the forward in the forward, grad_x in the
backward), "weight grad" `_weight_grad_kernel`, "gather" `_gather_kernel`; "other" is everything else the call
launches (padding copies, dtype conversions, the fp32 buffer's memset, reductions). Needs CUDA.
"""

from __future__ import annotations

import argparse
import os

import torch
from kernels import CASES, _call, kernel_times, make_inputs
from triton.testing import do_bench

from switchhead.kernels import expert_projection

NAMES = {
    "_count_pairs_kernel": "sort",
    "_place_pairs_kernel": "sort",
    "_grouped_matmul_kernel": "grouped",
    "_weight_grad_kernel": "weight grad",
    "_gather_kernel": "gather",
}


def split(times: dict[str, float]) -> str:
    """'total ms (name us, ..., other us)' for one call."""
    ours: dict[str, float] = {}
    for k, v in times.items():
        if k in NAMES:
            ours[NAMES[k]] = ours.get(NAMES[k], 0.0) + v
    other = sum(times.values()) - sum(ours.values())
    parts = [f"{name} {1e3 * v:.0f}" for name, v in ours.items()] + [f"other {1e3 * other:.0f}"]
    return f"{sum(times.values()):.4f} | {', '.join(parts)}"


def others(times: dict[str, float]) -> str:
    """The kernels counted as 'other', longest first: 'us name; ...' (names cut to 60 characters)."""
    rest = sorted(((v, k) for k, v in times.items() if k not in NAMES), reverse=True)
    return "; ".join(f"{1e3 * v:.1f} {k[:60]}" for v, k in rest)


def tuning(kernel) -> str:
    """The autotuner's timing of each tile at its last tuning run (Triton keeps them in configs_timings)."""
    timings = getattr(kernel, "configs_timings", None) or {}
    return "; ".join(
        f"{'x'.join(str(v) for k, v in c.kwargs.items() if k.startswith('BLOCK'))}/w{c.num_warps}s{c.num_stages}"
        f"={(t[0] if isinstance(t, list) else t):.3f} ms"
        for c, t in timings.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="*", default=[4096, 16384], help="token counts")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tuning", action="store_true", help="print the autotuner's timings too")
    parser.add_argument("--other", action="store_true", help="list the kernels counted as 'other' too")
    args = parser.parse_args()
    if any(n < 1 for n in args.n):
        parser.error(f"--n: token counts must be >= 1, got {' '.join(map(str, args.n))}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    os.environ.setdefault("SWITCHHEAD_KERNEL", "triton")
    from switchhead.kernels import triton_kernels as tk

    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"SWITCHHEAD_KERNEL={os.environ['SWITCHHEAD_KERNEL']}\n")  # fmt: skip
    print("| case | N | fwd GPU ms | fwd kernels us | fwd wall ms | bwd GPU ms | bwd kernels us | bwd wall ms |")
    print("|---|---|---|---|---|---|---|---|")
    for case in CASES:
        for n in args.n:
            x, w, index, gate = make_inputs(case, n, dtype, "cuda", grad=True)
            grads = [x, w] + ([gate] if gate is not None else [])
            fwd = _call(expert_projection, x, w, index, gate, case.n_out)
            out = fwd()
            torch.cuda.synchronize()
            tuned_fwd = tuning(tk._grouped_matmul_kernel)
            bwd = _call(torch.autograd.grad, out, grads, torch.randn_like(out), True)
            bwd()
            torch.cuda.synchronize()
            tuned_bwd = f"{tuning(tk._grouped_matmul_kernel)} || {tuning(tk._weight_grad_kernel)}"
            fwd_times, bwd_times = kernel_times(fwd), kernel_times(bwd)
            cells = [split(fwd_times), f"{do_bench(fwd):.4f}", split(bwd_times), f"{do_bench(bwd):.4f}"]
            print(f"| {case.name} | {n} | " + " | ".join(cells) + " |", flush=True)
            if args.tuning:
                print(f"\n    tuning, forward: {tuned_fwd}\n    tuning, backward: {tuned_bwd}\n")
            if args.other:
                print(f"\n    other, forward: {others(fwd_times)}\n    other, backward: {others(bwd_times)}\n")


if __name__ == "__main__":
    main()
