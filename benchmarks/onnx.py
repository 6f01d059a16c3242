"""ONNX Runtime vs PyTorch eager: batch-1 decode tokens/s through the runtime's cache (docs/EXPORT.md).

    .venv/bin/python benchmarks/onnx.py [--configs tiny-switchhead,switchhead-47m] [--tokens 64] [--threads 2]

For each config (random weights): export fp32 and int8, then decode the same tokens one at a time with
`TorchBackend` and `OnnxBackend` (same engine `feed` loop, same XL cache), after a prefill of half a chunk.
The engines take turns, one decode each per round, and each keeps its best round, so that all three see the
same background load on a shared machine. Prints a table with tokens/s, the ratio to eager, model file
sizes and the max |logit| difference to eager.

    .venv/bin/python benchmarks/onnx.py --ppl-ckpt RUN/final --ppl-text ../shared/data/heldout/... [--ppl-tokens N]

instead measures the perplexity of a trained checkpoint on held-out text: PyTorch, ORT fp32 and ORT int8.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and this file would shadow the `onnx` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import platform  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from switchhead.errors import SwitchheadError  # noqa: E402
from switchhead.export import OnnxBackend, export  # noqa: E402
from switchhead.model.config import PRESETS  # noqa: E402
from switchhead.model.lm import TransformerLM  # noqa: E402
from switchhead.runtime import TorchBackend, feed  # noqa: E402


def decode_once(backend, prompt: list[int], tokens: list[int]) -> tuple[float, torch.Tensor]:
    """Tokens/s of one batch-1 decode of `tokens` after prefilling `prompt`, and the logits of every step."""
    cache = backend.new_cache(1)
    feed(backend, cache, [prompt])
    out = []
    t0 = time.perf_counter()
    for tok in tokens:
        out.append(feed(backend, cache, [[tok]])[0])
    return len(tokens) / (time.perf_counter() - t0), torch.stack(out)


def interleaved_rates(backends: dict, prompt: list[int], tokens: list[int], repeats: int) -> dict:
    """Best tokens/s of each backend over `repeats` rounds in which every backend decodes once, and its logits."""
    best = {name: (0.0, None) for name in backends}
    for _ in range(repeats):
        for name, backend in backends.items():
            rate, logits = decode_once(backend, prompt, tokens)
            best[name] = (max(rate, best[name][0]), logits)
    return best


def perplexity(ckpt: str, text: str, n_tokens: int, threads: int) -> None:
    import math

    import switchhead

    model, sp = switchhead.load(ckpt)
    ids = sp.encode(Path(text).read_text(encoding="utf-8"))[:n_tokens]  # scored after an EOS, as documents start
    ids = torch.tensor([[sp.eos_id()] + ids])
    targets = ids[0, 1:]

    def ppl(logits):
        return math.exp(float(torch.nn.functional.cross_entropy(logits[0, :-1].float(), targets)))

    with torch.no_grad():
        results = [("torch eager fp32", ppl(model(ids)[0]), None)]
    with tempfile.TemporaryDirectory() as tmp:
        for quant in (None, "int8"):
            res = export(ckpt, Path(tmp) / str(quant), quantize=quant)
            backend = OnnxBackend(res.out, threads=threads)
            results.append((f"onnxruntime {quant or 'fp32'}", ppl(backend.logits(ids)[0]), res.model_bytes))
    print(f"\nperplexity of {ckpt} on the first {ids.shape[1] - 1} tokens of {text}")
    print("| engine | perplexity | change | model.onnx MB |")
    print("|---|---|---|---|")
    for what, p, size in results:
        print(f"| {what} | {p:.3f} | {100 * (p / results[0][1] - 1):+.2f}% | "
              f"{'-' if size is None else f'{size / 1e6:.2f}'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny-switchhead,switchhead-47m",
                    help="comma-separated model presets to time (random weights)")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="CPU threads for torch and ONNX Runtime (default: torch's)")
    ap.add_argument("--ppl-ckpt", help="measure perplexity of this checkpoint instead of speed")
    ap.add_argument("--ppl-text", default="../shared/data/heldout/wikitext103_test.tokens.txt",
                    help="held-out text file that --ppl-ckpt is scored on")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    args = ap.parse_args()
    # Checked here, not where they are used: the exports before them take minutes.
    for name in ("tokens", "repeats", "threads", "ppl_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    configs = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in configs if name not in PRESETS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(sorted(PRESETS))})")
    if args.ppl_ckpt and not Path(args.ppl_text).is_file():
        ap.error(f"--ppl-text: no file {args.ppl_text}")
    if not args.ppl_ckpt and not configs:
        ap.error("--configs is empty and there is no --ppl-ckpt: nothing to measure")
    torch.set_num_threads(args.threads)
    if args.ppl_ckpt:
        try:
            perplexity(args.ppl_ckpt, args.ppl_text, args.ppl_tokens, args.threads)
        except SwitchheadError as e:  # a missing or damaged checkpoint: the library's one-line message
            ap.error(f"--ppl-ckpt {args.ppl_ckpt}: {e}")
        return
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:
            torch.manual_seed(0)
            cfg = PRESETS[name].replace(dropout=0.0)
            model = TransformerLM(cfg).eval()
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, cfg.vocab_size, (cfg.chunk_len // 2,), generator=g).tolist()
            tokens = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g).tolist()
            backends, sizes = {"torch eager fp32": TorchBackend(model)}, {}
            for quant in (None, "int8"):
                t0 = time.perf_counter()
                res = export(None, Path(tmp) / f"{name}-{quant}", model=model, quantize=quant)
                what = f"onnxruntime {quant or 'fp32'}"
                backends[what], sizes[what] = OnnxBackend(res.out, threads=args.threads), res.model_bytes
                print(f"  exported {name} {quant or 'fp32'} in {time.perf_counter() - t0:.0f} s", flush=True)
            rates = interleaved_rates(backends, prompt, tokens, args.repeats)
            eager, ref = rates["torch eager fp32"]
            for what, (rate, logits) in rates.items():
                err = None if what not in sizes else float((logits - ref).abs().max())
                rows.append((name, what, rate, sizes.get(what), err, rate / eager))
    print("\n| config | engine | decode tok/s (batch 1) | vs eager | model.onnx MB | max abs logit diff |")
    print("|---|---|---|---|---|---|")
    for n, what, rate, size, err, ratio in rows:
        print(f"| {n} | {what} | {rate:.1f} | {ratio:.2f}x | {'-' if size is None else f'{size / 1e6:.1f}'} | "
              f"{'-' if err is None else f'{err:.2e}'} |")


if __name__ == "__main__":
    main()
