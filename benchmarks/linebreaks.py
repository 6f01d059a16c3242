"""Why the built-in model scores poorly on running text: it expects hard-wrapped lines.

Prints (1) the loss per 128-token chunk of a book passage read the model's way (chunked, with XL memory)
and each chunk alone (no memory), and (2) on the first N LAMBADA passages: how often the line break is the
model's top prediction, the mean log-probability of the target word, and the same for the book passage.

    python benchmarks/linebreaks.py [--ckpt DIR] [--data ../shared/data] [--passages 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import switchhead
from switchhead.errors import SwitchheadError


def newline_top_share(logits: torch.Tensor, newline: int) -> float:
    return (logits.argmax(-1) == newline).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--data", default="../shared/data",
                    help="data folder with corpus/pride_and_prejudice.txt and evals/lambada/lambada_test.jsonl")
    ap.add_argument("--passages", type=int, default=200, help="score the first this many LAMBADA passages")
    args = ap.parse_args()
    if args.passages < 1:
        ap.error(f"--passages must be >= 1, got {args.passages}")
    book_file = Path(args.data) / "corpus" / "pride_and_prejudice.txt"
    lambada_file = Path(args.data) / "evals" / "lambada" / "lambada_test.jsonl"
    for path in (book_file, lambada_file):
        if not path.is_file():
            ap.error(f"--data {args.data}: no file {path}")
    try:
        model, sp = switchhead.load(args.ckpt)
    except SwitchheadError as e:
        ap.error(f"--ckpt {args.ckpt}: {e}")
    newline = sp.piece_to_id("\n")
    T = model.config.chunk_len

    book = book_file.read_text()[200_000:210_000]
    ids = sp.encode(book)[: 4 * T + 1]
    x, y = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
    with torch.no_grad():
        logits, _ = model(x)
        loss = F.cross_entropy(logits[0], y, reduction="none")
        print("book passage, loss per chunk with memory:", [round(loss[i:i + T].mean().item(), 3)
                                                            for i in range(0, 4 * T, T)])
        alone = [F.cross_entropy(model(x[:, i:i + T])[0][0], y[i:i + T]).item() for i in range(0, 4 * T, T)]
        print("book passage, loss per chunk alone:      ", [round(v, 3) for v in alone])
        print(f"book passage: line break is the top prediction at {newline_top_share(logits[0], newline):.1%} "
              "of positions")

        rows = [json.loads(line) for line in lambada_file.read_text().splitlines()[: args.passages]]
        shares, target_lp = [], []
        for r in rows:
            context, _ = r["text"].rsplit(" ", 1)
            c, full = sp.encode(context), sp.encode(r["text"])
            logits, _ = model(torch.tensor([[sp.eos_id()] + full[:-1]]))
            lp = logits[0].log_softmax(-1)
            shares.append(newline_top_share(logits[0], newline))
            target_lp.append(sum(lp[p, full[p]].item() for p in range(len(c), len(full))))
        print(f"LAMBADA ({len(rows)} passages): line break is the top prediction at "
              f"{sum(shares) / len(shares):.1%} of positions; mean target-word log-probability "
              f"{sum(target_lp) / len(target_lp):.2f}")


if __name__ == "__main__":
    main()
