"""Token cache and lane batching: lanes are contiguous and the XL memory carries across steps."""


import numpy as np
import pytest
import torch
from tiny import write_corpus

from switchhead.errors import SwitchheadError
from switchhead.model.config import PRESETS
from switchhead.model.lm import TransformerLM
from switchhead.model.tokenizer import train_tokenizer, unwrap_paragraphs
from switchhead.train.data import (
    IGNORE,
    LaneBatcher,
    TokenStream,
    cached_tokens,
    eval_chunks,
    eval_lanes,
    load_stream,
)


def _corpus(path, n_lines=300, seed=0):
    return write_corpus(path, "alpha beta gamma delta epsilon zeta eta theta iota kappa 12 345".split(), n_lines, 10,
                        seed)


def test_stream_concatenates_parts_across_boundaries():
    s = TokenStream([np.arange(0, 5), np.arange(5, 7), np.zeros(0, dtype=np.int64), np.arange(7, 20)])
    assert len(s) == 20
    assert s.slice(3, 12).tolist() == list(range(3, 12))
    assert s.slice(0, 20).tolist() == list(range(20))
    with pytest.raises(IndexError):
        s.slice(10, 21)


def test_lanes_are_contiguous_and_cover_the_stream():
    stream = TokenStream([np.arange(1000)])
    b = LaneBatcher(stream, n_lanes=4, chunk_len=7)
    assert b.lane_len == 250 and b.steps_per_epoch == (250 - 1) // 7
    for step in range(b.steps_per_epoch - 1):
        x, y = b.batch(step)
        nx, _ = b.batch(step + 1)
        assert x.shape == (4, 7)
        assert (y[:, :-1] == x[:, 1:]).all() and (y == x + 1).all()  # targets are the next tokens
        # Lane b at step t+1 starts exactly where step t ended.
        assert (nx[:, 0] == x[:, -1] + 1).all()
        assert (x[:, 0] == np.arange(4) * 250 + step * 7).all()
    # The next epoch starts every lane over.
    assert (b.batch(b.steps_per_epoch)[0] == b.batch(0)[0]).all()
    # A DDP rank's lanes are the same rows as in the global batch.
    part = LaneBatcher(stream, n_lanes=4, chunk_len=7, lanes=(2, 3))
    assert (part.batch(5)[0] == b.batch(5)[0][2:]).all()


@pytest.mark.parametrize("n, lanes, chunk_len", [(56, 4, 7), (60, 4, 7), (57, 4, 7), (1003, 3, 5), (18, 2, 8),
                                                 (19, 2, 8)])
def test_every_step_stays_inside_its_lane(n, lanes, chunk_len):
    # Lane lengths that are a multiple of chunk_len (and one more) are where an epoch of one step too many reads
    # the next lane's first token, or past the end of the stream, as the last target.
    stream = TokenStream([np.arange(n)])
    b = LaneBatcher(stream, n_lanes=lanes, chunk_len=chunk_len)
    lane_len = n // lanes
    assert b.lane_len == lane_len
    # A naive walk: as many whole steps of chunk_len inputs + 1 target as fit inside each lane.
    steps, start = 0, 0
    while start + chunk_len + 1 <= lane_len:
        steps, start = steps + 1, start + chunk_len
    assert b.steps_per_epoch == steps
    for step in range(steps):
        x, y = b.batch(step)
        for lane in range(lanes):
            first = lane * lane_len + step * chunk_len
            assert x[lane].tolist() == list(range(first, first + chunk_len))
            assert y[lane].tolist() == list(range(first + 1, first + chunk_len + 1))
            assert y[lane, -1] < (lane + 1) * lane_len  # never the next lane's tokens
    assert (b.batch(steps)[0] == b.batch(0)[0]).all()  # then the next epoch


def test_data_shorter_than_one_batch_is_refused():
    with pytest.raises(SwitchheadError, match="too short"):
        LaneBatcher(TokenStream([np.arange(50)]), n_lanes=4, chunk_len=16)


def test_memory_carries_across_steps(tmp_path):
    """Feeding lane chunks step by step with the returned memory equals one long forward over each lane."""
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"]).eval()
    stream = TokenStream([np.random.default_rng(0).integers(0, 512, 700)])
    b = LaneBatcher(stream, n_lanes=3, chunk_len=16)
    steps = 4
    with torch.no_grad():
        memory, chunks = None, []
        for step in range(steps):
            x, _ = b.batch(step)
            logits, memory = model(torch.from_numpy(x), memory)
            chunks.append(logits)
        stepped = torch.cat(chunks, 1)
        lanes = torch.from_numpy(
            np.stack([stream.slice(i * b.lane_len, i * b.lane_len + steps * 16) for i in range(3)])
        )
        whole, _ = model(lanes)  # the model itself chunks long inputs, carrying memory
        fresh = torch.cat([model(torch.from_numpy(b.batch(s)[0]))[0] for s in range(steps)], 1)
    torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)
    # ...and the memory matters: without it the later chunks differ.
    assert not torch.allclose(stepped[:, 16:], fresh[:, 16:], atol=1e-3)


@pytest.mark.parametrize("n, lanes, chunk_len", [(103, 4, 8), (100, 4, 8), (9, 4, 2), (2, 4, 8), (103, 64, 8),
                                                 (6462, 64, 128)])
def test_eval_chunks_score_every_token_but_the_first_once(n, lanes, chunk_len):
    stream = TokenStream([np.arange(10, 10 + n)])
    chunks = list(eval_chunks(stream, n_lanes=lanes, chunk_len=chunk_len))
    assert all(x.shape == y.shape and x.shape[1] <= chunk_len for x, y in chunks)
    inputs = np.concatenate([x for x, _ in chunks], axis=1)
    targets = np.concatenate([y for _, y in chunks], axis=1)
    scored = targets[targets != IGNORE]
    assert sorted(scored.tolist()) == list(range(11, 10 + n))  # every token but the first, once
    n_lanes = eval_lanes(lanes, n, chunk_len)
    assert targets.shape[0] == n_lanes <= lanes
    # Never more lanes than the stream has chunks of targets, and none is empty.
    assert n_lanes <= -(-(n - 1) // chunk_len)
    assert ((targets != IGNORE).sum(1) > 0).all()
    # Each target follows its input (padding only at the end of the last lane), so the lane's inputs are its
    # true preceding text.
    real = targets != IGNORE
    assert (targets[real] == inputs[real] + 1).all()
    assert all(not real[b, i] or real[b, :i].all() for b in range(n_lanes) for i in range(targets.shape[1]))
    # Split across two ranks, the lanes are disjoint and complete.
    both = [list(eval_chunks(stream, lanes, chunk_len, lanes=range(r, n_lanes, 2))) for r in (0, 1)]
    assert sum(c[0][0].shape[0] for c in both if c) == n_lanes


def test_eval_chunks_refuse_a_stream_without_targets():
    with pytest.raises(SwitchheadError, match="too short: 1 tokens"):
        list(eval_chunks(TokenStream([np.arange(1)]), 4, 8))


def test_token_cache_is_keyed_by_content_and_tokenizer(tmp_path):
    data = _corpus(tmp_path / "a.txt")
    sp = train_tokenizer([data], vocab_size=350)
    cache = tmp_path / "cache"
    first = cached_tokens(sp, data, cache)
    assert isinstance(first, np.memmap)
    assert list(first) == sp.encode(data.read_text()) + [sp.eos_id()]
    assert len(list(cache.glob("*.npy"))) == 1
    cached_tokens(sp, data, cache)
    assert len(list(cache.glob("*.npy"))) == 1  # reused
    data.write_text(data.read_text() + "\nomega")
    again = cached_tokens(sp, data, cache)
    assert len(list(cache.glob("*.npy"))) == 2 and len(again) > len(first)  # content change -> new entry
    other_sp = train_tokenizer([data], vocab_size=320)
    cached_tokens(other_sp, data, cache)
    assert len(list(cache.glob("*.npy"))) == 3  # tokenizer change -> new entry
    # Two files: each followed by EOS in one stream.
    b = tmp_path / "b.txt"
    b.write_text("beta gamma")
    s = load_stream(sp, [data, b], cache)
    assert len(s) == len(again) + len(sp.encode("beta gamma")) + 1
    assert s.slice(len(s) - 1, len(s))[0] == sp.eos_id()
    # Unwrapped text is a separate entry holding the joined paragraphs.
    wrapped = cached_tokens(sp, data, cache, unwrap=True)
    assert len(list(cache.glob("*.npy"))) == 5  # a.txt x 3 keys, b.txt, and this one
    assert list(wrapped) == sp.encode(unwrap_paragraphs(data.read_text())) + [sp.eos_id()]
    assert sp.piece_to_id("\n") not in wrapped and sp.piece_to_id("\n") in again


def test_data_directory_stands_for_its_txt_files(tmp_path):
    from switchhead.errors import SwitchheadError
    from switchhead.train.data import check_data_files

    (tmp_path / "b.txt").write_text("second book")
    (tmp_path / "a.txt").write_text("first book")
    (tmp_path / "notes.md").write_text("not data")
    assert check_data_files([tmp_path]) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SwitchheadError, match="no .txt files"):
        check_data_files([empty])


def test_data_files_must_be_utf8(tmp_path):
    from switchhead.train.data import check_data_files

    # Read in 1 MiB blocks: a character split by a block boundary is fine, and a bad byte past the first block
    # is reported at its offset in the file.
    big = tmp_path / "big.txt"
    head = b"a" * ((1 << 20) - 1) + "é".encode() + b"\nxyz"
    big.write_bytes(head + b"\xff tail")
    with pytest.raises(SwitchheadError, match=rf"big.txt: not valid UTF-8 \(byte 0xff at offset {len(head)}, line 2\)"):
        check_data_files([big])
    big.write_bytes(head)
    assert check_data_files([big]) == [big]
    cut = tmp_path / "cut.txt"  # ends inside a character
    cut.write_bytes(b"text\n\n" + "€".encode()[:2])
    with pytest.raises(SwitchheadError, match=r"cut.txt: not valid UTF-8 \(byte 0xe2 at offset 6, line 3\)"):
        check_data_files([cut])
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b" \n\t\n")
    with pytest.raises(SwitchheadError, match="empty"):
        check_data_files([blank])
    blank.write_text("\ufeff\u00a0\u3000\n\u2028\x1c", encoding="utf-8")  # Unicode's whitespace: no text either
    with pytest.raises(SwitchheadError, match="empty"):
        check_data_files([blank])


def test_unusable_token_cache_is_a_one_line_error(tmp_path, sp):
    data = _corpus(tmp_path / "a.txt", n_lines=20)
    cache = tmp_path / "cache"
    cache.write_text("a file, not a directory")
    with pytest.raises(SwitchheadError, match=f"cannot write the token cache in {cache}"):
        cached_tokens(sp, data, cache)
    assert cache.read_text() == "a file, not a directory"


@pytest.mark.parametrize("damage", ["cut mid-way", "cut in the header", "garbled", "other dtype", "empty file",
                                    "no tokens", "cut by its header"])
def test_damaged_token_cache_entry_is_a_one_line_error(tmp_path, sp, damage):
    data = _corpus(tmp_path / "a.txt", n_lines=20)
    cache = tmp_path / "cache"
    ids = cached_tokens(sp, data, cache).copy()
    (entry,) = cache.glob("*.npy")
    raw = entry.read_bytes()
    # "empty file": what a crash between the write and the disk leaves (numpy raised EOFError, which click
    # reports as "Aborted!"); "no tokens" and "cut by its header" (a rewritten shape) passed as token arrays.
    entry.write_bytes({"cut mid-way": raw[: len(raw) // 2], "cut in the header": raw[:60], "garbled": b"x" * len(raw)}
                      .get(damage, b""))
    if damage in ("other dtype", "no tokens", "cut by its header"):
        np.save(entry, {"other dtype": np.zeros(10, dtype=np.float64), "no tokens": ids[:0],
                        "cut by its header": ids[:-3]}[damage])
    with pytest.raises(SwitchheadError, match=f"the token cache entry {entry} is damaged") as e:
        cached_tokens(sp, data, cache)
    assert "\n" not in str(e.value)


def test_token_cache_entries_are_written_through_temporaries_of_their_own(tmp_path, sp, monkeypatch):
    """Two builders of one entry whose PIDs are equal (containers sharing a cache volume) wrote one temporary,
    each truncating the other's tokens, and renamed it into place half written."""
    data = _corpus(tmp_path / "a.txt", n_lines=20)
    cache = tmp_path / "cache"
    want = cached_tokens(sp, data, tmp_path / "reference").copy()
    real_save = np.save

    def save(f, arr):  # another builder (of this PID, as in another container) runs while this one writes
        with monkeypatch.context() as m:
            m.setattr(np, "save", real_save)
            assert np.array_equal(cached_tokens(sp, data, cache), want)
        real_save(f, arr)

    monkeypatch.setattr(np, "save", save)
    assert np.array_equal(cached_tokens(sp, data, cache), want)
    (entry,) = cache.iterdir()  # no temporary left
    assert np.array_equal(np.load(entry), want)


def test_a_directory_reached_twice_is_found_under_its_first_path_in_order(tmp_path):
    """os.walk lists in the file system's order: which name a linked directory got (so where its files came in the
    documents' order) differed between copies of one tree."""
    from switchhead.train.data import check_data_files

    for i in range(8):
        root = tmp_path / f"t{i}"
        real, link = (f"{i}-real", f"{i}-link") if i % 2 else (f"{i}-a-real", f"{i}-b-link")
        (root / real).mkdir(parents=True)
        (root / real / "f.txt").write_text("linked")
        (root / "m.txt").write_text("main")
        (root / link).symlink_to(root / real)
        first = min(real, link)
        assert check_data_files([root], "training data") == [root / first / "f.txt", root / "m.txt"], i


def test_data_directory_includes_subdirectories_and_skips_hidden_ones(tmp_path):
    from switchhead.train.data import check_data_files

    books = tmp_path / "books"
    (books / "austen").mkdir(parents=True)
    (books / "a.txt").write_text("first book")
    (books / "austen" / "emma.txt").write_text("nested book")
    (books / ".ipynb_checkpoints").mkdir()
    (books / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("a copy")
    (books / "._a.txt").write_bytes(b"\x00\x05\x16\x07 metadata")
    (books / "austen" / "up").symlink_to("..")  # a loop: walked once, not forever
    assert check_data_files([books]) == [books / "a.txt", books / "austen" / "emma.txt"]
    (books / "gone.txt").symlink_to("nowhere.txt")
    with pytest.raises(SwitchheadError, match="dangling or looping symbolic link: .*gone.txt"):
        check_data_files([books])
    with pytest.raises(SwitchheadError, match="is not a regular file: /dev/null"):
        check_data_files(["/dev/null"])


def test_byte_order_mark_is_not_text(tmp_path, sp):
    from switchhead.train.data import check_data_files

    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("the quick brown fox\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    for unwrap in (False, True):
        assert list(cached_tokens(sp, marked, tmp_path / "cache", unwrap=unwrap)) == list(
            cached_tokens(sp, plain, tmp_path / "cache", unwrap=unwrap))
    only = tmp_path / "only.txt"
    only.write_bytes(b"\xef\xbb\xbf\n")
    with pytest.raises(SwitchheadError, match="empty"):
        check_data_files([only])


def test_unwrap_reads_every_line_break_convention():
    for nl in ("\n", "\r\n", "\r"):
        text = nl.join(["The first", "paragraph.", "", "The second", "one.", ""])
        assert unwrap_paragraphs(text) == "The first paragraph.\n\nThe second one."


def test_tokenizer_without_eos_is_refused(tmp_path):
    import io

    import sentencepiece as spm

    from switchhead.model.tokenizer import load_tokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["alpha beta gamma"] * 50), model_writer=model,
                                   vocab_size=30, hard_vocab_limit=False, eos_id=-1, bos_id=-1, minloglevel=2)
    path = tmp_path / "noeos.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(SwitchheadError, match=f"tokenizer {path} has no EOS piece"):
        load_tokenizer(path)


def test_file_changing_while_tokenized_leaves_no_cache_entry(tmp_path, sp, monkeypatch):
    import switchhead.train.data as data

    path = tmp_path / "a.txt"
    path.write_text("the quick brown fox")
    real = data.encode_file

    def appended_meanwhile(sp, p, **kw):
        with open(p, "a") as f:
            f.write(" jumps over the lazy dog")
        return real(sp, p, **kw)

    monkeypatch.setattr(data, "encode_file", appended_meanwhile)
    with pytest.raises(SwitchheadError, match=f"{path} changed while it was being tokenized"):
        cached_tokens(sp, path, tmp_path / "cache")
    monkeypatch.undo()
    path.write_text("the quick brown fox")  # the content the entry would have been keyed by
    assert list(cached_tokens(sp, path, tmp_path / "cache")) == sp.encode("the quick brown fox") + [sp.eos_id()]


@pytest.mark.parametrize("n_lanes,chunk_len,message", [
    (0, 7, "LaneBatcher.n_lanes must be a positive integer, got 0"),
    (4, 0, "LaneBatcher.chunk_len must be a positive integer, got 0"),
    (2.0, 7, "LaneBatcher.n_lanes must be a positive integer, got 2.0"),
])
def test_lane_batcher_refuses_empty_geometry(n_lanes, chunk_len, message):
    stream = TokenStream([np.arange(100, dtype=np.int32)])
    with pytest.raises(SwitchheadError) as e:
        LaneBatcher(stream, n_lanes=n_lanes, chunk_len=chunk_len)
    assert message in str(e.value)
