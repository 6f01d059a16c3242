"""Token streams for Transformer-XL training: on-disk token cache and per-lane contiguous batching.

The concatenated token stream (every file followed by EOS) is cut into B equal, contiguous lanes. Step s
of an epoch feeds tokens [s*T, s*T+T) of every lane (targets shifted by one), so the XL memory returned for
lane b at step s is exactly the text preceding lane b's chunk at step s+1.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from switchhead.errors import SwitchheadError, is_int
from switchhead.fileio import check_creatable, file_problem, not_utf8
from switchhead.model.tokenizer import encode_file, token_dtype, tokenizer_fingerprint

# Bump when the way files become tokens changes, so stale caches are not reused.
_CACHE_VERSION = "3"  # 2: --unwrap keeps paragraphs of CRLF files; 3: no leading BOM, --unwrap of CR files


def default_cache_dir() -> Path:
    env = os.environ.get("SWITCHHEAD_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "switchhead" / "tokens"


def _txt_files(root: Path) -> list[Path]:
    """The .txt files under `root`, subdirectories (and linked ones) included, in path order. Hidden files and
    directories are left out: they hold copies and metadata (.ipynb_checkpoints, macOS's ._name.txt), not text."""
    found, seen = [], set()
    for parent, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(parent)
        if real in seen:  # a link back up the tree would be walked forever
            dirs.clear()
            continue
        seen.add(real)
        # Sorted: os.walk lists in the file system's order, and with linked directories that order decides the path
        # under which a directory reached twice is recorded, so the documents' order would depend on the disk.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        # A dangling or looping link is listed here too, and refused by check_data_files rather than skipped.
        found += [Path(parent, n) for n in names if n.endswith(".txt") and not n.startswith(".")]
    return sorted(found)


def _expand_dirs(files: Sequence[str | Path], what: str) -> list[Path]:
    """A directory stands for the .txt files under it (`_txt_files`)."""
    out = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            found = _txt_files(p)
            if not found:
                raise SwitchheadError(f"{what} directory {p} has no .txt files")
            out.extend(found)
        else:
            out.append(p)
    return out


def check_data_files(files: Sequence[str | Path], what: str = "data") -> list[Path]:
    if not files:
        raise SwitchheadError(f"no {what} files given")
    paths = []
    for f in _expand_dirs(files, what):
        p = Path(f)
        if problem := file_problem(p):
            raise SwitchheadError(f"{what} file {problem if problem == 'not found' else 'is ' + problem}: {p}")
        if not _check_text(p):
            raise SwitchheadError(f"{what} file is empty: {p}")
        paths.append(p)
    return paths


def _check_text(path: Path) -> bool:
    """Whether the file holds more than whitespace; a one-line error where it is unreadable or not UTF-8.

    One streamed pass, so a bad byte deep in a big corpus is found before the slow tokenizer training and
    tokenization, without holding the file (or its decoded copy) in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    blank, offset, newlines = True, 0, 0
    try:
        with open(path, "rb") as f:
            while True:
                block = f.read(1 << 20)
                pending = decoder.getstate()[0]  # the start of a character split by the previous block
                try:
                    text = decoder.decode(block, final=not block)
                except UnicodeDecodeError as e:
                    raise not_utf8(path, pending + block, e.start, offset - len(pending) + e.start, newlines) from None
                if not block:
                    return not blank
                # str.strip: Unicode's whitespace too (a file of no-break spaces holds no text either)
                blank = blank and not (text if offset else text.removeprefix("\ufeff")).strip()
                offset += len(block)
                newlines += block.count(b"\n")
    except OSError as e:
        raise SwitchheadError(f"cannot read {path}: {e.strerror or e}") from None


def check_cache_dir(path: Path, what: str) -> None:
    """Fail before slow work where the token cache cannot be a directory. An existing one need not be
    writable: a shared read-only cache that already holds every entry works."""
    if path.exists() and not path.is_dir():
        raise SwitchheadError(f"{what} {path} exists and is not a directory")
    if not path.is_dir():
        check_creatable(path, what)


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached_tokens(
    sp: spm.SentencePieceProcessor, path: str | Path, cache_dir: str | Path, *, unwrap: bool = False
) -> np.ndarray:
    """The token stream of one file (followed by EOS), memory-mapped from the cache; built on first use.

    The key covers the file content, the tokenizer and `unwrap` (see `unwrap_paragraphs`), so changing any
    of them invalidates the entry; entries are written to a temporary file of their own (unique also between
    processes of one PID in different containers sharing the cache), synced and renamed, so concurrent builders
    and crashes cannot leave a torn file.
    """
    cache_dir = Path(cache_dir)
    reading = "unwrap" if unwrap else "verbatim"
    digest = file_digest(path)
    key = hashlib.sha256(
        f"{_CACHE_VERSION}:{digest}:{tokenizer_fingerprint(sp)}:{reading}".encode()
    ).hexdigest()
    target = cache_dir / f"{key[:32]}.npy"
    if not target.is_file():
        tmp = None
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)  # before the slow encoding, so a bad cache fails fast
            ids = encode_file(sp, path, unwrap=unwrap)
            # A file still being written (a download, a copy) may have changed since it was hashed: its tokens
            # would be stored under the key of content they do not come from, and served for it later.
            if file_digest(path) != digest:
                raise SwitchheadError(f"{path} changed while it was being tokenized; run again once it is complete")
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache_dir)
            with open(fd, "wb") as f:
                np.save(f, ids.astype(token_dtype(sp), copy=False))
                f.flush()
                os.fsync(f.fileno())  # else a crash after the rename may leave an empty entry
            os.replace(tmp, target)
        except OSError as e:
            raise SwitchheadError(f"cannot write the token cache in {cache_dir}: {e.strerror or e}") from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    damaged = SwitchheadError(f"the token cache entry {target} is damaged (not a whole token array); delete it "
                              "and it is rebuilt")
    try:
        ids = np.load(target, mmap_mode="r")
    except OSError as e:
        raise SwitchheadError(f"cannot read the token cache {target}: {e.strerror or e}") from None
    except (ValueError, EOFError):  # numpy's complaint about a cut-off or garbled .npy (EOFError: an empty file)
        raise damaged from None
    # Anything else would be read as other tokens, silently. Every entry ends with the EOS its file is followed
    # by: an empty entry, or one cut short by a rewritten header, does not.
    if ids.ndim != 1 or ids.dtype != token_dtype(sp) or not len(ids) or ids[-1] != sp.eos_id():
        raise damaged
    return ids


class TokenStream:
    """A read-only concatenation of token arrays (memory maps stay maps; nothing is copied up front)."""

    def __init__(self, parts: Sequence[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"slice [{start}, {stop}) outside a stream of {len(self)} tokens")
        out = np.empty(stop - start, dtype=np.int64)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos = start
        while pos < stop:
            part, base = self.parts[i], int(self.offsets[i])
            end = min(stop, base + len(part))
            out[pos - start : end - start] = part[pos - base : end - base]
            pos, i = end, i + 1
        return out


def load_stream(
    sp: spm.SentencePieceProcessor, files: Sequence[str | Path], cache_dir: str | Path, *, unwrap: bool = False,
    progress: bool = False,
) -> TokenStream:
    """The files' token streams, one after another (each tokenized on first use, then read from the cache)."""
    from tqdm import tqdm

    # Shown only when tokenizing takes a while (the cache makes it instant after the first run).
    files = tqdm(files, desc="tokens", unit="file", disable=not progress, leave=False, delay=1.0)
    return TokenStream([cached_tokens(sp, f, cache_dir, unwrap=unwrap) for f in files])


@dataclass(frozen=True)
class LaneBatcher:
    """Training batches: `n_lanes` contiguous lanes over `stream`, `chunk_len` tokens per step.

    `lanes` selects which of the global lanes this process feeds (DDP ranks take disjoint blocks); the lane
    geometry depends only on the global lane count, so the data are the same whatever the world size.
    """

    stream: TokenStream
    n_lanes: int
    chunk_len: int
    lanes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("n_lanes", "chunk_len"):
            if not is_int(v := getattr(self, name)) or v < 1:
                raise SwitchheadError(f"LaneBatcher.{name} must be a positive integer, got {v!r}")
        need = self.n_lanes * (self.chunk_len + 1)
        if len(self.stream) < need:
            raise SwitchheadError(
                f"training data too short: {len(self.stream)} tokens, but one batch of {self.n_lanes} lanes "
                f"x {self.chunk_len + 1} tokens needs {need}; add data or lower --batch-size"
            )

    @property
    def lane_len(self) -> int:
        return len(self.stream) // self.n_lanes

    @property
    def steps_per_epoch(self) -> int:
        # Each step needs chunk_len inputs plus one more token as the last target.
        return (self.lane_len - 1) // self.chunk_len

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of global step `step`."""
        return divmod(step, self.steps_per_epoch)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each int64 [len(lanes), chunk_len], for global step `step`."""
        _, s = self.position(step)
        lanes = range(self.n_lanes) if self.lanes is None else self.lanes
        T = self.chunk_len
        rows = [
            self.stream.slice(b * self.lane_len + s * T, b * self.lane_len + s * T + T + 1) for b in lanes
        ]
        block = np.stack(rows)
        return block[:, :-1], block[:, 1:]


# Target of the padding at the end of the last evaluation lane: F.cross_entropy's default ignore_index.
IGNORE = -100


def eval_lanes(n_lanes: int, n_tokens: int, chunk_len: int) -> int:
    """Lanes a stream of `n_tokens` is cut into for evaluation: `n_lanes`, but never more than the stream has
    chunks of targets: more lanes would not save a forward pass, only take context from the tokens at the lanes'
    starts."""
    targets = n_tokens - 1
    if targets < 1:
        raise SwitchheadError(f"evaluation data too short: {n_tokens} tokens")
    lanes = max(1, min(n_lanes, -(-targets // chunk_len)))
    return -(-targets // _lane_len(n_tokens, lanes))  # so that the last lane keeps at least one target


def _lane_len(n_tokens: int, n_lanes: int) -> int:
    """Targets per evaluation lane (the last lane may have fewer)."""
    return -(-(n_tokens - 1) // n_lanes)


def eval_chunks(stream: TokenStream, n_lanes: int, chunk_len: int, lanes: Sequence[int] | None = None):
    """Yield (inputs, targets) chunks that score every token of `stream` but its first exactly once.

    The targets are cut into `eval_lanes` contiguous lanes; each lane's inputs start one token earlier (the
    previous lane's last target), so a lane's first target is scored with one token of context and each later
    one with all the lane's tokens before it. The last lane may be shorter: its end is padded with targets
    IGNORE. The last chunk may be shorter than `chunk_len`. Feeding the chunks in order with memory gives every
    token its true preceding context within its lane.
    """
    n_lanes = eval_lanes(n_lanes, len(stream), chunk_len)
    lane_len = _lane_len(len(stream), n_lanes)
    chosen = list(range(n_lanes)) if lanes is None else [b for b in lanes if b < n_lanes]
    if not chosen:
        return
    block = np.zeros((len(chosen), lane_len + 1), dtype=np.int64)
    target = np.full((len(chosen), lane_len), IGNORE, dtype=np.int64)
    for row, b in enumerate(chosen):
        ids = stream.slice(b * lane_len, min((b + 1) * lane_len + 1, len(stream)))
        block[row, : len(ids)] = ids
        target[row, : len(ids) - 1] = ids[1:]
    for start in range(0, lane_len, chunk_len):
        stop = min(start + chunk_len, lane_len)
        yield block[:, start:stop], target[:, start:stop]


def stream_nll(logits_fn, stream: TokenStream, n_lanes: int, chunk_len: int, lanes: Sequence[int] | None = None,
               progress: str | None = None):
    """Summed negative log-likelihood (float64, on the logits' device) and the number of tokens scored, over the
    `eval_chunks` of `stream`: each chunk (ids [L, t], int64 on the CPU) goes through `logits_fn(ids, state) ->
    (logits [L, t, V], state)` with the state the previous chunk returned (None first), so every token is scored
    with its lane's tokens before it as context. `progress`: a progress-bar label, or None for no bar."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    chunks = eval_chunks(stream, n_lanes, chunk_len, lanes=lanes)
    total = -(-_lane_len(len(stream), eval_lanes(n_lanes, len(stream), chunk_len)) // chunk_len)
    nll, count, state = None, 0, None
    for x, y in tqdm(chunks, total=total, desc=progress, disable=progress is None, unit="chunk", leave=False):
        logits, state = logits_fn(torch.from_numpy(np.ascontiguousarray(x)), state)
        count += int((y != IGNORE).sum())  # counted on the host: no device sync per chunk
        y = torch.from_numpy(np.ascontiguousarray(y)).to(logits.device)
        # Half-precision logits (autocast) are widened; float32 and float64 ones are scored as they are.
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        part = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE).double()
        nll = part if nll is None else nll + part
    return nll, count
