"""Small-scale replication of the paper's Table 2 (WikiText-103 block): SwitchHead vs parameter-matched dense
Transformer-XL baselines, trained on the same tokens for the same steps, compared on held-out perplexity.

Models (all pre-LN Transformer-XL with one memory chunk, same d_model / layers / d_ff / tokenizer):
  switchhead      2 heads, E=5 experts per head, k=2 active (MoE value and output projections)
  dense-10head    dense XL attention with H*E = 10 heads, d_head solved to match the parameters
  dense-2head     dense XL attention with 2 heads, d_head solved to match the parameters

Training uses `switchhead.train` (the same code as `switchhead train`) on ../shared/data/corpus; perplexity is
per SentencePiece token on ../shared/data/heldout/wikitext103_valid.tokens.txt (WikiText-103 valid), with XL
memory carried over the whole held-out stream. Each run is a separate process so its peak RSS is its own.

    python benchmarks/replicate.py --out bench/replicate            # the full run (about an hour on 2 cores)
    python benchmarks/replicate.py --out /tmp/smoke --smoke         # end-to-end check in a minute or two

Writes OUT/results.json and OUT/results.md (the table for docs/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHARED = REPO.parent / "shared" / "data"
DEFAULT_CORPUS = SHARED / "corpus"
DEFAULT_HELDOUT = SHARED / "heldout" / "wikitext103_valid.tokens.txt"
MATCH_TOLERANCE = 0.02
MODELS = ("switchhead", "dense-10head", "dense-2head")  # the keys of build_configs(), for --only before any work


def build_configs(d_model: int, n_layers: int, d_ff: int, d_head: int, chunk_len: int, vocab_size: int,
                  dropout: float, grad_clip: float) -> dict:
    """The three configurations, the baselines' d_head solved so that total parameters match SwitchHead's."""
    from switchhead.model.accounting import count_params, match_params
    from switchhead.model.config import ModelConfig

    common = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, d_ff=d_ff, chunk_len=chunk_len,
                  mem_chunks=1, dropout=dropout, grad_clip=grad_clip)
    sh = ModelConfig(name="switchhead", attention="switchhead", n_heads=2, d_head=d_head, n_experts=5, k=2,
                     **common)
    configs = {"switchhead": sh}
    for name, heads in (("dense-10head", 10), ("dense-2head", 2)):
        base = ModelConfig(name=name, attention="dense", n_heads=heads, d_head=8, **common)
        configs[name] = match_params(base, sh, field="d_head")
    target = count_params(sh)["total"]
    for name, cfg in configs.items():
        got = count_params(cfg)["total"]
        if abs(got - target) > MATCH_TOLERANCE * target:
            raise SystemExit(f"{name}: {got} parameters, not within {MATCH_TOLERANCE:.0%} of {target}")
    return configs


def _worker(spec_path: str) -> None:
    """Run one training in this process and record its peak memory (called via --worker)."""
    from switchhead.model.config import ModelConfig
    from switchhead.train import TrainOptions, train

    spec = json.loads(Path(spec_path).read_text())
    opts = spec["options"]
    opts["config"] = ModelConfig.from_dict(opts["config"])
    t0 = time.time()
    result = train(TrainOptions(**opts))
    if result.interrupted:  # checkpoint saved; no result, so a rerun resumes this model instead of skipping it
        raise SystemExit(f"interrupted at step {result.step}; rerun the same command to resume")
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(spec["result"]).write_text(json.dumps({
        "wall_s": time.time() - t0, "peak_rss_mib": peak_kib / 1024, "val_ppl": result.val_ppl,
        "last_loss": result.last_loss, "step": result.step}))


def _from_metrics(out: Path, tokens_per_step: int, steps: int) -> dict:
    """Step time, training time and late training loss of one run, from its metrics.jsonl (one read)."""
    logs = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tokens_per_s" in m]
    step_s = [(m["step"], tokens_per_step / m["tokens_per_s"]) for m in logs]
    per_step = [t for _, t in step_s[1:]]  # the first interval includes warm-up
    late = [m["loss"] for m in logs if m["step"] > 0.9 * steps]  # less noisy than the last log alone
    return {
        "step_time_s": statistics.median(per_step) if per_step else float("nan"),
        "train_minutes": sum((s - prev) * t for (prev, _), (s, t) in zip([(0, 0.0)] + step_s, step_s)) / 60,
        "late_train_loss": statistics.mean(late) if late else float("nan"),
    }


def _fmt(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="folder of .txt training files")
    p.add_argument("--heldout", type=Path, default=DEFAULT_HELDOUT)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--chunk-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--d-head", type=int, default=48, help="SwitchHead's d_head (baselines are matched to it)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--eval-batch-size", type=int, default=64, help="lanes of the held-out stream")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="autocast dtype (bfloat16 is several times faster on CPUs with AVX512-BF16/AMX)")
    p.add_argument("--no-unwrap", dest="unwrap", action="store_false",
                   help="tokenize the hard-wrapped books verbatim instead of one line per paragraph")
    p.add_argument("--only", nargs="*", choices=MODELS, metavar="MODEL",
                   help=f"run only these models ({', '.join(MODELS)})")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and few steps: checks the pipeline only")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = ("steps", "batch_size", "chunk_len", "d_model", "layers", "d_ff", "d_head", "vocab_size", "eval_batch_size")
    for name in sizes:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.worker:
        _worker(args.worker)
        return
    if args.smoke:
        args.steps, args.batch_size, args.chunk_len, args.warmup = 12, 4, 32, 2
        args.d_model, args.layers, args.d_ff, args.d_head, args.vocab_size = 64, 2, 128, 16, 1000

    from switchhead.model.accounting import attention_macs, attention_memory, count_params
    from switchhead.model.tokenizer import save_tokenizer, train_tokenizer
    from switchhead.train.data import load_stream

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = sorted(str(f) for f in args.corpus.glob("*.txt"))
    if not data:
        raise SystemExit(f"no .txt files in {args.corpus}")
    heldout = [str(args.heldout)]
    if args.smoke:  # the first 2 books and 30 kB of held-out text keep the check to a minute or two
        data = data[:2]
        short = out / "heldout-smoke.txt"
        short.write_text(args.heldout.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
        heldout = [str(short)]

    # One tokenizer for all three models, so their perplexities are per the same tokens.
    tok = out / "tokenizer.model"
    if not tok.is_file():
        t0 = time.time()
        save_tokenizer(train_tokenizer(data, args.vocab_size, seed=args.seed, unwrap=args.unwrap), tok)
        print(f"tokenizer: {time.time() - t0:.1f}s", flush=True)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tok))
    vocab = sp.get_piece_size()
    configs = build_configs(args.d_model, args.layers, args.d_ff, args.d_head, args.chunk_len, vocab,
                            args.dropout, args.grad_clip)
    names = args.only or list(configs)
    results = {}
    for name in names:
        cfg = configs[name]
        run_dir = out / name
        result_file = out / f"{name}.result.json"
        if not result_file.is_file():
            spec = {"result": str(result_file), "options": {
                "config": cfg.to_dict(), "data": data, "eval_data": heldout, "out": str(run_dir),
                "tokenizer": str(tok), "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
                "warmup": args.warmup, "eval_every": args.steps, "eval_batch_size": args.eval_batch_size,
                "save_every": max(1, args.steps // 4),
                "log_every": max(1, min(50, args.steps // 10)), "seed": args.seed, "device": "cpu",
                "dtype": args.dtype, "unwrap": args.unwrap,
                "cache_dir": str(out / "cache"), "progress": True, "resume": run_dir.exists()}}
            spec_file = out / f"{name}.spec.json"
            spec_file.write_text(json.dumps(spec, indent=1))
            print(f"== {name}: {count_params(cfg)['total']:,} parameters, d_head {cfg.d_head}", flush=True)
            run = subprocess.run([sys.executable, __file__, "--out", str(out), "--worker", str(spec_file)])
            if run.returncode:
                raise SystemExit(f"{name}: training stopped (exit code {run.returncode}); rerun to resume")
        r = json.loads(result_file.read_text())
        params = count_params(cfg)
        results[name] = {
            "config": cfg.to_dict(),
            "params_total": params["total"],
            "params_attention": params["attention"],
            "attention_macs_per_layer": attention_macs(cfg),
            "attention_floats_per_layer": attention_memory(cfg),
            "val_ppl": r["val_ppl"],
            "final_train_loss": r["last_loss"],
            **_from_metrics(run_dir, args.batch_size * args.chunk_len, args.steps),
            "peak_rss_mib": r["peak_rss_mib"],
            "wall_s": r["wall_s"],
        }
    meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "tokens_per_run": args.steps * args.batch_size * args.chunk_len, "vocab_size": vocab,
            "corpus_tokens": len(load_stream(sp, data, out / "cache", unwrap=args.unwrap)),
            "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} CPUs",
            "torch": __import__("torch").__version__}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = render(results, meta)
    (out / "results.md").write_text(table)
    print(table)


def render(results: dict, meta: dict) -> str:
    rows = ["| model | heads x d_head | E / k | params (total) | attn params | attn MACs/layer | "
            "attn floats/layer | held-out ppl | train loss (last 10% of steps) | CPU step time | training time | "
            "peak RSS |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        c = r["config"]
        ek = f"{c['n_experts']} / {c['k']}" if c["attention"] == "switchhead" else "-"
        rows.append(f"| {name} | {c['n_heads']} x {c['d_head']} | {ek} | {r['params_total']:,} | "
                    f"{_fmt(r['params_attention'])} | {_fmt(r['attention_macs_per_layer'])} | "
                    f"{_fmt(r['attention_floats_per_layer'])} | {r['val_ppl']:.2f} | {r['late_train_loss']:.3f} | "
                    f"{r['step_time_s'] * 1000:.0f} ms | {r['train_minutes']:.1f} min | {r['peak_rss_mib']:.0f} MiB |")
    a = meta["args"]
    return ("\n".join(rows) + "\n\n"
            f"d_model {a['d_model']}, {a['layers']} layers, d_ff {a['d_ff']}, T={a['chunk_len']} with one memory "
            f"chunk, batch {a['batch_size']}, {a['steps']} steps ({meta['tokens_per_run']:,} tokens per model, of a "
            f"{meta['corpus_tokens']:,}-token corpus), "
            f"vocab {meta['vocab_size']}, lr {a['lr']} (warm-up {a['warmup']}, cosine), dropout {a['dropout']}, "
            f"{a['dtype']} autocast, {'unwrapped' if a['unwrap'] else 'verbatim'} text; "
            f"{meta['machine']}, torch {meta['torch']}. MACs/floats: the paper's per-layer formulas "
            "for one T-token sequence with C=2 chunks of context.\n")


if __name__ == "__main__":
    main()
