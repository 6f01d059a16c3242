"""Decode speed of the runtime (random weights, preset vocab), in one run so the numbers sit side by side.

    .venv/bin/python benchmarks/generate.py [--context 512] [--tokens 16] [--threads N]
    .venv/bin/python benchmarks/generate.py --against REV [--tokens 16] [--threads N]
    .venv/bin/python benchmarks/generate.py --dispatch [--tokens 16] [--threads N]

1. Cached decoding vs recomputing the full forward over the whole context at every step (switchhead-47m).
2. switchhead-47m vs transformer-47m decode tokens/s at batch 1 and 8, cache bytes per token.
3. Bytes one decode step must move (weights actually touched -- only the selected experts -- plus the cache
   window and the relative-position tables read) per second, against measured memory-copy bandwidth.

With --against, only a decode-step table instead: the built-in model and switchhead-47m at batch 1 and 8, with
the PyTorch expert-projection paths as they are now and as of git revision REV, one step each in turn. With
--dispatch, the same table with the op called as the model calls it (directly where that is safe) and always
through the custom op's dispatcher.

The cache window is a fixed 2T slots, so a decode step costs the same at any context length once the cache
exists; batch-8 rows are therefore prefilled with short prompts to keep the run to a few minutes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from kernels import _paths_at

from switchhead import PRESETS, TransformerLM, load
from switchhead.kernels import ops, torch_paths
from switchhead.model import layers
from switchhead.model.accounting import kv_cache_bytes_per_token
from switchhead.runtime import TorchBackend, feed


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy, counting bytes read plus bytes written (best of `repeats`)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def build(name: str) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(PRESETS[name]).eval()


def time_decode(be: TorchBackend, cache, batch: int, tokens: int, gen: torch.Generator) -> float:
    """Seconds per decode step (median of `tokens` steps), feeding random tokens."""
    times = []
    vocab = be.config.vocab_size
    for _ in range(tokens):
        ids = torch.randint(0, vocab, (batch, 1), generator=gen).tolist()
        t = time.perf_counter()
        feed(be, cache, ids)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def touched_bytes(model: TransformerLM, be: TorchBackend, cache, batch: int, gen: torch.Generator) -> dict:
    """Bytes one decode step reads: dense weights, the experts actually selected, cache window, rel-pos tables."""
    cfg = model.config
    routes: dict[tuple[int, str], torch.Tensor] = {}
    originals = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if not hasattr(attn, "route"):
            continue
        orig = attn.route
        originals.append((attn, orig))

        def spy(x, side, *rest, _i=i, _orig=orig):
            out = _orig(x, side, *rest)
            if out is not None:
                routes[(_i, side)] = out[0]
            return out

        attn.route = spy
    try:
        feed(be, cache, torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen).tolist())
    finally:
        for attn, _ in originals:
            del attn.route
    elt = 4
    weights = 0
    expert_names = {"w_v", "w_o", "w_k", "w_q"}
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.startswith("embed."):
            weights += batch * cfg.d_model * elt  # only the rows of the fed tokens
        elif ".attn.pos." in name:
            continue  # replaced by the memoised table, counted below
        elif cfg.attention == "switchhead" and leaf in expert_names and p.dim() == 3:
            layer = int(name.split(".")[1])
            side = "v" if leaf in ("w_v", "w_k") else "o"
            n_sel = int(routes[(layer, side)].unique().numel())
            weights += n_sel * p[0].numel() * elt
        else:
            weights += p.numel() * elt
    pos_tables = 0
    if cfg.positional == "xl":
        heads = 1 if cfg.attention == "moa" else cfg.n_heads
        pos_tables = cfg.n_layers * 2 * cfg.chunk_len * heads * cfg.d_head * elt
    return {"weights": weights, "cache": cache.nbytes, "pos": pos_tables}


def against_table(rev: str, tokens: int, gen: torch.Generator) -> None:
    """Decode ms / step with the current PyTorch paths and with those of `rev`."""
    old = _paths_at(rev)
    current = torch_paths.forward, torch_paths.backward

    def use(paths) -> Callable[[], None]:
        return lambda: (setattr(torch_paths, "forward", paths[0]), setattr(torch_paths, "backward", paths[1]))

    title = f"PyTorch paths now and at {rev}"
    variant_table(title, {"current": use(current), f"@{rev}": use((old.forward, old.backward))}, tokens, gen)


def dispatch_table(tokens: int, gen: torch.Generator) -> None:
    """Decode ms / step with the op's implementation called directly where that is safe (`ops.project`, what the
    model does) and always through the custom op's dispatcher."""

    def use(fn) -> Callable[[], None]:
        return lambda: setattr(layers, "project", fn)

    variants = {"direct": use(ops.project), "dispatcher": use(ops.expert_projection)}
    variant_table("the op called directly and through its dispatcher", variants, tokens, gen)


def variant_table(title: str, variants: dict[str, Callable[[], None]], tokens: int, gen: torch.Generator) -> None:
    """Decode ms / step of the built-in model and switchhead-47m with each variant installed in turn, one step each:
    the cache window is fixed, so every step of a model costs the same whichever variant ran the step before. The
    first variant is the one left installed."""
    first, second = variants
    print(f"\n## decode ms / step, {title} (median of {tokens} steps each)")
    print(f"| model | batch | {first} | {second} | {first} / {second} |")
    print("|---|---|---|---|---|")
    models = {"built-in": load()[0], "switchhead-47m": build("switchhead-47m")}
    try:
        for name, model in models.items():
            be = TorchBackend(model)
            for batch in (1, 8):
                times: dict[str, list[float]] = {v: [] for v in variants}
                with torch.inference_mode():
                    cache = be.new_cache(batch)
                    feed(be, cache, torch.randint(0, model.config.vocab_size, (batch, 64), generator=gen).tolist())
                    for _ in range(tokens + 1):  # the first round warms up
                        for v, install in variants.items():
                            install()
                            times[v].append(time_decode(be, cache, batch, 1, gen))
                a, b = (statistics.median(ts[1:]) * 1e3 for ts in times.values())
                print(f"| {name} | {batch} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)
    finally:
        variants[first]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens for the cached-vs-recompute table")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per configuration")
    ap.add_argument("--recompute-steps", type=int, default=3, help="full forwards timed for the recompute row")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    ap.add_argument("--against", metavar="REV", help="only time decode steps beside the PyTorch paths of REV")
    ap.add_argument("--dispatch", action="store_true", help="only time decode steps with the op called directly "
                    "(as the model does where that is safe) and through the custom op's dispatcher")
    args = ap.parse_args()
    for name in ("context", "tokens", "recompute_steps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"# machine: {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.1f} at start")
    if args.against:
        against_table(args.against, args.tokens, gen)
        return
    if args.dispatch:
        dispatch_table(args.tokens, gen)
        return
    bw = copy_bandwidth()
    print(f"# memory copy bandwidth (read + write): {bw / 1e9:.1f} GB/s")

    # 1. cached vs recompute at `context` tokens
    model = build("switchhead-47m")
    be = TorchBackend(model)
    ctx = torch.randint(0, model.config.vocab_size, (1, args.context), generator=gen)
    with torch.inference_mode():
        # The first forward of a fresh model pays one-off setup (allocations, position tables) several times the
        # prefill itself: warm up on a cache that is thrown away, then time the prefill.
        feed(be, be.new_cache(1), [ctx[0].tolist()])
        t = time.perf_counter()
        cache = be.new_cache(1)
        feed(be, cache, [ctx[0].tolist()])
        prefill_s = time.perf_counter() - t
        cached_s = time_decode(be, cache, 1, args.tokens, gen)
        rec = []
        ids = ctx
        for _ in range(args.recompute_steps):
            t = time.perf_counter()
            logits = model(ids)[0][:, -1]
            rec.append(time.perf_counter() - t)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        recompute_s = sorted(rec)[len(rec) // 2]
    print(f"\n## cached vs recompute, switchhead-47m, batch 1, {args.context} tokens of context "
          f"(prefill {args.context / prefill_s:.0f} tok/s)")
    print("| mode | ms / token | tokens/s |")
    print("|---|---|---|")
    print(f"| recompute (full forward each step) | {recompute_s * 1e3:.1f} | {1 / recompute_s:.2f} |")
    print(f"| KV cache | {cached_s * 1e3:.1f} | {1 / cached_s:.1f} |")
    print(f"| speed-up | | {recompute_s / cached_s:.1f}x |")

    # 2 + 3. switchhead vs transformer, batch 1 and 8, with roofline
    print("\n## decode, random weights, preset vocab (8000)")
    print("| model | batch | ms / step | tokens/s | cache B / token | bytes / step (weights + cache + pos) "
          "| achieved GB/s | % of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("switchhead-47m", "transformer-47m"):
        model = build(name)
        be = TorchBackend(model)
        for batch in (1, 8):
            with torch.inference_mode():
                cache = be.new_cache(batch)
                prompt = torch.randint(0, model.config.vocab_size, (batch, 64), generator=gen).tolist()
                feed(be, cache, prompt)
                step_s = time_decode(be, cache, batch, args.tokens, gen)
                b = touched_bytes(model, be, cache, batch, gen)
            total = b["weights"] + b["cache"] + b["pos"]
            achieved = total / step_s
            print(f"| {name} | {batch} | {step_s * 1e3:.1f} | {batch / step_s:.1f} | "
                  f"{kv_cache_bytes_per_token(model.config):,} | {b['weights'] / 1e6:.1f}M + {b['cache'] / 1e6:.1f}M + "
                  f"{b['pos'] / 1e6:.1f}M | {achieved / 1e9:.2f} | {100 * achieved / bw:.0f}% |")
    print(f"\n# load average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
