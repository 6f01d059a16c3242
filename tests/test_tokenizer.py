"""Tokenizer helpers: exact round-trip, digits split, EOS document separators."""


import re

import numpy as np
import pytest
from tiny import write_corpus

from switchhead.errors import SwitchheadError
from switchhead.model.tokenizer import (
    MIN_VOCAB_SIZE,
    encode_documents,
    encode_file,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
    unwrap_paragraphs,
)


def _corpus(path, n_lines=400, seed=0):
    words = "the quick brown fox jumps over lazy dogs while birds sing in 2024 and 1999 trees".split()
    return write_corpus(path, words, n_lines, (4, 14), seed, end="\n")


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return train_tokenizer([_corpus(tmp_path_factory.mktemp("tok") / "a.txt")], vocab_size=400)


def test_round_trip_is_exact(sp):
    texts = [
        "the quick brown fox",
        "  two  spaces\n\nand a blank line\n",
        "unseen wörds: café, 漢字, emoji 🙂",
        "tabs\tand trailing space ",
    ]
    for text in texts:
        assert sp.decode(sp.encode(text)) == text


def test_digits_are_split(sp):
    ids = sp.encode("in 2024 we had 1999 trees and 31415 dogs")
    # Decode piece by piece (digits unseen in training come back as byte pieces such as <0x35>).
    pieces = [sp.decode([i]).strip() for i in ids]
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert "".join(digit_pieces) == "2024199931415", pieces
    assert all(len(p) == 1 for p in digit_pieces), pieces


def test_vocab_is_an_upper_bound_and_eos_is_separator(sp, tmp_path):
    assert 300 <= sp.get_piece_size() <= 400
    assert sp.eos_id() == 1 and sp.piece_to_id("\n") != sp.unk_id()
    ids = encode_documents(sp, ["the fox", "the dog"])
    assert ids.dtype == np.uint16
    eos = np.flatnonzero(ids == sp.eos_id())
    assert list(eos) == [len(sp.encode("the fox")), len(ids) - 1]
    assert sp.decode(ids[: eos[0]].tolist()) == "the fox"
    f = tmp_path / "doc.txt"
    f.write_text("a first paragraph\n\nand a second one")
    assert list(encode_file(sp, f)) == sp.encode(f.read_text()) + [sp.eos_id()]
    two = encode_file(sp, f, split_blank_lines=True)
    assert int((two == sp.eos_id()).sum()) == 2


def test_save_load_and_fingerprint(sp, tmp_path):
    save_tokenizer(sp, tmp_path / "t.model")
    again = load_tokenizer(tmp_path / "t.model")
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(sp)
    # Deterministic training: the same data gives the same tokenizer (DDP ranks and caches rely on it).
    retrained = train_tokenizer([_corpus(tmp_path / "b.txt")], vocab_size=400)
    assert tokenizer_fingerprint(retrained) == tokenizer_fingerprint(sp)


def test_bad_inputs(tmp_path):
    with pytest.raises(SwitchheadError, match="at least"):
        train_tokenizer([_corpus(tmp_path / "a.txt")], vocab_size=100)
    many = tmp_path / "many.txt"  # more distinct characters than the smallest vocabulary holds
    many.write_text("".join(chr(0x4E00 + i) for i in range(300)) + "\n")
    with pytest.raises(SwitchheadError, match=r"a vocab size of \d+ is too small for this text: its characters and "
                                              r"the special pieces need at least \d+ \(--vocab-size\)"):
        train_tokenizer([many], vocab_size=MIN_VOCAB_SIZE)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(SwitchheadError, match="no text"):
        train_tokenizer([empty], vocab_size=400)
    with pytest.raises(SwitchheadError, match="not found"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(SwitchheadError, match="not a SentencePiece model"):
        load_tokenizer(tmp_path / "junk.model")


def _unwrap_by_lines(text):
    """Reference: walk the lines; a blank (or whitespace-only) line ends a paragraph."""
    paragraphs, current = [], []
    for line in text.split("\n"):
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "one line",
        "It was a dark\nand stormy night;\nthe rain fell.\n",
        "Chapter 1\n\n\n\n   indented first line\n  continues here  \n\t\nNext para\n",
        "\n\n  leading blank lines\nthen text\n \n \ntrailing\n\n\n",
        " = Title = \n \n Some text . \n \n",  # WikiText layout is already one line per paragraph
    ],
)
def test_unwrap_paragraphs_matches_line_walk(text):
    from switchhead.model.tokenizer import unwrap_paragraphs

    assert unwrap_paragraphs(text) == _unwrap_by_lines(text)


def test_unwrap_paragraphs_random_text():
    from switchhead.model.tokenizer import unwrap_paragraphs

    rng = np.random.default_rng(0)
    pieces = np.array(["word", "two words", " ", "  ", "\t", "\n", "\n", "\n \n", "x."])
    for _ in range(200):
        text = "".join(rng.choice(pieces, size=rng.integers(0, 40)))
        got = unwrap_paragraphs(text)
        assert got == _unwrap_by_lines(text), repr(text)
        assert "\n\n\n" not in got and not got.startswith("\n")


def test_unwrapped_file_and_tokenizer(sp, tmp_path):
    from switchhead.model.tokenizer import unwrap_paragraphs

    path = tmp_path / "book.txt"
    path.write_text("the quick brown\nfox jumps over\nlazy dogs\n\nbirds sing\nin 2024\n")
    ids = encode_file(sp, path, unwrap=True)
    assert ids[-1] == sp.eos_id()
    assert sp.decode(ids[:-1].tolist()) == unwrap_paragraphs(path.read_text())
    assert sp.decode(ids[:-1].tolist()) == "the quick brown fox jumps over lazy dogs\n\nbirds sing in 2024"
    # Tokenizer training samples the joined paragraphs, not the wrapped lines.
    from switchhead.model.tokenizer import _training_sentences

    assert _training_sentences([path], 100, 0, unwrap=True) == ["the quick brown fox jumps over lazy dogs",
                                                                "birds sing in 2024"]
    assert len(_training_sentences([path], 100, 0)) == 5


def test_non_utf8_text_is_refused(sp, tmp_path):
    # Replacing bad bytes with U+FFFD would silently train on them; a binary file would pass for a few tokens.
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("the fox\nsaw a café".encode() + b" and a caf\xe9 \x80")
    expected = "latin1.txt: not valid UTF-8 (byte 0xe9 at offset 29, line 2)"
    with pytest.raises(SwitchheadError, match=re.escape(expected)):
        encode_file(sp, bad)
    with pytest.raises(SwitchheadError, match=re.escape(expected)):
        train_tokenizer([bad], vocab_size=400)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(SwitchheadError, match=re.escape("(byte 0x80 at offset 128, line 2)")):
        encode_file(sp, binary)


@pytest.mark.parametrize(
    "text",
    [
        "It was a dark\r\nand stormy night.\r\n\r\nThe rain fell\r\nhard.\r\n",
        "one\n \r\ntwo\n\x0c\nthree\n\u00a0\u3000\nfour\n\x0b\nfive",
        "\r\n\r\nlead\r\n\r\n\r\n",
    ],
)
def test_unwrap_paragraphs_any_whitespace_line_is_blank(text):
    from switchhead.model.tokenizer import unwrap_paragraphs

    assert unwrap_paragraphs(text) == _unwrap_by_lines(text)


def test_unwrap_crlf_book_keeps_paragraphs():
    from switchhead.model.tokenizer import unwrap_paragraphs

    text = "It was a dark\r\nand stormy night.\r\n\r\nThe rain fell\r\nhard.\r\n"
    assert unwrap_paragraphs(text) == "It was a dark and stormy night.\n\nThe rain fell hard."


def test_round_trip_of_arbitrary_unicode(sp):
    rng = np.random.default_rng(1)
    # Every code point but the surrogates (not text) and U+2581, which SentencePiece reads as its space mark.
    ranges = [(0, 0x80), (0x80, 0xD800), (0xE000, 0x110000)]
    for _ in range(300):
        lo, hi = ranges[rng.integers(3)]
        text = "".join(chr(c) for c in rng.integers(lo, hi, size=rng.integers(0, 30)) if c != 0x2581)
        text += rng.choice(["", "\n", "  \n\n\t", "\r\n"])
        assert sp.decode(sp.encode(text)) == text, repr(text)
    long_line = "the quick brown fox " * 5000 + "\x00\x1b[0m"
    assert sp.decode(sp.encode(long_line)) == long_line
    assert sp.decode(sp.encode("a \u2581 b")) == "a   b"


def test_one_path_is_one_file_and_values_of_the_wrong_kind_are_refused(sp, tmp_path):
    import sentencepiece as spm

    path = _corpus(tmp_path / "a.txt")
    # one str or Path is one training file (iterated, a str was its characters)
    assert train_tokenizer(str(path), vocab_size=400).serialized_model_proto() == sp.serialized_model_proto()
    assert train_tokenizer(path, vocab_size=400).serialized_model_proto() == sp.serialized_model_proto()
    # one str is one document, not one per character
    assert encode_documents(sp, ["the fox"]).tolist() == sp.encode("the fox") + [sp.eos_id()]
    empty = spm.SentencePieceProcessor()
    cases = [
        (lambda: train_tokenizer([path], vocab_size=400.0), "vocab size must be an integer of at least 300 "
                                                           "(byte fallback), got 400.0"),
        (lambda: train_tokenizer([path], vocab_size="400"), "got '400'"),
        (lambda: train_tokenizer([path], vocab_size=400, max_sentences=0), "max_sentences must be an integer >= 1"),
        (lambda: train_tokenizer([path], vocab_size=400, seed=1.5), "seed must be an integer"),
        (lambda: train_tokenizer([path], vocab_size=400, num_threads=0), "threads must be an integer"),
        (lambda: train_tokenizer([path], vocab_size=400, unwrap="no"), "unwrap must be True or False, got 'no'"),
        (lambda: train_tokenizer(5, vocab_size=400), "training files must be a file path"),
        (lambda: encode_documents(sp, "the fox"), "documents must be an iterable of texts (one str is not)"),
        (lambda: encode_documents(sp, ["a", 5]), "each document must be a str, got int"),
        (lambda: encode_documents(None, ["a"]), "the tokenizer must be a sentencepiece.SentencePieceProcessor"),
        (lambda: encode_documents(empty, ["a"]), "the tokenizer has no model loaded"),
        (lambda: encode_file(empty, path), "the tokenizer has no model loaded"),
        (lambda: encode_file(sp, path, unwrap="no"), "unwrap must be True or False"),
        (lambda: encode_file(sp, path, split_blank_lines="no"), "split_blank_lines must be True or False"),
        (lambda: encode_file(sp, None), "the text file must be a str or Path, got NoneType"),
        (lambda: save_tokenizer(empty, tmp_path / "empty.model"), "the tokenizer has no model loaded"),
        (lambda: save_tokenizer(sp, None), "the tokenizer path must be a str or Path"),
        (lambda: load_tokenizer(None), "the tokenizer path must be a str or Path, got NoneType"),
        (lambda: unwrap_paragraphs(None), "unwrap_paragraphs needs text (a str), got NoneType"),
    ]
    for call, message in cases:
        with pytest.raises(SwitchheadError, match=re.escape(message)):
            call()
    assert not (tmp_path / "empty.model").exists()  # an empty processor wrote a zero-byte model file
