"""Tiny artefacts the tests build for themselves."""

import contextlib
import io
import os
import random
import resource
import signal

import pytest
import sentencepiece as spm

WORDS = "the quick brown fox jumps over lazy dogs while birds sing in trees near a river at dawn".split()


def word_tokenizer(words: list[str] = WORDS, vocab_size: int = 300) -> spm.SentencePieceProcessor:
    """A BPE over 300 random sentences of `words`, with switchhead.model.tokenizer's conventions (byte fallback,
    verbatim whitespace, EOS id 1)."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        hard_vocab_limit=False, character_coverage=1.0, unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_corpus(path, words: list[str], n_lines: int, per_line: int | tuple[int, int], seed: int = 0,
                 end: str = ""):
    """A text file of `n_lines` random lines of `words` (`per_line` words, or a random count in a range)."""
    rng = random.Random(seed)
    lo, hi = per_line if isinstance(per_line, tuple) else (per_line, per_line)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi) if lo != hi else lo))
             for _ in range(n_lines)]
    path.write_text("\n".join(lines) + end)
    return path


# For tests of allocations refused because they exceed Linux's MemAvailable, read here independently of
# switchhead.devices.
needs_meminfo = pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's MemAvailable")


def batch_past_available_memory(row_bytes: int) -> int:
    """The smallest batch of `row_bytes` rows that exceeds the memory available now by 5 % (more than other
    processes free while the test runs), so that it must be refused and can never be allocated."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return int(available * 1.05) // row_bytes + 1


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` into any file fail with EFBIG ("File too large"), as a full disk fails them with
    ENOSPC, for the body's duration: the kernel's own refusal, no patched writer (RLIMIT_FSIZE, its signal ignored
    so that the write returns the error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
