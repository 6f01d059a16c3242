"""SentencePiece tokenizer helpers shared by training, generation and evaluation.

Conventions every part of the package relies on:

- BPE with digits split into single pieces (as in the paper), byte fallback so that any text round-trips.
- Text is encoded as one string per document with the identity normaliser and whitespace kept verbatim, and
  ``"\\n"`` is a piece of its own, so ``decode(encode(text)) == text`` exactly (books keep their line breaks).
  The one exception is U+2581 (``▁``), SentencePiece's own mark for a space: it decodes as a space.
- Documents are *followed* by the EOS id (``sp.eos_id()``): in a token stream, EOS means "a new, unrelated
  document starts next". Generation from scratch primes with ``[eos]``; evaluation scores streams built with
  `encode_documents`.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece as spm

from switchhead.devices import check_threads
from switchhead.errors import SwitchheadError, check_flag, is_int
from switchhead.fileio import as_path, file_problem, read_utf8, text_paths, write_atomic

NEWLINE = "\n"
UNK_ID, EOS_ID = 0, 1
# Byte fallback needs 256 byte pieces plus the specials; below this a vocabulary cannot hold anything else.
MIN_VOCAB_SIZE = 300
DEFAULT_MAX_SENTENCES = 200_000
# SentencePiece skips longer "sentences" while training; we cut them instead so long paragraphs still count.
_MAX_SENTENCE_CHARS = 2000


# A paragraph break: a line break, then a line holding only whitespace (then any further blank lines).
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")


def unwrap_paragraphs(text: str) -> str:
    """Join hard-wrapped lines: each paragraph becomes one line, paragraphs stay separated by a blank line.

    Books from Project Gutenberg break lines every ~70 characters. Trained verbatim, a model spends its
    probability on line breaks that never occur in prompts or benchmark text, so training can opt into this.
    """
    if not isinstance(text, str):
        raise SwitchheadError(f"unwrap_paragraphs needs text (a str), got {type(text).__name__}")
    # CRLF (many Gutenberg books) and lone CR (old Mac files) break lines too; split on "\n" alone, a CR-only
    # file would be one paragraph that keeps every break.
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = (" ".join(line.strip() for line in p.split("\n") if line.strip()) for p in
                  _PARAGRAPH_BREAK.split(text))
    return "\n\n".join(p for p in paragraphs if p)


def check_tokenizer(sp: object, vocab_size: int, what: str = "the tokenizer",
                    error: type[SwitchheadError] = SwitchheadError) -> None:
    """A `SwitchheadError` unless `sp` is a loaded SentencePiece model that fits a vocabulary of `vocab_size`."""
    if not isinstance(sp, spm.SentencePieceProcessor):
        raise error(f"{what} must be a sentencepiece.SentencePieceProcessor (e.g. what load returns), got "
                    f"{type(sp).__name__}")
    if problem := vocab_mismatch(sp, vocab_size):
        raise error(f"{what} {problem}")


def _check_processor(sp: object) -> None:
    """A `SwitchheadError` unless `sp` is a SentencePiece processor with a model loaded (an empty one fails every
    call with SentencePiece's "Model is not initialized" and serialises to zero bytes)."""
    if not isinstance(sp, spm.SentencePieceProcessor):
        raise SwitchheadError(f"the tokenizer must be a sentencepiece.SentencePieceProcessor (e.g. what "
                              f"load_tokenizer returns), got {type(sp).__name__}")
    if not sp.serialized_model_proto():  # (get_piece_size would log an error line of SentencePiece's own)
        raise SwitchheadError("the tokenizer has no model loaded (load one with load_tokenizer or train one)")


def vocab_mismatch(sp: spm.SentencePieceProcessor, vocab_size: int) -> str | None:
    """Why `sp` cannot go with a model of `vocab_size` outputs (its ids would index the wrong embedding rows), as
    the end of a sentence naming the tokenizer; None if it can."""
    n = sp.get_piece_size()
    return None if n == vocab_size else f"has {n} pieces but the model's vocab_size is {vocab_size}"


def read_text(path: str | Path, *, unwrap: bool = False) -> str:
    """The text of a UTF-8 file; anything else is refused: replacing bad bytes would silently train on U+FFFD
    (and a binary file would look like a few tokens of text)."""
    check_flag(unwrap, "unwrap")
    text = read_utf8(as_path(path, "the text file"))  # without a leading byte-order mark (common in UTF-8 books)
    return unwrap_paragraphs(text) if unwrap else text


def _training_sentences(
    files: Iterable[str | Path], max_sentences: int, seed: int, unwrap: bool = False
) -> list[str]:
    """Non-blank lines of `files`, a seeded uniform sample of at most `max_sentences` of them."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for path in files:
        with io.StringIO(read_text(path, unwrap=unwrap)) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                for start in range(0, len(line), _MAX_SENTENCE_CHARS):
                    piece = line[start : start + _MAX_SENTENCE_CHARS]
                    seen += 1
                    # Reservoir sampling: the cap bounds memory and training time however big the corpus is.
                    if len(sample) < max_sentences:
                        sample.append(piece)
                    else:
                        j = rng.randrange(seen)
                        if j < max_sentences:
                            sample[j] = piece
    return sample


def train_tokenizer(
    files: Iterable[str | Path],
    vocab_size: int = 8000,
    *,
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    seed: int = 0,
    num_threads: int = 2,
    unwrap: bool = False,
) -> spm.SentencePieceProcessor:
    """Train a BPE tokenizer on (a sample of the lines of) `files`, read through `unwrap_paragraphs` if `unwrap`.

    `vocab_size` is an upper bound: on small corpora SentencePiece stops early, so read the real size from
    ``sp.get_piece_size()``. Use `save_tokenizer` to write the model file.
    """
    files = text_paths(files, "the tokenizer's training files")
    if not is_int(vocab_size) or vocab_size < MIN_VOCAB_SIZE:
        raise SwitchheadError(
            f"vocab size must be an integer of at least {MIN_VOCAB_SIZE} (byte fallback), got {vocab_size!r}"
        )
    if not is_int(max_sentences) or max_sentences < 1:  # 0 read as "the data files contain no text"
        raise SwitchheadError(f"max_sentences must be an integer >= 1, got {max_sentences!r}")
    if not is_int(seed):
        raise SwitchheadError(f"seed must be an integer, got {seed!r}")
    check_threads(num_threads)
    check_flag(unwrap, "unwrap")
    sentences = _training_sentences(files, max_sentences, seed, unwrap)
    if not sentences:
        raise SwitchheadError("cannot train a tokenizer: the data files contain no text")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            split_digits=True,
            byte_fallback=True,
            user_defined_symbols=[NEWLINE],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            # Small corpora cannot fill a large vocabulary; stop early rather than fail.
            hard_vocab_limit=False,
            character_coverage=1.0,
            unk_id=UNK_ID,
            eos_id=EOS_ID,
            bos_id=-1,
            pad_id=-1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=4 * _MAX_SENTENCE_CHARS,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        # Every character of the text gets a piece (character_coverage 1.0), so the vocabulary must hold them all;
        # SentencePiece's own message points to a trainer option the command line does not have.
        if short := re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e)):
            raise SwitchheadError(
                f"a vocab size of {short[1]} is too small for this text: its characters and the special pieces "
                f"need at least {short[2]} (--vocab-size)"
            ) from None
        raise SwitchheadError(f"tokenizer training failed: {e}") from None
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def save_tokenizer(sp: spm.SentencePieceProcessor, path: str | Path) -> None:
    """Write the model file atomically (temp file + rename)."""
    _check_processor(sp)  # an empty processor wrote a zero-byte file
    write_atomic(as_path(path, "the tokenizer path"), sp.serialized_model_proto())


def load_tokenizer(path: str | Path) -> spm.SentencePieceProcessor:
    path = as_path(path, "the tokenizer path")
    if problem := file_problem(path):
        raise SwitchheadError(f"tokenizer model not found: {path}" if problem == "not found" else
                              f"tokenizer model {path} is {problem}, not a SentencePiece model file")
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(path))
    except (OSError, RuntimeError) as e:
        raise SwitchheadError(f"not a SentencePiece model: {path} ({e})") from None
    if sp.eos_id() < 0:  # documents are followed by it in every token stream
        raise SwitchheadError(f"tokenizer {path} has no EOS piece (eos_id -1); switchhead needs one to separate "
                              "documents")
    return sp


def tokenizer_fingerprint(sp: spm.SentencePieceProcessor) -> str:
    """A content hash of the tokenizer: two processors with equal fingerprints encode identically."""
    return hashlib.sha256(sp.serialized_model_proto()).hexdigest()


def token_dtype(sp: spm.SentencePieceProcessor) -> np.dtype:
    return np.dtype(np.uint16 if sp.get_piece_size() <= np.iinfo(np.uint16).max + 1 else np.int32)


def encode(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """Token ids of `text` (no separator)."""
    return sp.encode(text)


def encode_documents(sp: spm.SentencePieceProcessor, documents: Iterable[str]) -> np.ndarray:
    """One token stream: every document's ids followed by EOS (the document separator)."""
    _check_processor(sp)
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Iterable):
        # iterated, one string would be as many documents as it has characters
        raise SwitchheadError(f"documents must be an iterable of texts (one str is not), got "
                              f"{type(documents).__name__}")
    documents = list(documents)
    for doc in documents:
        if not isinstance(doc, str):
            raise SwitchheadError(f"each document must be a str, got {type(doc).__name__}")
    parts = [np.asarray(sp.encode(doc) + [sp.eos_id()], dtype=token_dtype(sp)) for doc in documents]
    if not parts:
        return np.zeros(0, dtype=token_dtype(sp))
    return np.concatenate(parts)


def iter_documents(
    path: str | Path, *, split_blank_lines: bool = False, unwrap: bool = False
) -> Iterator[str]:
    """The documents of a text file: the whole file, or its blank-line separated blocks."""
    check_flag(split_blank_lines, "split_blank_lines")
    text = read_text(path, unwrap=unwrap)
    if not split_blank_lines:
        yield text
        return
    block: list[str] = []
    for line in text.split("\n"):
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def encode_file(
    sp: spm.SentencePieceProcessor, path: str | Path, *, split_blank_lines: bool = False, unwrap: bool = False
) -> np.ndarray:
    """The token stream of one file (a file is one document unless `split_blank_lines`)."""
    # encode_documents checks `sp` before it reads the file (iter_documents is lazy)
    return encode_documents(sp, iter_documents(path, split_blank_lines=split_blank_lines, unwrap=unwrap))
