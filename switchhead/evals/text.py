"""Held-out perplexity of a model on text files, measured as training's validation measures it.

Each file is one document followed by EOS, cut into contiguous lanes (more lanes: more tokens per forward, less
context for the tokens at each lane's start; never more lanes than the file has chunks) that are fed chunk by chunk with
the XL state carried over. Every token but the file's first is scored exactly once, so bits per byte divide the
loss of (almost) the whole file by its size. Works through the runtime's backends, so a checkpoint and its ONNX
export are scored by the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from switchhead.errors import SwitchheadError, brief, is_int
from switchhead.fileio import text_paths
from switchhead.model.tokenizer import check_tokenizer, encode_file
from switchhead.runtime import Backend
from switchhead.train.data import TokenStream, eval_lanes, stream_nll


def text_perplexity(backend, tokenizer, paths: str | Path | Sequence[str | Path], lanes: int, progress: bool = True,
                    *, unwrap: bool = False) -> list[dict]:
    """Per file: tokens scored, mean loss per token (nats), perplexity, and bits per byte (the summed loss over
    the file's UTF-8 bytes, comparable across tokenizers). `backend` is a runtime Backend (`logits` with state);
    `unwrap` joins hard-wrapped lines first, as `train --unwrap` does."""
    if not isinstance(backend, Backend):
        raise SwitchheadError(f"backend must be a switchhead.runtime Backend (wrap a model in TorchBackend(model)), "
                              f"got {type(backend).__name__}")
    check_tokenizer(tokenizer, backend.config.vocab_size, "tokenizer")
    if not is_int(lanes) or lanes < 1:
        raise SwitchheadError(f"lanes must be an integer >= 1, got {brief(lanes)}")
    rows = []
    for path in text_paths(paths, "paths"):
        stream = TokenStream([encode_file(tokenizer, path, unwrap=unwrap)])
        if len(stream) < 2:  # only the EOS after the text: the file's first token is context, never scored
            raise SwitchheadError(f"text file {path} is empty: no tokens to score")
        label = f"perplexity {path.name}" if progress else None
        chunk_len = backend.config.chunk_len
        nll, count = stream_nll(backend.logits, stream, lanes, chunk_len, progress=label)
        total = float(nll)
        loss = total / count
        rows.append({"file": str(path), "tokens": count, "lanes": eval_lanes(lanes, len(stream), chunk_len),
                     "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                     "bits_per_byte": total / math.log(2) / path.stat().st_size})
    return rows
