"""Writing files and directories so that a crash never leaves a half-written one, finding out before slow work
that a path cannot be written at all, and never replacing a directory that holds something we did not write.

Failures of the file system (no space, read-only, permission) are `SwitchheadError`s: one line naming the
path, not a traceback."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from switchhead.errors import SwitchheadError


def as_path(value: object, what: str, error: type[SwitchheadError] = SwitchheadError) -> Path:
    """`value` as a Path when it is a non-empty str or Path (os.PathLike); else one error naming `what`."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise error(f"{what} must be a str or Path, got {type(value).__name__}")
    path = Path(value)
    if not str(value):
        raise error(f"{what} is empty")
    return path


def text_paths(paths: str | Path | Iterable[str | Path], what: str = "texts") -> list[Path]:
    """`paths` as a list of Paths. One str or Path is one file: iterated, a string would be its characters, and
    its "/" the whole file system (a directory is read as all the text files under it)."""
    if isinstance(paths, (str, os.PathLike)):
        return [as_path(paths, what)]
    if isinstance(paths, (bytes, bytearray)) or not isinstance(paths, Iterable):
        raise SwitchheadError(f"{what} must be a file path (str or Path) or a list of them, got "
                              f"{type(paths).__name__}")
    return [as_path(p, f"{what}[{i}]") for i, p in enumerate(paths)]


def _nearest_existing(path: str | Path) -> Path:
    """The closest ancestor of `path` that exists (the root at worst): where creating `path` starts."""
    return next(p for p in Path(os.path.abspath(path)).parents if p.exists())


def not_utf8(path: str | Path, data: bytes, start: int, offset: int, newlines_before: int = 0,
             error: type[SwitchheadError] = SwitchheadError) -> SwitchheadError:
    """The error for a file that is not UTF-8: `data[start]` is its first bad byte, at file offset `offset`
    (`newlines_before`: line breaks in the file before `data`)."""
    line = newlines_before + data.count(b"\n", 0, start) + 1
    return error(f"cannot read {path}: not valid UTF-8 (byte 0x{data[start]:02x} at offset {offset}, "
                 f"line {line}); text files must be UTF-8")


def read_utf8(path: str | Path, error: type[SwitchheadError] = SwitchheadError) -> str:
    """The text of a UTF-8 file, without the byte-order mark some editors put first (kept, it would be the first
    character of a prompt, a document or a JSON text). Unreadable or not UTF-8 is one line (an `error`) naming the
    file and where the first bad byte is, not a decoder's traceback; nothing is replaced, so no U+FFFD reaches a
    tokenizer."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise not_utf8(path, raw, e.start, e.start, error=error) from None


def require_dir(path: str | Path, what: str, error: type[SwitchheadError] = SwitchheadError) -> None:
    """A one-line `error` unless `path` is a directory: `what` (e.g. "checkpoint directory") not found, or the
    path names something else, such as a file."""
    if not Path(path).is_dir():
        raise error(f"{path} is not a directory (expected a {what})" if os.path.lexists(path) else
                    f"{what} not found: {path}")


def file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file: None where it is a regular file (or a link to one), else "not found",
    "a directory", "a dangling or looping symbolic link" or "not a regular file" (a device, a pipe)."""
    p = Path(path)
    if p.is_file():
        return None
    if p.is_dir():
        return "a directory"
    if p.exists():
        return "not a regular file"
    return "a dangling or looping symbolic link" if p.is_symlink() else "not found"


def check_creatable(path: str | Path, what: str) -> None:
    """A one-line error where creating `path` (and its missing parents) would fail: under a file, or in a
    directory this process cannot write. That is tried with a probe file, created and deleted: os.access says
    yes to root everywhere, also on read-only file systems and in /sys or /proc, where the real write would
    fail only after the slow work."""
    parent = _nearest_existing(path)
    # A broken link on the way counts as missing to exists(), but creating the directory would fail on it (one can
    # only lie below the nearest existing ancestor).
    target = Path(os.path.abspath(path))
    if link := next((p for p in (target, *target.parents) if p.is_symlink() and not p.exists()), None):
        raise SwitchheadError(f"{what} {path}: cannot be created, {link} is a broken link (to {os.readlink(link)})")
    if not parent.is_dir():
        raise SwitchheadError(f"{what} {path}: cannot be created, {parent} is not a directory")
    check_writable(parent, f"{what} {path}")


def check_writable(directory: Path, label: str) -> None:
    """A one-line error, starting with `label`, where no file can be created in the existing `directory`."""
    try:
        fd, name = tempfile.mkstemp(prefix=".switchhead-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise SwitchheadError(f"{label}: cannot write in {directory}: {e.strerror or e}") from None


# The names of the temporaries `write_atomic` and `atomic_directory` create beside their target.
_TEMPORARY = re.compile(r"\..+\.(\d+\.tmp|tmp-[A-Za-z0-9_]+)")


def is_temporary(name: str) -> bool:
    """Whether `name` is a temporary of `write_atomic` or `atomic_directory`: one that is still there was left
    by a process killed mid-write, and is never a finished output."""
    return _TEMPORARY.fullmatch(name) is not None


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (str: UTF-8) to `path` through a synced temporary sibling and a rename: readers see the old
    file or the new one, never a torn one. Missing parents are created; through a symlink the file it points
    to is replaced and the link kept; a path that exists and is no regular file (/dev/stdout, a FIFO) is
    written directly, as there is nothing to rename over."""
    target = Path(os.path.realpath(path))
    blob = data.encode("utf-8") if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        if target.exists() and not target.is_file():
            target.write_bytes(blob)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        # mode 0o666 under the umask: the permissions a plain write would give
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise SwitchheadError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def check_replaceable(path: str | Path) -> None:
    """Fail early, before any slow work, where `atomic_directory(path)` would fail at its end: a path under a
    file, the current directory (or one above it), which cannot be renamed away, or a place we cannot write."""
    path = Path(os.path.abspath(path))
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents:
        raise SwitchheadError(f"cannot replace {path}: it is the current directory or contains it; choose another")
    check_creatable(path, "output directory")


def check_output_dir(path: str | Path, ours: Callable[[Path], bool], what: str) -> Path:
    """`path` as a `Path` if `atomic_directory(path)` may replace it: it does not exist, is an empty directory,
    or is a directory `ours` recognises as `what` (an earlier output of the same command). Anything else is
    refused, so replacing never deletes a user's files."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not ours(path))):
        raise SwitchheadError(f"refusing to replace {path}: it exists and is not {what}; choose a new or empty "
                              "directory")
    check_replaceable(path)
    return path


def holds_only(path: Path, names: set[str], required: set[str] = frozenset()) -> bool:
    """Whether directory `path` holds the files in `required`, and nothing but regular files named in `names`."""
    entries = {p.name: p for p in path.iterdir()}
    return required <= entries.keys() and all(n in names and p.is_file() for n, p in entries.items())


def save_tensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, whose I/O failures (a full disk) come as its own error type: raised as the
    OSError they are, which `atomic_directory` turns into one line."""
    from safetensors import SafetensorError  # here, not above: commands that never write tensors skip torch
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        io = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(e))
        if io is None:
            raise
        raise OSError(int(io[2]), io[1]) from None


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `path`; on success it replaces `path` by rename.

    If the body raises, the temporary directory is removed and `path` is untouched. An existing `path` is
    moved aside first and deleted only after the new one is in place. Callers decide whether `path` may be
    replaced at all (`check_output_dir`). A symlink is written through, as `write_atomic` does: the directory it
    points to is replaced and the link kept."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    check_replaceable(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        yield tmp
        # mkdtemp (and some writers) create owner-only files; a directory of ours gets the usual permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for f in tmp.iterdir():  # make the files durable before the directory becomes visible
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = path.parent / f".{path.name}.old-{os.getpid()}" if path.exists() else None
        try:
            if old is not None:
                os.replace(path, old)
            os.replace(tmp, path)
        except BaseException:  # also Ctrl-C or SIGTERM between the two renames
            if old is not None and old.exists() and not path.exists():
                # put the previous output back where its user looks for it
                with contextlib.suppress(OSError):
                    os.replace(old, path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise SwitchheadError(f"cannot write {path}: {e.strerror or e}"
                              + (f" ({e.filename})" if e.filename else "")) from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
