"""The CLI when the user interrupts it or its output goes away: Ctrl-C and SIGTERM stop with exit code 130 or 143
and one line, leaving no half-written output directory; a full disk on stdout is one line; a reader that goes
away ends it quietly. Real processes (`python -m switchhead`), as only they get real signals and pipes."""

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import switchhead
from switchhead import PRESETS, TransformerLM
from switchhead.cli import main
from switchhead.fileio import atomic_directory


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, sp):
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size(), chunk_len=8))
    return switchhead.save(tmp_path_factory.mktemp("signals") / "model", model, sp)


def _start(*args, **kwargs):
    """`python -m switchhead ARGS`, one torch thread, and SIGINT's default action even where the test runner was
    started with it ignored (a background job), so that Python turns it into KeyboardInterrupt."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "switchhead", *map(str, args)], env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def _wait(condition, proc, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the command ended (status {proc.returncode}) before {what}: {proc.communicate()[1]!r}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s")
        time.sleep(0.01)


def _stopped_cleanly(proc, sig, err):
    assert proc.returncode == 128 + sig, err  # as the shell reports a process stopped by that signal
    assert err.splitlines()[-1:] == ["interrupted" if sig == signal.SIGINT else "terminated"], err
    assert "Traceback" not in err and "Exception ignored" not in err and "Aborted" not in err, err


def test_ctrl_c_while_streaming_exits_130_with_one_line(ckpt, tmp_path):
    out = tmp_path / "stdout"
    with open(out, "wb") as f:
        proc = _start("generate", "the fox", "--ckpt", ckpt, "--max-new-tokens", "1000000", "--seed", "0",
                      stdout=f, stderr=subprocess.PIPE, text=True)
        _wait(lambda: out.stat().st_size > 0, proc, "streamed text")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    _stopped_cleanly(proc, signal.SIGINT, err)
    assert out.read_text().strip(), "the text streamed so far is kept"


def test_ctrl_c_while_torch_loads_exits_130_with_one_line(ckpt):
    # -X importtime reports each module as its import ends: the first of torch's says that torch is loading, which
    # takes a second or more, so the interrupt lands there (before, `import switchhead` loaded torch ahead of the
    # CLI's handler, and Python printed a traceback).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "switchhead", "generate", "the fox", "--ckpt",
                             ckpt, "--max-new-tokens", "1000000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("import time:") and line.split("|")[-1].strip().startswith("torch."):
            break
    else:
        pytest.fail(f"torch was never imported: {''.join(seen)!r}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    _stopped_cleanly(proc, signal.SIGINT, "".join(ln for ln in (*seen, *err.splitlines(True))
                                                  if not ln.startswith("import time:")))


def test_sigterm_while_writing_a_report_keeps_the_previous_one(ckpt, tmp_path):
    """Stopped while the figures are drawn into the temporary directory: that is removed, and the report from an
    earlier run stays as it was (SIGTERM's default action would leave the temporary behind; Ctrl-C takes the same
    exception path, as the streaming test shows)."""
    sig = signal.SIGTERM
    out = tmp_path / "report"
    r = CliRunner().invoke(main, ["inspect", "--ckpt", str(ckpt), "--text", "the fox", "--out", str(out),
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    text = " ".join(["the quick brown fox jumps over lazy dogs"] * 200)  # many chunks: many figures to draw
    proc = _start("inspect", "--ckpt", ckpt, "--text", text, "--out", out, "--no-progress",
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    temporaries = str(tmp_path / ".report.tmp-*")
    _wait(lambda: any(Path(t).iterdir() for t in glob.glob(temporaries)), proc, "figures in the temporary directory")
    proc.send_signal(sig)
    stdout, err = proc.communicate(timeout=60)
    _stopped_cleanly(proc, sig, err)
    assert stdout == "", "nothing announces a report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"], "no temporary or moved-aside directory left"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--help"], ["generate", "the fox", "--max-new-tokens", "4"]],
                         ids=["help", "generate"])
def test_stdout_on_a_full_disk_is_one_line(ckpt, args):
    if args[0] == "generate":
        args = [*args, "--ckpt", ckpt]
    with open("/dev/full", "wb") as full:
        proc = _start(*args, stdout=full, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert err == "Error: cannot write to standard output: No space left on device\n"


def test_reader_gone_is_a_quiet_exit(ckpt):
    args = ["generate", "the fox", "--max-new-tokens", "4", "--json", "--ckpt", ckpt]
    proc = _start(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `| head -0` does before the command writes
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 1 and err == "", err  # Python's advice (docs, "Note on SIGPIPE"), as click does


def test_interrupt_swallowed_by_a_finaliser_is_delivered_again():
    """A signal whose exception is raised inside a __del__ or weakref callback (the garbage collector runs them at
    any moment) would be printed as "Exception ignored" and the command would run on; it is raised again."""
    code = """if True:
        import signal, sys, time
        from switchhead.cli import Terminated, _signals_as_exceptions
        class Finalised:
            def __del__(self):
                signal.raise_signal(signal.SIGTERM)  # the handler raises here, where Python cannot propagate it
        with _signals_as_exceptions():
            try:
                Finalised()
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    pass
                print("not delivered")
            except Terminated:
                print("delivered")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "delivered\n" and r.stderr == "", r


def test_interrupt_between_the_renames_puts_the_previous_output_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the old output is moved aside; Ctrl-C lands before the new one takes its place
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("new")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "a.txt").read_text() == "old"
