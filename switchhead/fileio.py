"""Writing files so that a crash never leaves a half-written one, and finding out before slow work that a
path cannot be written at all. (Whole directories: `switchhead.model.checkpoint.atomic_directory`.)"""

from __future__ import annotations

import os
from pathlib import Path

from switchhead.errors import SwitchheadError


def _nearest_existing(path: str | Path) -> Path:
    """The closest ancestor of `path` that exists (the root at worst): where creating `path` starts."""
    return next(p for p in Path(os.path.abspath(path)).parents if p.exists())


def blocking_parent(path: str | Path) -> Path | None:
    """The nearest existing ancestor of `path` if it is not a directory (so `path` can never be created)."""
    parent = _nearest_existing(path)
    return None if parent.is_dir() else parent


def check_creatable(path: str | Path, what: str) -> None:
    """A one-line error where creating `path` (and its missing parents) would fail: under a file, or in a
    directory this process cannot write."""
    parent = _nearest_existing(path)
    if not parent.is_dir():
        raise SwitchheadError(f"{what} {path}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise SwitchheadError(f"{what} {path}: cannot write in {parent} (permission denied)")


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` (str: UTF-8) to `path` through a synced temporary sibling and a rename: readers see the old
    file or the new one, never a torn one. Missing parents are created; through a symlink the file it points
    to is replaced and the link kept; a path that exists and is no regular file (/dev/stdout, a FIFO) is
    written directly, as there is nothing to rename over."""
    target = Path(os.path.realpath(path))
    blob = data.encode("utf-8") if isinstance(data, str) else data
    if target.exists() and not target.is_file():
        target.write_bytes(blob)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        # mode 0o666 under the umask: the permissions a plain write would give
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
