"""switchhead.fileio: atomic file writes and the early checks that a path can be created."""

import os
import stat
from pathlib import Path

import pytest

from switchhead import fileio
from switchhead.errors import SwitchheadError


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("old")

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        fileio.write_atomic(out, "new")
    assert out.read_text() == "old" and sorted(tmp_path.iterdir()) == [out]  # no temporary file left


def test_writes_text_bytes_parents_and_through_symlinks(tmp_path):
    fileio.write_atomic(tmp_path / "a" / "b" / "t.txt", "héllo")
    assert (tmp_path / "a" / "b" / "t.txt").read_bytes() == "héllo".encode()
    fileio.write_atomic(tmp_path / "blob", b"\x00\xff")
    assert (tmp_path / "blob").read_bytes() == b"\x00\xff"
    (tmp_path / "link").symlink_to(tmp_path / "blob")
    fileio.write_atomic(tmp_path / "link", "via link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "blob").read_text() == "via link"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "blob", "link"]


def test_permissions_are_those_of_a_plain_write(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    fileio.write_atomic(tmp_path / "atomic", "x")
    assert stat.S_IMODE(os.stat(tmp_path / "atomic").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_paths_that_cannot_be_created(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    for path in (tmp_path / "afile" / "x", tmp_path / "afile" / "sub" / "x"):
        assert fileio.blocking_parent(path) == tmp_path / "afile"
        with pytest.raises(SwitchheadError, match="afile is not a directory"):
            fileio.check_creatable(path, "--output")
    assert fileio.blocking_parent(tmp_path / "new" / "x") is None
    fileio.check_creatable(tmp_path / "new" / "x", "--output")
    (tmp_path / "locked").mkdir(mode=0o500)
    # root may write anywhere, so ask the question the check asks (os.access) as an unprivileged user would
    monkeypatch.setattr(fileio.os, "access", lambda p, mode: Path(p) != tmp_path / "locked")
    with pytest.raises(SwitchheadError, match=r"cannot write in .*locked \(permission denied\)"):
        fileio.check_creatable(tmp_path / "locked" / "new" / "x", "--output")
    fileio.check_creatable(tmp_path / "new" / "x", "--output")
