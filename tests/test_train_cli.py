"""`switchhead train` through click: bad input gives one line, exit code 2, no traceback, nothing overwritten."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny import file_size_limit

import switchhead
from switchhead import fileio
from switchhead.cli import main
from switchhead.devices import native_half

WORDS = "the cat sat on a mat and 42 dogs ran over 1999 hills while birds sang"


@pytest.fixture()
def corpus(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("\n".join(f"{WORDS} {i}" for i in range(200)))
    return p


def _run(*args):
    return CliRunner().invoke(main, ["train", *map(str, args)])


def _tiny(out, data, tmp_path, *extra):
    return _run(
        "--config",
        "tiny-switchhead",
        "--data",
        data,
        "--out",
        out,
        "--vocab-size",
        400,
        "--steps",
        4,
        "--batch-size",
        2,
        "--cache-dir",
        tmp_path / "cache",
        "--no-progress",
        *extra,
    )


def _assert_user_error(result, match):
    assert result.exit_code == 2, (result.output, result.exception)
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith("Error: "), text
    assert "Traceback" not in text
    assert match in text, text


def test_train_runs_and_prints_summary(corpus, tmp_path):
    out = tmp_path / "run"
    r = _tiny(out, corpus, tmp_path)
    assert r.exit_code == 0, r.output
    assert "done: 4 steps" in r.output and str(out / "final") in r.output
    model, sp = switchhead.load(out / "final")
    assert model.config.vocab_size == sp.get_piece_size()
    # Resume with no further flags (options come from the run) and a longer horizon.
    r = _run("--out", out, "--resume", "--steps", 6, "--no-progress")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 6


def test_bf16_on_a_cpu_without_bf16_instructions_is_called_slow(corpus, tmp_path):
    r = _tiny(tmp_path / "run", corpus, tmp_path, "--dtype", "bfloat16", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert ("no bf16 instructions" in r.stderr) == (not native_half(torch.bfloat16)), r.stderr


def test_missing_and_empty_data(tmp_path):
    _assert_user_error(_tiny(tmp_path / "o1", tmp_path / "nope.txt", tmp_path), "not found")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _assert_user_error(_tiny(tmp_path / "o2", empty, tmp_path), "empty")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    _assert_user_error(_run("--out", tmp_path / "o3", "--config", "tiny-switchhead"), "--data is required")


def test_data_shorter_than_one_batch(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(WORDS)
    out = tmp_path / "o"
    _assert_user_error(_tiny(out, short, tmp_path), "too short")
    assert not out.exists()  # a refused run leaves nothing behind


def test_out_dir_holding_something_else(corpus, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    _assert_user_error(_tiny(out, corpus, tmp_path), "not empty")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "precious"
    f = tmp_path / "file"
    f.write_text("x")
    _assert_user_error(_tiny(f, corpus, tmp_path), "not a directory")
    _assert_user_error(_tiny(f / "run", corpus, tmp_path), "file is not a directory")  # under a file
    assert f.read_text() == "x"
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # was a FileExistsError traceback, after the tokenizer
    _assert_user_error(_tiny(tmp_path / "link", corpus, tmp_path), f"{tmp_path / 'link'} is a broken link")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "gone").exists()


def test_unwrap_is_part_of_the_run(corpus, tmp_path):
    out = tmp_path / "run"
    assert _tiny(out, corpus, tmp_path, "--unwrap").exit_code == 0
    assert json.loads((out / "run.json").read_text())["unwrap"] is True
    before = (out / "final" / "model.safetensors").read_bytes()
    _assert_user_error(_run("--out", out, "--resume", "--no-unwrap", "--steps", 6), "unwrap changed")
    assert (out / "final" / "model.safetensors").read_bytes() == before
    r = _run("--out", out, "--resume", "--steps", 6, "--no-progress")  # unwrap comes from the run
    assert r.exit_code == 0, r.output
    # A run recorded before the option existed read its text verbatim, and resumes as such.
    spec = json.loads((out / "run.json").read_text())
    del spec["unwrap"], spec["options"]["unwrap"]
    (out / "run.json").write_text(json.dumps(spec))
    _assert_user_error(_run("--out", out, "--resume", "--unwrap", "--steps", 8), "unwrap changed")
    r = _run("--out", out, "--resume", "--steps", 8, "--no-progress")
    assert r.exit_code == 0, r.output


def test_unwrap_trains_on_the_joined_paragraphs(corpus, tmp_path):
    # --unwrap must reach the tokenizer and the token stream, not only run.json: the run is the one trained
    # verbatim on the text unwrap_paragraphs makes of the file, and not the one trained on the file as it is.
    from safetensors.torch import load_file

    from switchhead.model.tokenizer import unwrap_paragraphs

    joined = tmp_path / "joined" / "a.txt"
    joined.parent.mkdir()
    joined.write_text(unwrap_paragraphs(corpus.read_text()))
    assert joined.read_text() != corpus.read_text()
    for out, data, extra in (("unwrapped", corpus, ["--unwrap"]), ("joined-run", joined, []),
                             ("verbatim", corpus, [])):
        r = _tiny(tmp_path / out, data, tmp_path, *extra)
        assert r.exit_code == 0, r.output
    runs = {out: load_file(str(tmp_path / out / "final" / "model.safetensors"))
            for out in ("unwrapped", "joined-run", "verbatim")}
    for k, w in runs["joined-run"].items():
        assert torch.equal(runs["unwrapped"][k], w), k
    assert any(not torch.equal(runs["verbatim"][k], w) for k, w in runs["unwrapped"].items())


def test_damaged_run_record_on_resume_is_one_line(corpus, tmp_path):
    out = tmp_path / "run"
    assert _tiny(out, corpus, tmp_path).exit_code == 0
    good = (out / "run.json").read_text()
    spec = json.loads(good)
    for text, message in [
        ("[]", "run.json is not a switchhead training run record"),
        ('{"format": "other/1"}', "run.json is not a switchhead training run record"),
        ("{bad", "run.json is unreadable: Expecting property name"),
        (json.dumps({**spec, "options": 5}), "run.json is unreadable: TypeError"),
        (json.dumps({k: v for k, v in spec.items() if k != "data"}), "run.json is unreadable: KeyError('data')"),
        (json.dumps({**spec, "model_config": {k: v for k, v in spec["model_config"].items() if k != "mem_chunks"}}),
         "run.json is unreadable: ConfigError('config key(s) missing: mem_chunks"),
    ]:
        (out / "run.json").write_text(text)
        _assert_user_error(_run("--out", out, "--resume", "--steps", 6), message)
    # Not UTF-8: the message every text file of ours gets, with where the bad byte is.
    (out / "run.json").write_bytes(b'{"format": "\xff"}')
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6),
                       "run.json: not valid UTF-8 (byte 0xff at offset 12, line 1)")
    # Keys in "options" that are no option of ours are not passed on as options.
    (out / "run.json").write_text(json.dumps({**spec, "options": {**spec["options"], "colour": "red"}}))
    r = _run("--out", out, "--resume", "--steps", 6, "--no-progress")
    assert r.exit_code == 0, r.output


def test_existing_run_and_changed_config_on_resume(corpus, tmp_path):
    out = tmp_path / "run"
    assert _tiny(out, corpus, tmp_path).exit_code == 0
    before = (out / "final" / "model.safetensors").read_bytes()
    _assert_user_error(_tiny(out, corpus, tmp_path), "already holds a training run")
    _assert_user_error(_run("--out", out, "--resume", "--config", "tiny-transformer"), "model config changed")
    _assert_user_error(_run("--out", out, "--resume", "--batch-size", 4), "batch size changed")
    _assert_user_error(_run("--out", out, "--resume", "--grad-clip", 0.5), "grad_clip")
    _assert_user_error(_run("--out", out, "--resume", "--vocab-size", 300), "vocab size changed")
    other = tmp_path / "b.txt"
    other.write_text("\n".join(f"{WORDS} again {i}" for i in range(200)))
    _assert_user_error(_run("--out", out, "--resume", "--data", other), "data changed")
    assert (out / "final" / "model.safetensors").read_bytes() == before


def test_bad_options(corpus, tmp_path):
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--lr", "-1"), "--lr")
    _assert_user_error(_run("--config", "no-such-preset", "--data", corpus, "--out", tmp_path / "o"), "unknown config")
    _assert_user_error(_run("--config", "tiny-switchhead", "--data", corpus, "--out", tmp_path / "o", "--tokenizer",
                            tmp_path / "none.model"), "tokenizer model not found")
    (tmp_path / "dir.model").mkdir()
    _assert_user_error(_run("--config", "tiny-switchhead", "--data", corpus, "--out", tmp_path / "o", "--tokenizer",
                            tmp_path / "dir.model"), "dir.model is a directory, not a SentencePiece model file")
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--dtype", "float16"), "float16 needs a CUDA")
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--tokenizer", tmp_path / "t.model"),
                       "--vocab-size is the size of a tokenizer trained on --data; with --tokenizer")
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--grad-accum", 0), "--grad-accum must be a positive")
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--grad-accum", 3),
                       "--grad-accum 3 must divide the 2 lanes each process runs (--batch-size 2 / 1 process)")
    assert not (tmp_path / "o").exists()


def _finished_run(out, corpus, tmp_path):
    """A finished run in `out`, and what must survive a refused resume: final/ weights and metrics."""
    assert _tiny(out, corpus, tmp_path).exit_code == 0
    return (out / "final" / "model.safetensors").read_bytes(), (out / "metrics.jsonl").read_text()


def _assert_untouched(out, kept):
    assert ((out / "final" / "model.safetensors").read_bytes(), (out / "metrics.jsonl").read_text()) == kept


@pytest.mark.parametrize("damage", ["truncated", "deleted", "other vocab", "other config", "other optimizer"])
def test_resume_refuses_a_damaged_checkpoint(corpus, tmp_path, damage):
    out = tmp_path / "run"
    kept = _finished_run(out, corpus, tmp_path)
    ckpt = out / "checkpoint"
    weights = ckpt / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "deleted":
        weights.unlink()
    else:  # files of a run whose tokenizer (so model and optimizer) is smaller
        other = tmp_path / "other"
        assert _tiny(other, corpus, tmp_path, "--vocab-size", 300).exit_code == 0
        names = {"other vocab": ["model.safetensors"], "other optimizer": ["optimizer.safetensors"],
                 "other config": ["config.json", "model.safetensors", "tokenizer.model"]}[damage]
        for name in names:
            (ckpt / name).write_bytes((other / "checkpoint" / name).read_bytes())
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), "cannot resume")
    _assert_untouched(out, kept)


@pytest.mark.parametrize("text", ["{}", "[]", "not json", '{"step": 4}', '{"step": 4, "optimizer": {}}'])
def test_resume_refuses_a_malformed_trainer_state(corpus, tmp_path, text):
    out = tmp_path / "run"
    kept = _finished_run(out, corpus, tmp_path)
    (out / "checkpoint" / "trainer_state.json").write_text(text)
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), "trainer_state.json")
    _assert_untouched(out, kept)


def test_resume_without_a_checkpoint(corpus, tmp_path):
    _assert_user_error(_run("--out", tmp_path / "nothing", "--resume"), "no run to resume")
    (tmp_path / "empty").mkdir()
    _assert_user_error(_run("--out", tmp_path / "empty", "--resume"), "no switchhead training run")
    assert not (tmp_path / "nothing").exists() and not any((tmp_path / "empty").iterdir())
    out = tmp_path / "run"
    kept = _finished_run(out, corpus, tmp_path)
    ckpt = out / "checkpoint"
    # A crash between atomic_directory's two renames leaves only the old checkpoint, moved aside.
    aside = out / ".checkpoint.old-4242"
    ckpt.rename(aside)
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), f"rename {aside} to {ckpt}")
    _assert_untouched(out, kept)
    assert not ckpt.exists()  # pointed out, not repaired
    shutil.rmtree(aside)
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), "has no checkpoint/ to resume from")
    _assert_untouched(out, kept)


@pytest.mark.parametrize(("flag", "value"), [("--lr", "inf"), ("--grad-clip", "nan"), ("--grad-clip", "inf"),
                                           ("--seed", str(2**64)), ("--seed", "-1")])
def test_non_finite_options(corpus, tmp_path, flag, value):  # and seeds torch.manual_seed cannot take
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, flag, value), flag)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("key", "value"), [("grad_clip", float("nan")), ("grad_clip", float("inf")),
                                            ("ff_entropy_coef", float("nan")), ("ff_entropy_coef", float("inf"))])
def test_non_finite_config_values(corpus, tmp_path, key, value):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**switchhead.PRESETS["tiny-switchhead"].to_dict(), key: value}))  # NaN / Infinity
    r = _run("--config", cfg, "--data", corpus, "--out", tmp_path / "o", "--vocab-size", 400, "--steps", 4,
             "--batch-size", 2, "--cache-dir", tmp_path / "cache", "--no-progress")
    _assert_user_error(r, f"ModelConfig.{key}")
    assert not (tmp_path / "o").exists()


def test_run_killed_before_its_first_checkpoint_starts_over(corpus, tmp_path, monkeypatch):
    import switchhead.train.loop as loop
    from switchhead.errors import SwitchheadError

    def crash(*args):
        raise SwitchheadError("crashed")

    # Stopped while marking the directory as a run: nothing of it may make the directory a stranger's.
    out = tmp_path / "run"
    monkeypatch.setattr(loop, "write_run_spec", crash)
    _assert_user_error(_tiny(out, corpus, tmp_path), "crashed")
    monkeypatch.undo()
    assert _tiny(out, corpus, tmp_path).exit_code == 0
    # Stopped in the first checkpoint save; a SIGKILL removes no temporaries, so they are made here by hand.
    out = tmp_path / "run2"
    monkeypatch.setattr(loop, "write_training_checkpoint", crash)
    _assert_user_error(_tiny(out, corpus, tmp_path), "crashed")
    monkeypatch.undo()
    (out / ".checkpoint.tmp-k3j9x2ab").mkdir()
    (out / ".checkpoint.tmp-k3j9x2ab" / "model.safetensors").write_bytes(b"half")
    (out / ".metrics.jsonl.4242.tmp").write_text('{"step"')
    _assert_user_error(_run("--out", out, "--resume", "--no-progress"), "stopped before its first checkpoint")
    r = _tiny(out, corpus, tmp_path)
    assert r.exit_code == 0, r.output
    switchhead.load(out / "final")
    assert not (out / ".checkpoint.tmp-k3j9x2ab").exists() and not (out / ".metrics.jsonl.4242.tmp").exists()


def test_two_runs_never_share_an_out_dir(corpus, tmp_path):
    import fcntl
    import os

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a run in progress there holds it
        _assert_user_error(_tiny(out, corpus, tmp_path), f"--out {out} is in use by another training run")
        assert not any(out.iterdir())
        # A run at work before its first checkpoint has written run.json and its tokenizer: what is reported is
        # that it is running (--resume said it had stopped), and before any tokenizing.
        assert _tiny(tmp_path / "done", corpus, tmp_path / "elsewhere").exit_code == 0
        for name in ("run.json", "tokenizer.model"):
            shutil.copy(tmp_path / "done" / name, out / name)
        _assert_user_error(_run("--out", out, "--resume"), f"--out {out} is in use by another training run")
        _assert_user_error(_tiny(out, corpus, tmp_path), f"--out {out} is in use by another training run")
        assert not (tmp_path / "cache").exists()
    finally:
        os.close(fd)
    r = _tiny(out, corpus, tmp_path)
    assert r.exit_code == 0, r.output


def test_run_dir_on_a_file_system_without_locks(corpus, tmp_path, monkeypatch):
    import errno
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    r = _tiny(tmp_path / "run", corpus, tmp_path)
    assert r.exit_code == 0, r.output  # trains unguarded instead of calling the directory busy


def test_resume_refuses_steps_below_the_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    kept = _finished_run(out, corpus, tmp_path)
    _assert_user_error(_run("--out", out, "--resume", "--steps", 3), "at step 4, past --steps 3")
    _assert_untouched(out, kept)
    r = _run("--out", out, "--resume", "--steps", 4, "--no-progress")  # already complete: final/ as before
    assert r.exit_code == 0, r.output
    assert (out / "final" / "model.safetensors").read_bytes() == kept[0]


def test_resume_records_the_options_it_may_change(corpus, tmp_path):
    out = tmp_path / "run"
    _finished_run(out, corpus, tmp_path)
    r = _run("--out", out, "--resume", "--steps", 6, "--save-every", 3, "--no-progress")
    assert r.exit_code == 0, r.output
    options = json.loads((out / "run.json").read_text())["options"]
    assert (options["steps"], options["save_every"]) == (6, 3)
    r = _run("--out", out, "--resume", "--no-progress")  # continues with --steps 6, not the first run's 4
    assert r.exit_code == 0, r.output
    _assert_user_error(_run("--out", out, "--resume", "--lr", 1e-3), "lr changed since the run started")
    assert json.loads((out / "run.json").read_text())["options"]["steps"] == 6  # a refused resume records nothing


def test_plain_resume_keeps_the_dtype_and_the_cache(corpus, tmp_path, monkeypatch):
    """--dtype, --device and --cache-dir left out of --resume are those of the run: the dtype used to fall back to
    the default (float32 on a CPU, so a bf16 run went on in fp32), a relative cache to the current directory."""
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    args = ("--config", "tiny-switchhead", "--data", corpus, "--vocab-size", 400, "--batch-size", 2, "--no-progress")
    r = _run(*args, "--out", out, "--steps", 4, "--dtype", "bfloat16", "--cache-dir", "rel-cache")
    assert r.exit_code == 0, r.output
    options = json.loads((out / "run.json").read_text())["options"]
    assert (options["dtype"], options["cache_dir"]) == ("bfloat16", str((tmp_path / "rel-cache").resolve()))
    given = Path(shutil.copytree(out, tmp_path / "given"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for run, extra in ((out, ()), (given, ("--dtype", "bfloat16"))):
        r = _run("--out", run, "--resume", "--steps", 7, "--no-progress", *extra)
        assert r.exit_code == 0, r.output
    assert not (tmp_path / "elsewhere" / "rel-cache").exists()  # the run's own token cache, found from anywhere
    resumed, explicit = (load_file(str(run / "final" / "model.safetensors")) for run in (out, given))
    for k, w in explicit.items():
        assert torch.equal(resumed[k], w), k


@pytest.mark.parametrize("what", ["notes", "file"])
def test_resume_refuses_a_final_dir_it_could_not_replace_before_training(corpus, tmp_path, what):
    out = tmp_path / "run"
    kept = _finished_run(out, corpus, tmp_path)
    ckpt = (out / "checkpoint" / "model.safetensors").read_bytes()
    if what == "notes":
        (out / "final" / "NOTES.md").write_text("mine")
    else:
        shutil.rmtree(out / "final")
        (out / "final").write_text("mine")
        kept = None
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), f"{out / 'final'} is not a switchhead checkpoint")
    assert (out / "checkpoint" / "model.safetensors").read_bytes() == ckpt  # no step was run
    if kept is not None:
        _assert_untouched(out, kept)
        assert (out / "final" / "NOTES.md").read_text() == "mine"
    else:
        assert (out / "final").read_text() == "mine"


def test_resume_where_the_checkpoint_is_a_file(corpus, tmp_path):
    out = tmp_path / "run"
    _finished_run(out, corpus, tmp_path)
    shutil.rmtree(out / "checkpoint")
    (out / "checkpoint").write_text("")
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6), f"{out / 'checkpoint'} is not a directory")


def test_out_that_cannot_be_written_is_refused_before_any_work(corpus, tmp_path, monkeypatch):
    out = tmp_path / "locked"
    out.mkdir(mode=0o500)
    real = fileio.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # root may write anywhere: refuse the probe as the kernel refuses others
        if Path(dir) == out:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(fileio.tempfile, "mkstemp", mkstemp)
    _assert_user_error(_tiny(out, corpus, tmp_path), f"--out {out}: cannot write in {out}: Permission denied")
    assert not (tmp_path / "cache").exists()  # neither a tokenizer nor token caches were made first


def test_cache_dir_that_cannot_be_a_directory(corpus, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    _assert_user_error(_run("--config", "tiny-switchhead", "--data", corpus, "--out", tmp_path / "o", "--cache-dir", f),
                       f"--cache-dir {f} exists and is not a directory")
    _assert_user_error(_run("--config", "tiny-switchhead", "--data", corpus, "--out", tmp_path / "o", "--cache-dir",
                            f / "sub"), "is not a directory")
    assert f.read_text() == "x" and not (tmp_path / "o").exists()


def test_data_that_is_not_utf8(corpus, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(corpus.read_bytes() + b"\nand then \xff\x80")
    offset = len(corpus.read_bytes()) + 10
    _assert_user_error(_tiny(tmp_path / "o", bad, tmp_path), f"{bad}: not valid UTF-8 (byte 0xff at offset {offset}")
    binary = tmp_path / "binary.txt"  # was "training data too short: 4 tokens"
    binary.write_bytes(b"\xff" * 1000)
    _assert_user_error(_tiny(tmp_path / "o", binary, tmp_path), f"{binary}: not valid UTF-8 (byte 0xff at offset 0")
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--eval-data", bad), f"{bad}: not valid UTF-8")
    assert not (tmp_path / "o").exists() and not (tmp_path / "cache").exists()  # refused before any work


def test_diverging_run_stops_without_saving_nan_weights(corpus, tmp_path):
    # lr 1e6: the loss of step 1 is finite, but its update leaves weights that give a NaN loss from step 2 on.
    out = tmp_path / "run"
    r = _tiny(out, corpus, tmp_path, "--lr", "1e6", "--steps", 6, "--save-every", 1, "--log-every", 3)
    _assert_user_error(r, f"training diverged at step 2: the weights are not finite; stopped without saving it "
                          f"({out / 'checkpoint'} still holds step 1); start a new run with a lower --lr than 1e+06")
    assert not (out / "final").exists()
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    model, _ = switchhead.load(out / "checkpoint")
    assert all(p.isfinite().all() for p in model.parameters())
    # A NaN checkpoint (written before these checks existed) is refused when it is read: final/ is not made of it.
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "checkpoint" / "model.safetensors"))
    weights["out.bias"][0] = float("nan")
    save_file(weights, str(out / "checkpoint" / "model.safetensors"))
    _assert_user_error(_run("--out", out, "--resume", "--steps", 1, "--no-progress"),
                       "checkpoint/model.safetensors: tensor out.bias has NaN or infinite values")
    assert not (out / "final").exists()
    # Caught at the loss, before the first save: the step is the first with a NaN loss, and nothing is logged.
    out = tmp_path / "run2"
    _assert_user_error(_tiny(out, corpus, tmp_path, "--lr", "1e6", "--steps", 6, "--log-every", 5),
                       "diverged at step 2: the training loss is nan; stopped without saving it (no checkpoint")
    assert not (out / "checkpoint").exists() and not (out / "final").exists()
    assert (out / "metrics.jsonl").read_text() == ""
    # That run left no weights: --resume says so, and a new run (as the error advises) starts over in its --out.
    _assert_user_error(_run("--out", out, "--resume", "--steps", 6, "--no-progress"),
                       f"cannot resume: the run in {out} stopped before its first checkpoint; run again without")
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n')
    r = _tiny(out, corpus, tmp_path, "--steps", 2, "--log-every", 1, "--vocab-size", 300)  # a new tokenizer too
    assert r.exit_code == 0, r.output
    assert (out / "final" / "model.safetensors").exists()
    assert (out / "tokenizer.model").read_bytes() == (out / "final" / "tokenizer.model").read_bytes()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # A NaN validation loss stops the run too, before it is logged.
    out = tmp_path / "run3"
    r = _tiny(out, corpus, tmp_path, "--lr", "1e6", "--steps", 6, "--eval-data", corpus, "--eval-every", 1)
    _assert_user_error(r, "diverged at step 1: the validation loss is nan")
    assert not (out / "checkpoint").exists() and (out / "metrics.jsonl").read_text() == ""
    # So large that AdamW's first step cannot be applied to float32 weights (it crashed): refused up front.
    _assert_user_error(_tiny(tmp_path / "o", corpus, tmp_path, "--lr", "1e308"), "--lr must be at most 1.7e+37")
    assert not (tmp_path / "o").exists()


def _fail_nth_loss(monkeypatch, n: int, exc: Exception) -> None:
    """Let torch's cross_entropy (every training step and evaluation batch calls it once) raise `exc` on its n-th
    call: an allocation failing mid-run, as a batch too large for the device's memory makes it."""
    import torch.nn.functional as F

    real, calls = F.cross_entropy, []

    def cross_entropy(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", cross_entropy)


CUDA_OOM = "CUDA out of memory. Tried to allocate 20.00 GiB"
CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 9"


@pytest.mark.parametrize(
    "exc", [torch.OutOfMemoryError(CUDA_OOM), RuntimeError(CPU_OOM), MemoryError()], ids=["cuda", "cpu", "python"]
)
def test_out_of_memory_stops_in_one_line_and_keeps_the_checkpoint(corpus, tmp_path, monkeypatch, exc):
    out = tmp_path / "run"
    _fail_nth_loss(monkeypatch, 3, exc)
    chunk = switchhead.PRESETS["tiny-switchhead"].chunk_len
    r = _tiny(out, corpus, tmp_path, "--steps", 6, "--save-every", 2)
    _assert_user_error(r, f"out of memory on cpu in step 3 (2 lanes x {chunk} tokens); stopped ({out / 'checkpoint'} "
                          "still holds step 2); use a larger --grad-accum (dividing 2) or a smaller --batch-size")
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    switchhead.load(out / "checkpoint")
    assert not (out / "final").exists()


def test_out_of_memory_in_pieces_of_one_lane(corpus, tmp_path, monkeypatch):
    _fail_nth_loss(monkeypatch, 3, MemoryError())  # step 2, first piece
    chunk = switchhead.PRESETS["tiny-switchhead"].chunk_len
    r = _tiny(tmp_path / "run", corpus, tmp_path, "--grad-accum", 2)
    _assert_user_error(r, f"out of memory on cpu in step 2 (2 lanes x {chunk} tokens, in 2 pieces); stopped (no "
                          "checkpoint was written); use a smaller --batch-size")


def test_out_of_memory_in_evaluation_names_the_eval_batch(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _fail_nth_loss(monkeypatch, 2, torch.OutOfMemoryError(CUDA_OOM))  # step 1, then its evaluation
    chunk = switchhead.PRESETS["tiny-switchhead"].chunk_len
    r = _tiny(out, corpus, tmp_path, "--eval-data", corpus, "--eval-every", 1, "--eval-batch-size", 3)
    _assert_user_error(r, f"out of memory on cpu in the evaluation after step 1 (3 lanes x {chunk} tokens); stopped "
                          "(no checkpoint was written); use a smaller --eval-batch-size")


def test_other_runtime_errors_are_not_called_out_of_memory(corpus, tmp_path, monkeypatch):
    _fail_nth_loss(monkeypatch, 2, RuntimeError("something else broke"))
    r = _tiny(tmp_path / "run", corpus, tmp_path)
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "something else broke"


def test_resume_with_a_renamed_config(corpus, tmp_path):
    out = tmp_path / "run"
    assert _tiny(out, corpus, tmp_path).exit_code == 0
    cfg = tmp_path / "cfg.json"
    cfg.write_text(switchhead.PRESETS["tiny-switchhead"].replace(name="my-model").to_json())
    r = _run("--out", out, "--resume", "--config", cfg, "--steps", 6, "--no-progress")
    assert r.exit_code == 0, r.output  # the name is a label, not part of the model
    cfg.write_text(switchhead.PRESETS["tiny-switchhead"].replace(name="other", n_heads=4).to_json())
    r = _run("--out", out, "--resume", "--config", cfg, "--steps", 8)
    _assert_user_error(r, "model config changed since the run started (n_heads: 2 -> 4)")


@pytest.mark.parametrize("device,message", [
    ("meta", "device 'meta' cannot run a model"), ("nope", "unknown device 'nope'"),
])
def test_device_that_cannot_train(corpus, tmp_path, device, message):
    out = tmp_path / "run"
    _assert_user_error(_tiny(out, corpus, tmp_path, "--device", device), message)
    assert not out.exists()


def test_model_larger_than_the_machine_is_refused_before_any_work(corpus, tmp_path):
    # ~9e12 parameters: 16 bytes each for weights, gradients and AdamW state is more memory than any machine
    # has, so the run stops before the tokenizer is trained, instead of in an allocation traceback after it.
    cfg = tmp_path / "huge.json"
    cfg.write_text(switchhead.PRESETS["tiny-switchhead"].replace(n_layers=4096, d_model=2**14, d_ff=2**16).to_json())
    out = tmp_path / "run"
    r = _run("--config", cfg, "--data", corpus, "--out", out, "--cache-dir", tmp_path / "cache", "--no-progress")
    _assert_user_error(r, "needs at least")
    assert "GiB for its weights, gradients and AdamW state; this machine has" in r.output
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_every_slow_stage_shows_progress(corpus, tmp_path):
    """Tokenizer training, the steps and each validation say what is going on (on stderr; tokenizing the data
    does too, once it has taken a second)."""
    r = _run("--config", "tiny-switchhead", "--data", corpus, "--out", tmp_path / "o", "--vocab-size", 400,
             "--steps", 2, "--batch-size", 2, "--eval-data", corpus, "--eval-every", 1,
             "--cache-dir", tmp_path / "cache")
    assert r.exit_code == 0, r.output
    for label in ("training a tokenizer (vocab size up to 400)", "validation:", "train:"):
        assert label in r.stderr, (label, r.stderr[-2000:])


def test_a_full_disk_at_the_checkpoint_is_one_line_naming_it(corpus, tmp_path):
    """safetensors reports a failed write as its own error type, which escaped as a traceback (exit code 1); the
    error named the model files' temporary directory, gone by the time the user reads it."""
    out = tmp_path / "run"
    with file_size_limit(100_000):  # the weights are ~0.5 MB, the tokenizer, run.json and token cache far less
        r = _tiny(out, corpus, tmp_path)
    _assert_user_error(r, f"cannot write {out / 'checkpoint'}: File too large")
    assert not (out / "checkpoint").exists() and not list(out.glob(".checkpoint*")), list(out.iterdir())


def test_a_full_disk_at_the_metrics_log_is_one_line_naming_it(corpus, tmp_path):
    assert _tiny(tmp_path / "first", corpus, tmp_path).exit_code == 0  # the token cache, before the limit
    out = tmp_path / "run"
    with file_size_limit(8_000):  # ~50 metric lines; each other file of a run before its checkpoint fits
        r = _tiny(out, corpus, tmp_path, "--steps", 120, "--log-every", 1, "--warmup", 10)
    _assert_user_error(r, f"cannot write {out / 'metrics.jsonl'}: File too large")
