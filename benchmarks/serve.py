"""Load test of `switchhead serve`: N concurrent clients on 127.0.0.1 for a bounded time.

    .venv/bin/python benchmarks/serve.py [--ckpt DIR] [--clients 8] [--duration 60] [--max-batch 8]
                                         [--max-tokens 32] [--stream] [--threads 1] [--json]

Starts the real server (`switchhead serve`, a subprocess, so its memory is measured alone) on a free loopback
port, warms it up, then lets every client send completion requests back to back until the time is up. Reports
requests/s, generated tokens/s, p50/p99 latency (and time to first token with --stream), failed requests, and
the server's RSS after warm-up and at the end. Without --ckpt it builds a tiny random-weight model with a small
SentencePiece vocabulary in a temporary directory.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

WORDS = "the quick brown fox jumps over lazy dogs while birds sing in trees near a river at dawn".split()


def tiny_checkpoint(out: Path) -> str:
    import sentencepiece as spm
    import torch

    import switchhead
    from switchhead import PRESETS, TransformerLM

    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=300, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        hard_vocab_limit=False, character_coverage=1.0, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size())).eval()
    with torch.no_grad():
        model.out.bias[sp.eos_id()] = -20.0  # every request generates exactly max_tokens: comparable runs
    return str(switchhead.save(out / "tiny", model, sp))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


class Client(threading.Thread):
    def __init__(self, url: str, seed: int, until: float, args):
        super().__init__(daemon=True)
        self.url, self.rng, self.until, self.args = url, random.Random(seed), until, args
        self.latency, self.ttft, self.tokens, self.failed, self.errors = [], [], 0, 0, []

    def body(self) -> dict:
        words = self.rng.randint(min(2, self.args.prompt_words), self.args.prompt_words)
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(words))
        return {"model": "tiny", "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0.8,
                "seed": self.rng.randrange(2**31), "stream": self.args.stream,
                "stream_options": {"include_usage": True} if self.args.stream else None}

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while time.monotonic() < self.until:
                t0 = time.perf_counter()
                try:
                    if self.args.stream:
                        first, n = None, 0
                        with c.stream("POST", "/v1/completions", json=self.body()) as r:
                            if r.is_error:
                                r.read()  # the server's reason, for the report
                            r.raise_for_status()
                            for line in r.iter_lines():
                                if line.startswith("data: {"):
                                    event = json.loads(line[6:])
                                    if first is None and event["choices"] and event["choices"][0]["text"]:
                                        first = time.perf_counter() - t0
                                    if event.get("usage"):
                                        n = event["usage"]["completion_tokens"]
                        if first is not None:
                            self.ttft.append(first)
                    else:
                        r = c.post("/v1/completions", json=self.body())
                        r.raise_for_status()
                        n = r.json()["usage"]["completion_tokens"]
                    self.latency.append(time.perf_counter() - t0)
                    self.tokens += n
                except Exception as e:  # counted and reported, the load goes on
                    self.failed += 1
                    error = f"HTTP {e.response.status_code}: {e.response.text}" if isinstance(
                        e, httpx.HTTPStatusError) else repr(e)
                    self.errors.append(error[:200])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=24, help="prompts of 2 to this many random words")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()
    for name in ("clients", "max_batch", "max_tokens", "prompt_words", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.duration <= 0:
        ap.error(f"--duration must be > 0 seconds, got {args.duration}")
    from switchhead.devices import MAX_THREADS

    if args.threads > MAX_THREADS:  # the server refuses it: say so here, not as "server did not start"
        ap.error(f"--threads must be at most {MAX_THREADS}, got {args.threads}")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or tiny_checkpoint(Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-c", "from switchhead.cli import main; main()", "serve", "--ckpt", ckpt,
               "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(args.max_batch),
               "--max-queue", str(max(64, args.clients)), "--model-name", "tiny", "--threads", str(args.threads),
               "--max-tokens", str(args.max_tokens)]  # its limit, so that it accepts every --max-tokens >= 1
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.monotonic()
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() - t0 > 60:
                    raise SystemExit(f"server did not start:\n{server.stderr.read() if server.stderr else ''}")
                time.sleep(0.1)
            warm = Client(url, 0, time.monotonic() + 3, args)
            warm.run()
            if warm.failed:  # the measured requests would fail the same way
                raise SystemExit(f"{warm.failed} of {warm.failed + len(warm.latency)} warm-up requests failed, "
                                 f"the first with {warm.errors[0]}")
            rss_before = rss_mib(server.pid)
            steps_before = httpx.get(url + "/health").json()["steps"]  # the counter includes the warm-up
            start = time.monotonic()
            clients = [Client(url, i + 1, start + args.duration, args) for i in range(args.clients)]
            for c in clients:
                c.start()
            for c in clients:
                c.join()
            wall = time.monotonic() - start
            rss_after = rss_mib(server.pid)
            steps = httpx.get(url + "/health").json()["steps"]
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()

    lat = [x for c in clients for x in c.latency]
    ttft = [x for c in clients for x in c.ttft]
    out = {
        "machine": f"{cpu_name()}, {os.cpu_count()} cpus, torch threads {args.threads}",
        "clients": args.clients, "max_batch": args.max_batch, "max_tokens": args.max_tokens,
        "stream": args.stream, "duration_s": round(wall, 1), "requests": len(lat),
        "failed": sum(c.failed for c in clients), "requests_per_s": round(len(lat) / wall, 2),
        "tokens_per_s": round(sum(c.tokens for c in clients) / wall, 1),
        "p50_latency_s": round(pct(lat, 0.5), 3), "p99_latency_s": round(pct(lat, 0.99), 3),
        "rss_before_mib": round(rss_before, 1), "rss_after_mib": round(rss_after, 1),
        "server_steps": steps - steps_before,
    }
    if ttft:
        out["p50_ttft_s"], out["p99_ttft_s"] = round(pct(ttft, 0.5), 3), round(pct(ttft, 0.99), 3)
    errors = [e for c in clients for e in c.errors][:5]
    if errors:
        out["first_errors"] = errors
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:16s} {v}")


if __name__ == "__main__":
    main()
