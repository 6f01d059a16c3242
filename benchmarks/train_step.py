"""One training step (forward + backward) of a model preset on the CPU, with the PyTorch expert-projection paths
as they are now and, with --against, as of a git revision, timed in turns in one run.

    python benchmarks/train_step.py --config switchhead-47m --batch 8 --dtype bfloat16 --against REV

The step is what `switchhead train` runs: a chunk of random tokens with the XL memory of a previous chunk, the
language-model loss (plus the model's auxiliary loss), under autocast for bf16. Weights are random; only time
is measured. Prints one line per variant: best and median step time over the rounds, and the ratio to the
current code. The paths at REV replace `switchhead.kernels.torch_paths.forward` / `backward`, so everything
else (model, autocast, other layers) is the same code in both variants.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from kernels import _paths_at, interleaved_times

from switchhead.kernels import torch_paths
from switchhead.model.config import PRESETS
from switchhead.model.lm import TransformerLM


def step_fn(config: str, batch: int, dtype: torch.dtype) -> Callable[[], None]:
    torch.manual_seed(0)
    cfg = PRESETS[config].replace(dropout=0.0)
    model = TransformerLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.chunk_len + 1))
    with torch.no_grad():
        _, memory = model(ids[:, :-1])  # the memory a second chunk of the same streams would see
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            logits, _ = model(ids[:, :-1], memory)
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()) + model.aux_loss()
        loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="switchhead-47m", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--against", metavar="REV", help="also time the PyTorch paths as of this git revision")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    for name in ("batch", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    step = step_fn(args.config, args.batch, getattr(torch, args.dtype))
    current = (torch_paths.forward, torch_paths.backward)
    variants = {"current": current}
    if args.against:
        old = _paths_at(args.against)
        variants[f"@{args.against}"] = (old.forward, old.backward)
    chunk = PRESETS[args.config].chunk_len
    print(f"# {args.config}, batch {args.batch} x {chunk} tokens, {args.dtype}, threads {torch.get_num_threads()}")

    def with_paths(fwd: Callable, bwd: Callable) -> Callable[[], None]:
        def run() -> None:
            torch_paths.forward, torch_paths.backward = fwd, bwd
            step()

        return run

    try:
        times = interleaved_times({name: with_paths(*paths) for name, paths in variants.items()}, args.rounds)
    finally:
        torch_paths.forward, torch_paths.backward = current
    print("| paths | best s / step | median s / step | best vs current |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.3f} | {statistics.median(ts):.3f} | {min(ts) / min(times['current']):.2f} |")


if __name__ == "__main__":
    main()
