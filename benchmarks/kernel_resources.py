"""What the Triton kernels would use on an sm_90 GPU (H100), built without a GPU.

    python benchmarks/kernel_resources.py              # summary per precision and launch
    python benchmarks/kernel_resources.py --configs    # one row per autotune config
    python benchmarks/kernel_resources.py --align 1    # the same without padding rows to 16 elements
    python benchmarks/kernel_resources.py --every-tile # every precision with every tile, not just its own

For each shape of `benchmarks/kernels.py` it records the launches of one forward and backward of the Triton op
(N = 4096 tokens; N = 1 for the decode gather kernel), builds each with every autotune config the tuner would
try at that precision, and reads registers and stack bytes (spills) from the binary, shared memory, and whether
the loads became async copies (kept in flight across steps) and the products tensor-core instructions, and
whether a wgmma stays in flight while the next tiles load (`switchhead.kernels.gpu_build`).
It measures no speed: it shows builds that cannot be fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import CASES, make_inputs  # noqa: E402

from switchhead.kernels import gpu_build, triton_kernels  # noqa: E402

PRECISIONS = {  # name: dtype, allow TF32 for fp32 matmuls
    "bf16": (torch.bfloat16, False),
    "fp16": (torch.float16, False),
    "fp32 (TF32)": (torch.float32, True),
    "fp32 (IEEE)": (torch.float32, False),
}
STEP = {  # what each launch of a kernel computes, in launch order (None: the same build again)
    "_count_pairs_kernel": ["sort (count)", None],
    "_place_pairs_kernel": ["sort (place)", None],
    "_grouped_matmul_kernel": ["forward", "grad_x"],
    "_weight_grad_kernel": ["grad_w"],
    "_gather_kernel": ["decode"],
}


def _launches(case, dtype, allow_tf32: bool) -> list[tuple[str, gpu_build.Launch]]:
    out = []
    for n in (4096, 1):
        x, w, index, gate = make_inputs(case, n, dtype, "cpu")
        seen = defaultdict(int)
        for launch in gpu_build.launches(x, w, index, gate, case.n_out, allow_tf32):
            step = STEP[launch.kernel][seen[launch.kernel]]
            seen[launch.kernel] += 1
            if step is not None and (step == "decode") == (n == 1):
                out.append((step, launch))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", action="store_true", help="one row per autotune config")
    parser.add_argument("--align", type=int, default=triton_kernels.ALIGN, help="pad rows to this many elements")
    parser.add_argument("--every-tile", action="store_true", help="skip the autotuner's per-precision pruning")
    parser.add_argument("--arch", type=int, default=90, help="GPU compute capability to build for (90: sm_90, H100)")
    args = parser.parse_args()
    if args.align < 1:
        parser.error(f"--align must be >= 1 (1: no padding), got {args.align}")
    triton_kernels.ALIGN = args.align

    jobs = []
    for precision, (dtype, tf32) in PRECISIONS.items():
        for case in CASES:
            for step, launch in _launches(case, dtype, tf32):
                tiles = gpu_build.configs(launch, prune=not args.every_tile)
                jobs += [(precision, case.name, step, launch, config) for config in tiles]
    rows = []
    for precision, case, step, launch, config in tqdm(jobs, desc="building", unit="build"):
        rows.append((precision, case, step, config, gpu_build.build(launch, config, args.arch)))

    tiles = "every tile" if args.every_tile else "the tiles of each precision"
    print(f"# sm_{args.arch}, rows padded to {args.align} elements, {tiles}, N = 4096 (decode: N = 1)\n")
    if args.configs:
        print("| precision | case | step | config | registers | stack B | shared KB | async copies | loads in flight "
              "| tensor cores | wgmma in flight |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for precision, case, step, config, b in rows:
            cfg = "fixed"
            if config is not None:
                cfg = f"{tuple(config.kwargs.values())} w{config.num_warps} s{config.num_stages}"
            yes = {True: "yes", False: "no", None: "n/a"}
            print(
                f"| {precision} | {case} | {step} | {cfg} | {b.registers} | {b.stack_bytes} | "
                f"{b.shared_bytes / 1024:.1f} | {yes[b.async_copies]} | {yes[b.copies_in_flight]} "
                f"| {yes[b.tensor_cores]} | {yes[b.mma_in_flight]} |"
            )
        return
    groups = defaultdict(list)
    for precision, case, step, _, b in rows:
        groups[(precision, step)].append((case, b))
    print(
        "| precision | step | builds | registers (max) | builds with spills | spill stack B (max) | shared KB (max) "
        "| async copies | loads in flight | tensor cores | wgmma in flight |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (precision, step), items in groups.items():
        builds = [b for _, b in items]
        spilled = sorted({case for case, b in items if b.stack_bytes})
        spills = f"{sum(b.stack_bytes > 0 for b in builds)} ({', '.join(spilled)})" if spilled else "0"
        n = len(builds)
        wgmma = [b.mma_in_flight for b in builds if b.mma_in_flight is not None]
        in_flight = f"{sum(wgmma)}/{len(wgmma)}" if wgmma else "n/a"  # of the builds that use wgmma
        async_copies = f"{sum(b.async_copies for b in builds)}/{n}"
        loads_in_flight = f"{sum(bool(b.copies_in_flight) for b in builds)}/{n}"
        tensor_cores = f"{sum(b.tensor_cores for b in builds)}/{n}"
        if step == "decode":  # a vector per output row: the CUDA cores, by design
            tensor_cores = "n/a"
        if step.startswith("sort"):  # one block of expert ids per program: no tiles to stage or multiply
            async_copies = loads_in_flight = tensor_cores = "n/a"
        print(
            f"| {precision} | {step} | {n} | {max(b.registers for b in builds)} | {spills} "
            f"| {max(b.stack_bytes for b in builds)} | {max(b.shared_bytes for b in builds) / 1024:.1f} "
            f"| {async_copies} | {loads_in_flight} | {tensor_cores} | {in_flight} |"
        )


if __name__ == "__main__":
    main()
