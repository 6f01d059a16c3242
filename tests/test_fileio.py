"""switchhead.fileio: atomic file writes and the early checks that a path can be created."""

import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import file_size_limit

from switchhead import fileio
from switchhead.errors import SwitchheadError


def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("old")

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "fsync", crash)
    with pytest.raises(SwitchheadError, match=r"cannot write .*r\.json: disk full"):  # one line, no traceback
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
        with pytest.raises(SwitchheadError, match="afile is not a directory"):
            fileio.check_creatable(path, "--output")
        with pytest.raises(SwitchheadError, match="afile is not a directory"):
            fileio.check_replaceable(path)
    fileio.check_creatable(tmp_path / "new" / "x", "--output")
    (tmp_path / "locked").mkdir(mode=0o500)
    with monkeypatch.context() as m:
        if os.geteuid() == 0:  # root may write anywhere: refuse the probe there as the kernel refuses others
            real = fileio.tempfile.mkstemp

            def mkstemp(*args, dir=None, **kwargs):
                if Path(dir) == tmp_path / "locked":
                    raise PermissionError(13, "Permission denied")
                return real(*args, dir=dir, **kwargs)

            m.setattr(fileio.tempfile, "mkstemp", mkstemp)
        with pytest.raises(SwitchheadError, match=r"--output .*x: cannot write in .*locked: Permission denied"):
            fileio.check_creatable(tmp_path / "locked" / "new" / "x", "--output")
    fileio.check_creatable(tmp_path / "new" / "x", "--output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "locked"]  # the probes leave nothing behind


def test_file_problem_names_what_is_there_instead_of_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "to-f").symlink_to(tmp_path / "f")
    (tmp_path / "d").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert [fileio.file_problem(tmp_path / n) for n in ("f", "to-f", "d", "dangling", "loop", "missing")] == [
        None, None, "a directory", "a dangling or looping symbolic link", "a dangling or looping symbolic link",
        "not found"]
    if Path("/dev/null").exists():
        assert fileio.file_problem("/dev/null") == "not a regular file"


def test_broken_links_on_the_way_cannot_be_created(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for path, link in [(tmp_path / "dangling", "dangling"), (tmp_path / "dangling" / "sub" / "x", "dangling"),
                       (tmp_path / "loop", "loop")]:
        with pytest.raises(SwitchheadError, match=f"cannot be created, .*/{link} is a broken link"):
            fileio.check_creatable(path, "--out")
        with pytest.raises(SwitchheadError, match=f"/{link} is a broken link"):
            fileio.check_replaceable(path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")  # a link to a directory is a directory
    fileio.check_creatable(tmp_path / "link" / "new", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "loop", "real"]


def test_writes_that_fail_although_access_says_yes(tmp_path, monkeypatch):
    # A read-only file system (or /sys, /proc) fails the real write even where os.access says yes (always, for
    # root): the early checks try one, so the slow work after them is not lost at its end.
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(fileio.tempfile, "mkstemp", read_only)
    with pytest.raises(SwitchheadError, match=r"--output .*x: cannot write in .*: Read-only file system"):
        fileio.check_creatable(tmp_path / "new" / "x", "--output")
    with pytest.raises(SwitchheadError, match="Read-only file system"):
        fileio.check_replaceable(tmp_path / "out")
    monkeypatch.undo()
    if Path("/proc/self").is_dir():  # the real thing, where it exists (Linux)
        with pytest.raises(SwitchheadError, match="cannot write in /proc/self"):
            fileio.check_creatable("/proc/self/switchhead-out/x.json", "--output")


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with fileio.atomic_directory(out) as tmp:
        (tmp / "a").write_text("1")
    with fileio.atomic_directory(out) as tmp:
        (tmp / "b").write_text("2")
    assert [p.name for p in out.iterdir()] == ["b"]
    with pytest.raises(RuntimeError, match="crash"):
        with fileio.atomic_directory(out) as tmp:
            (tmp / "c").write_text("half")
            raise RuntimeError("crash")
    with pytest.raises(SwitchheadError, match=r"cannot write .*out: disk full"):  # a failing write: one line
        with fileio.atomic_directory(out) as tmp:
            raise OSError("disk full")
    assert [p.name for p in out.iterdir()] == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_directory_syncs_every_file_before_it_becomes_visible(tmp_path, monkeypatch):
    # A crash just after the rename must not leave a directory of empty or torn files: each file is fsynced
    # before the rename that publishes the directory.
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("sync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    monkeypatch.setattr(fileio.os, "replace", replace)
    out = tmp_path / "out"
    with fileio.atomic_directory(out) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "b").write_bytes(b"2")
    published = events.index(("replace", "out"))
    synced = {ino for kind, ino in events[:published] if kind == "sync"}
    assert {(out / name).stat().st_ino for name in ("a", "b")} <= synced, events


def test_atomic_directory_keeps_the_old_directory_where_the_final_rename_fails(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with fileio.atomic_directory(out) as tmp:
        (tmp / "a").write_text("old")
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".out.tmp-"):  # the new directory onto `out`, after the old one moved aside
            raise OSError("I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(SwitchheadError, match=r"cannot write .*out: I/O error"):
        with fileio.atomic_directory(out) as tmp:
            (tmp / "a").write_text("new")
    # The previous output is back under its own name, not hidden in a moved-aside copy.
    assert (out / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_directory_writes_through_a_symlink(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "out").mkdir()
    (tmp_path / "disk" / "out" / "old").write_text("0")
    (tmp_path / "here").mkdir()
    link = tmp_path / "here" / "out"
    link.symlink_to(tmp_path / "disk" / "out")
    with fileio.atomic_directory(link) as tmp:
        (tmp / "a").write_text("1")
    assert link.is_symlink() and [p.name for p in link.iterdir()] == ["a"]
    # Nothing is left beside the link or beside its target (no moved-aside copy, no temporary directory).
    assert [p.name for p in (tmp_path / "here").iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["out"]
    dangling = tmp_path / "here" / "new"
    dangling.symlink_to(tmp_path / "disk" / "new")
    with fileio.atomic_directory(dangling) as tmp:
        (tmp / "b").write_text("2")
    assert (tmp_path / "disk" / "new" / "b").read_text() == "2" and dangling.is_symlink()


def test_check_output_dir_replaces_only_what_is_ours(tmp_path):
    def ours(p):
        return fileio.holds_only(p, {"model.bin", "notes.json"}, required={"model.bin"})

    (tmp_path / "run").mkdir()
    assert fileio.check_output_dir(tmp_path / "new", ours, "a run") == tmp_path / "new"
    assert fileio.check_output_dir(tmp_path / "run", ours, "a run") == tmp_path / "run"  # empty
    (tmp_path / "run" / "model.bin").write_text("")
    fileio.check_output_dir(tmp_path / "run", ours, "a run")
    (tmp_path / "run" / "mine.txt").write_text("")
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "run", tmp_path / "file"):
        with pytest.raises(SwitchheadError, match=f"refusing to replace {path}: it exists and is not a run"):
            fileio.check_output_dir(path, ours, "a run")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.json").mkdir()  # a known name, but not a file
    (tmp_path / "sub" / "model.bin").write_text("")
    assert not ours(tmp_path / "sub")


def test_read_utf8_drops_only_a_leading_byte_order_mark(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"\xef\xbb\xbfa\xef\xbb\xbfb\n")
    assert fileio.read_utf8(f) == "a\ufeffb\n"
    f.write_bytes(b"a\n")
    assert fileio.read_utf8(f) == "a\n"


def test_save_tensors_raises_a_failed_write_as_the_oserror_it_is(tmp_path):
    """safetensors raises its own error type for a failed write; atomic_directory turns OSErrors into one line."""
    with file_size_limit(1000), pytest.raises(OSError) as failed:
        fileio.save_tensors({"w": torch.zeros(1000)}, tmp_path / "w.safetensors")
    assert (failed.value.errno, failed.value.strerror) == (errno.EFBIG, os.strerror(errno.EFBIG))
    fileio.save_tensors({"w": torch.arange(1000.0)}, tmp_path / "w.safetensors")  # no limit: written
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.arange(1000.0))
