"""End-to-end training: loss goes down, checkpoints load, SIGKILL + --resume continues exactly, SIGTERM saves."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import WORDS, write_corpus

import switchhead
from switchhead.errors import CheckpointError, SwitchheadError
from switchhead.model.config import PRESETS
from switchhead.model.lm import TransformerLM
from switchhead.train import TrainOptions, evaluate, train
from switchhead.train.data import TokenStream

REPO = Path(switchhead.__file__).resolve().parents[1]


def _corpus(path, n_lines=400, seed=0):
    words = "the cat sat on a mat and then 42 dogs ran over 1999 hills while birds sang".split()
    return write_corpus(path, words, n_lines, 12, seed)


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    return {m["step"]: m["loss"] for m in _metrics(out) if "loss" in m}


def _subprocess_env():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_loss_decreases_and_checkpoint_loads(tmp_path):
    data = tmp_path / "rep.txt"
    data.write_text("the quick brown fox jumps over the lazy dog 123 times.\n" * 300)
    held = tmp_path / "held.txt"
    held.write_text("the quick brown fox jumps over the lazy dog 123 times.\n" * 20)
    out = tmp_path / "run"
    res = train(
        TrainOptions(
            config="tiny-switchhead",
            data=[str(data)],
            eval_data=[str(held)],
            out=str(out),
            vocab_size=400,
            steps=80,
            batch_size=4,
            lr=3e-3,
            log_every=10,
            eval_every=40,
            save_every=40,
            cache_dir=str(tmp_path / "cache"),
            progress=False,
        )
    )
    losses = _losses(out)
    assert losses[80] < 0.3 * losses[10], losses
    vals = [m for m in _metrics(out) if "val_ppl" in m]
    assert [v["step"] for v in vals] == [40, 80] and vals[-1]["val_ppl"] < vals[0]["val_ppl"] < 50
    assert res.final == out / "final" and not res.interrupted
    model, sp = switchhead.load(out / "final")
    assert model.config.vocab_size == sp.get_piece_size() <= 400
    assert model.config.name == "tiny-switchhead"
    # The final weights are the trained ones: the loaded model predicts the corpus well.
    ids = torch.tensor([sp.encode("the quick brown fox jumps over the lazy dog 123 times.\n" * 3)])
    with torch.no_grad():
        logits, _ = model(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert nll < 1.0
    # The training checkpoint is a loadable model checkpoint too, equal to the final one.
    again, _ = switchhead.load(out / "checkpoint")
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("config", ["tiny-switchhead", "tiny-switchhead-rope-nomem"])
def test_gradient_accumulation_follows_the_whole_batch(tmp_path, config):
    # Lanes run in pieces, each piece with its own lanes' memory, must give the whole batch's mean-loss gradient:
    # the same losses and gradient norms step by step (Adam alone would hide a wrong scale), also across a resume
    # with another number of pieces (the memory comes back in lane order).
    data = _corpus(tmp_path / "a.txt")
    common = dict(config=config, data=[str(data)], vocab_size=400, steps=8, batch_size=4, lr=2e-3, log_every=1,
                  save_every=4, cache_dir=str(tmp_path / "cache"), progress=False)
    # Both runs stop at step 4 and resume to 8 (the schedule follows --steps, so both must change it alike).
    for out, first, then in (("whole", 1, 1), ("pieces", 4, 2)):
        train(TrainOptions(out=str(tmp_path / out), grad_accum=first, **{**common, "steps": 4}))
        train(TrainOptions(out=str(tmp_path / out), grad_accum=then, resume=True, **common))
    pieces = tmp_path / "pieces"
    whole, split = _metrics(tmp_path / "whole"), _metrics(pieces)
    assert [m["step"] for m in split] == list(range(1, 9))
    for a, b in zip(whole, split):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        assert a["grad_norm"] > 0
    m_whole, _ = switchhead.load(tmp_path / "whole" / "final")
    m_split, _ = switchhead.load(pieces / "final")
    for (k, x), y in zip(m_whole.state_dict().items(), m_split.state_dict().values()):
        # Adam divides by sqrt(v): where gradients are near zero (parts of the positional projection) it magnifies
        # summation-order noise to ~1e-4 (as between DDP and one process).
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3, msg=k)


def test_gradient_norm_is_logged_before_clipping(tmp_path):
    data = _corpus(tmp_path / "a.txt", n_lines=100)
    opts = dict(data=[str(data)], vocab_size=300, steps=3, batch_size=2, log_every=1,
                cache_dir=str(tmp_path / "cache"), progress=False)
    train(TrainOptions(out=str(tmp_path / "clipped"), config="tiny-switchhead", grad_clip=1e-3, **opts))
    train(TrainOptions(out=str(tmp_path / "free"), config="tiny-switchhead", grad_clip=0.0, **opts))
    clipped, free = _metrics(tmp_path / "clipped")[0], _metrics(tmp_path / "free")[0]
    assert clipped["grad_norm"] == pytest.approx(free["grad_norm"], rel=1e-6) and clipped["grad_norm"] > 1e-2
    # --grad-clip takes effect (not only in the log): it trains exactly as a config with that grad_clip does, and
    # differently from no clipping (the clip ratio changes from step to step, which Adam does not cancel).
    cfg = PRESETS["tiny-switchhead"].replace(grad_clip=1e-3)
    assert cfg.grad_clip != PRESETS["tiny-switchhead"].grad_clip
    train(TrainOptions(out=str(tmp_path / "config"), config=cfg, **opts))
    weights = {name: switchhead.load(tmp_path / name / "final")[0].state_dict()
               for name in ("clipped", "free", "config")}
    assert switchhead.load(tmp_path / "clipped" / "final")[0].config.grad_clip == 1e-3
    for k, w in weights["config"].items():
        assert torch.equal(weights["clipped"][k], w), k
    assert max((weights["clipped"][k] - w).abs().max().item() for k, w in weights["free"].items()) > 1e-6


def _launch(args):
    return subprocess.Popen(
        [sys.executable, "-m", "switchhead.train", *args],
        env=_subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path, proc, timeout=60):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


STEPS = 60


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    # Dropout on, so the RNG state has to be restored too, not only weights, optimizer and memory.
    cfg = tmp_path / "cfg.json"
    cfg.write_text(PRESETS["tiny-switchhead"].replace(dropout=0.1).to_json())
    data = _corpus(tmp_path / "a.txt")
    common = dict(
        data=[str(data)],
        vocab_size=400,
        steps=STEPS,
        batch_size=4,
        lr=2e-3,
        warmup=3,
        log_every=4,  # checkpoints at 5, 10, 15 fall inside a log interval: its first steps ran before the kill
        save_every=5,
        cache_dir=str(tmp_path / "cache"),
        progress=False,
    )
    ref = tmp_path / "ref"
    train(TrainOptions(config=str(cfg), out=str(ref), **common))

    out = tmp_path / "killed"
    proc = _launch(
        [
            "--config",
            str(cfg),
            "--data",
            str(data),
            "--out",
            str(out),
            "--vocab-size",
            "400",
            "--steps",
            str(STEPS),
            "--batch-size",
            "4",
            "--lr",
            "2e-3",
            "--warmup",
            "3",
            "--log-every",
            "4",
            "--save-every",
            "5",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
        ]
    )
    _wait_for(out / "checkpoint" / "trainer_state.json", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), "the run finished before it could be killed"
    saved = json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"]
    assert 5 <= saved < STEPS and saved % 5 == 0

    res = train(TrainOptions(config=str(cfg), out=str(out), resume=True, **common))
    assert res.step == STEPS and not res.interrupted
    a, b = _losses(ref), _losses(out)
    assert sorted(b) == list(range(4, STEPS + 1, 4))  # lines the killed run logged after its checkpoint are gone
    for step in (s for s in b if s > saved):  # the first averages steps run before the kill, too
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    m_ref, _ = switchhead.load(ref / "final")
    m_res, _ = switchhead.load(out / "final")
    for (k, x), y in zip(m_ref.state_dict().items(), m_res.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=k)


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path):
    data = _corpus(tmp_path / "a.txt")
    out = tmp_path / "run"
    proc = _launch(
        [
            "--config",
            "tiny-switchhead",
            "--data",
            str(data),
            "--out",
            str(out),
            "--vocab-size",
            "400",
            "--steps",
            "100000",
            "--batch-size",
            "4",
            "--log-every",
            "1",
            "--save-every",
            "100000",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-progress",
        ]
    )
    _wait_for(out / "metrics.jsonl", proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err  # as the shell reports a process SIGTERM stopped
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert 0 < state["step"] < 100000 and "interrupted after step" in err
    assert max(_losses(out)) == state["step"]
    model, sp = switchhead.load(out / "checkpoint")
    assert sp is not None and model.config.vocab_size == sp.get_piece_size()


def test_resume_needs_a_run_and_its_checkpoint(tmp_path):
    data = _corpus(tmp_path / "a.txt", n_lines=100)
    opts = dict(config="tiny-switchhead", data=[str(data)], vocab_size=300, steps=3, batch_size=2,
                cache_dir=str(tmp_path / "cache"), progress=False)
    with pytest.raises(SwitchheadError, match="no run to resume"):
        train(TrainOptions(out=str(tmp_path / "new"), resume=True, **opts))
    assert not (tmp_path / "new").exists()  # not silently started from scratch
    out = tmp_path / "run"
    train(TrainOptions(out=str(out), **opts))
    shutil.rmtree(out / "checkpoint")
    final = (out / "final" / "model.safetensors").read_bytes()
    with pytest.raises(SwitchheadError, match="has no checkpoint/"):
        train(TrainOptions(out=str(out), resume=True, **{**opts, "steps": 5}))
    assert (out / "final" / "model.safetensors").read_bytes() == final and max(_losses(out)) == 3


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run that saved its checkpoint at step 4 of 4 (copied by each test that damages it), and its options."""
    base = tmp_path_factory.mktemp("saved")
    data = _corpus(base / "a.txt", n_lines=100)
    opts = dict(config="tiny-switchhead", data=[str(data)], vocab_size=300, steps=4, batch_size=2, log_every=1,
                save_every=2, cache_dir=str(base / "cache"), progress=False)
    train(TrainOptions(out=str(base / "run"), **opts))
    return base / "run", opts


def _snapshot(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("when", ["resume", "save"])
def test_a_checkpoint_dir_holding_other_files_is_never_replaced(tmp_path, saved_run, monkeypatch, when):
    # Every save replaces OUT/checkpoint as a whole: files a user put there would go with the old checkpoint.
    run, opts = saved_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    notes, evals = out / "checkpoint" / "NOTES.md", out / "checkpoint" / "evals"
    if when == "resume":  # refused before a single step is spent (each would be logged: log_every=1)
        notes.write_text("notes")
        evals.mkdir()
        (evals / "res.json").write_text("1")
        kept = _snapshot(out)
        with pytest.raises(CheckpointError, match=r"checkpoint holds NOTES\.md, evals/, not part of a training "):
            train(TrainOptions(out=str(out), resume=True, **{**opts, "steps": 6}))
        assert _snapshot(out) == kept
        return
    from switchhead.train import loop
    lr_at = loop.lr_at

    def notes_at_step_5(step, *args):  # written while the run trains, after --resume looked
        if step == 4:
            notes.write_text("notes")
        return lr_at(step, *args)

    monkeypatch.setattr(loop, "lr_at", notes_at_step_5)
    ckpt = _snapshot(out / "checkpoint")
    with pytest.raises(CheckpointError, match="cannot save the checkpoint of step 6: .*holds NOTES.md"):
        train(TrainOptions(out=str(out), resume=True, **{**opts, "steps": 6}))
    assert _snapshot(out / "checkpoint") == {**ckpt, "NOTES.md": b"notes"}


def _damage(ckpt, part, change):
    """Rewrite one file of the training checkpoint `ckpt` (optimizer, trainer: its tensors; state: its JSON)."""
    from safetensors.torch import load_file, save_file

    if part == "state":
        state = json.loads((ckpt / "trainer_state.json").read_text())
        change(state)
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    else:
        tensors = load_file(ckpt / f"{part}.safetensors")
        change(tensors)
        save_file(tensors, ckpt / f"{part}.safetensors")


def _nan(tensors, key):
    tensors[key].view(-1)[0] = float("nan")


_MALFORMED = {  # what resuming used to crash on (a traceback), in the first step or before it
    "no exp_avg_sq": ("optimizer", lambda t: t.pop("state.3.exp_avg_sq"),
                      r"optimizer\.safetensors is malformed: parameter 3 has no exp_avg_sq"),
    "betas": ("state", lambda s: s["optimizer"]["param_groups"][0].update(betas="x"),
              r"trainer_state\.json is malformed: optimizer\.param_groups\[0\]\.betas must be 2 numbers"),
    "eps": ("state", lambda s: s["optimizer"]["param_groups"][0].update(eps=None),
            r"trainer_state\.json is malformed: optimizer\.param_groups\[0\]\.eps must be a finite number"),
    "losses": ("state", lambda s: s["log_interval_by_rank"][0].update(losses=["abc"]),
               r"trainer_state\.json is malformed: 'log_interval_by_rank\[0\]\.losses' must be a list of numbers"),
    "grad norms": ("state", lambda s: s["log_interval_by_rank"][0].update(grad_norms=["x"]),
                   r"trainer_state\.json is malformed: 'log_interval_by_rank\[0\]\.grad_norms' must be a list"),
    # was a note that the process count had changed, and a run whose dropout masks differed
    "no RNG": ("trainer", lambda t: [t.pop(k) for k in list(t) if k.startswith("rng.")],
               r"the RNG state of process 0 is missing in .*checkpoint"),
}
_CORRUPT = {  # what resuming used to accept, to report a diverged run or an error naming no file, or to run on
    "NaN moment": ("optimizer", lambda t: _nan(t, "state.2.exp_avg"),
                   r"optimizer\.safetensors is corrupt: tensor state\.2\.exp_avg has NaN"),
    "NaN memory": ("trainer", lambda t: _nan(t, "memory"), r"trainer\.safetensors is corrupt: tensor memory has NaN"),
    "int memory": ("trainer", lambda t: t.update(memory=t["memory"].long()),
                   r"memory in .*trainer\.safetensors is int64 of shape \(2, 2, 16, 64\), expected float32"),
    "short memory": ("trainer", lambda t: t.update(memory=t["memory"][:, :, :3].contiguous()),
                     r"memory in .*trainer\.safetensors is float32 of shape \(2, 2, 3, 64\), expected float32 of "
                     r"shape \(2, 2, 16, 64\)"),
}


def _assert_resume_refused(tmp_path, saved_run, part, change, message):
    run, opts = saved_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    _damage(out / "checkpoint", part, change)
    kept = _snapshot(out)
    with pytest.raises(CheckpointError, match=r"cannot resume.*" + message):
        train(TrainOptions(out=str(out), resume=True, **{**opts, "steps": 6}))
    assert _snapshot(out) == kept


@pytest.mark.parametrize("damage", _MALFORMED)
def test_resume_refuses_a_malformed_training_state(tmp_path, saved_run, damage):
    _assert_resume_refused(tmp_path, saved_run, *_MALFORMED[damage])


@pytest.mark.parametrize("damage", _CORRUPT)
def test_resume_refuses_non_finite_or_mismatched_training_state(tmp_path, saved_run, damage):
    _assert_resume_refused(tmp_path, saved_run, *_CORRUPT[damage])


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_training_follows_a_reference_loop(tmp_path, sp, grad_accum):
    # Written out by hand from the documented recipe: each file's tokens then EOS, B contiguous lanes restarted
    # every epoch, memory = the previous chunk's, AdamW (wd 0), linear warm-up then cosine to zero, global-norm
    # clipping, loss = mean LM loss + entropy regulariser (per piece of --grad-accum, averaged). A strong
    # regulariser and a tight clip make a wrong weighting of either visible; 9 steps cross an epoch boundary.
    tok = tmp_path / "tok.model"
    tok.write_bytes(sp.serialized_model_proto())
    files = [write_corpus(tmp_path / f"{i}.txt", WORDS, 5, 8, seed=i) for i in range(2)]
    cfg = PRESETS["tiny-switchall"].replace(ff_entropy_coef=1.0, grad_clip=0.05, vocab_size=sp.get_piece_size())
    B, steps, lr, warmup, seed = 4, 9, 3e-3, 3, 5
    out = tmp_path / "run"
    train(TrainOptions(config=cfg, data=[str(f) for f in files], out=str(out), tokenizer=str(tok), steps=steps,
                       batch_size=B, grad_accum=grad_accum, lr=lr, warmup=warmup, seed=seed, log_every=1,
                       cache_dir=str(tmp_path / "cache"), progress=False))

    ids = np.array([t for f in files for t in sp.encode(f.read_text()) + [sp.eos_id()]])
    T, lane = cfg.chunk_len, len(ids) // B
    per_epoch = (lane - 1) // T
    assert per_epoch < steps
    torch.manual_seed(seed)
    model = TransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    memory, losses = None, []
    for step in range(steps):
        s = step % per_epoch
        memory = None if s == 0 else memory
        rows = torch.tensor(np.stack([ids[b * lane + s * T : b * lane + s * T + T + 1] for b in range(B)]))
        progress = (step - warmup) / (steps - warmup)
        rate = lr * (step + 1) / warmup if step < warmup else lr * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = rate
        opt.zero_grad()
        pieces, new_memory, n = [], [], B // grad_accum
        for i in range(grad_accum):
            part = rows[i * n : (i + 1) * n]
            logits, m = model(part[:, :-1], None if memory is None else memory[:, i * n : (i + 1) * n])
            lm = F.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten())
            ((lm + model.aux_loss()) / grad_accum).backward()
            pieces.append(lm.item())
            new_memory.append(m)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        memory, losses = torch.cat(new_memory, 1), [*losses, sum(pieces) / grad_accum]

    assert [m["loss"] for m in _metrics(out)] == pytest.approx(losses, rel=1e-5)
    trained, _ = switchhead.load(out / "final")
    for (k, x), y in zip(model.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6, msg=k)


def test_validation_scores_every_held_out_token_in_eval_mode(sp):
    # Per-token loss over every token but the first, each lane run whole (the model chunks it, carrying memory),
    # with dropout off; the model goes back to training mode afterwards.
    cfg = PRESETS["tiny-switchall"].replace(dropout=0.3, ff_expert_dropout=0.3, vocab_size=sp.get_piece_size())
    torch.manual_seed(0)
    model = TransformerLM(cfg).double().train()
    for n, lanes in ((200, 4), (97, 3), (70, 4)):
        ids = np.random.default_rng(n).integers(0, cfg.vocab_size, n)
        got = evaluate(model, TokenStream([ids[: n // 3], ids[n // 3 :]]), lanes, torch.device("cpu"))
        assert model.training
        per_lane = -(-(n - 1) // lanes)  # these streams have at least `lanes` chunks of targets
        nll = 0.0
        with torch.no_grad():
            model.eval()
            for b in range(-(-(n - 1) // per_lane)):
                lane = torch.tensor(ids[b * per_lane : (b + 1) * per_lane + 1])[None]
                nll += F.cross_entropy(model(lane[:, :-1])[0][0], lane[0, 1:], reduction="sum").item()
            model.train()
        assert got["val_tokens"] == n - 1
        assert got["val_loss"] == pytest.approx(nll / (n - 1), rel=1e-12)
        assert got["val_ppl"] == pytest.approx(math.exp(nll / (n - 1)), rel=1e-12)


def _options(tmp_path, **changes):
    corpus = _corpus(tmp_path / "corpus.txt", n_lines=60)
    base = dict(config="tiny-switchhead", data=[str(corpus)], out=str(tmp_path / "run"), vocab_size=300, steps=2,
                batch_size=2, log_every=1, eval_every=2, save_every=2, cache_dir=str(tmp_path / "cache"),
                progress=False)
    return TrainOptions(**{**base, **changes})


@pytest.mark.parametrize("changes,message", [
    ({"data": 5}, "--data must be a file path (str or Path) or a list of them, got int"),
    ({"data": [b"corpus.txt"]}, "--data[0] must be a str or Path, got bytes"),
    ({"eval_data": [None]}, "--eval-data[0] must be a str or Path, got NoneType"),
    ({"out": None}, "--out must be a str or Path, got NoneType"),
    ({"out": ""}, "--out is empty"),
    ({"tokenizer": 3}, "--tokenizer must be a str or Path, got int"),
    ({"cache_dir": ["c"]}, "--cache-dir must be a str or Path, got list"),
    ({"config": None}, "--config must be a preset name, a config file or a ModelConfig, got None"),
    ({"device": 0}, "--device must be a string or None, got int"),
    ({"dtype": ["bf16"]}, "--dtype must be a string or None, got list"),
    ({"resume": "false"}, "resume must be True or False, got 'false'"),
    ({"unwrap": "no"}, "unwrap must be True or False, got 'no'"),
    ({"progress": 1}, "progress must be True or False, got 1"),
    ({"warmup": 3}, "--warmup 3 is longer than the run (--steps 2)"),
    ({"tokenizer_sentences": 0}, "tokenizer_sentences must be a positive integer, got 0"),
    ({"vocab_size": 200}, "--vocab-size must be at least 300 for a tokenizer trained on the data"),
])
def test_options_of_the_wrong_kind_are_one_line_errors_before_any_work(tmp_path, changes, message):
    with pytest.raises(SwitchheadError) as e:
        train(_options(tmp_path, **changes))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_train_refuses_what_is_not_train_options():
    with pytest.raises(SwitchheadError, match="train takes TrainOptions, got dict"):
        train({"config": "tiny-switchhead"})


@pytest.mark.parametrize("as_given", [str, Path])
def test_one_data_path_is_one_file(tmp_path, as_given):
    """A single str or Path is the file it names (a str was read as its characters, and "/" as every file on
    the machine); the run records the same data as the one-element list would."""
    opts = _options(tmp_path)
    (corpus,) = opts.data
    res = train(_options(tmp_path, data=as_given(corpus), eval_data=as_given(corpus)))
    assert res.step == 2 and res.final is not None
    spec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert [d["path"] for d in spec["data"]] == [str(Path(corpus).resolve())]
    assert spec["eval_data"] == [str(Path(corpus).resolve())]


@pytest.mark.parametrize("changes,message", [
    ({"n_lanes": 0}, "n_lanes must be a positive integer, got 0"),
    ({"n_lanes": 2.5}, "n_lanes must be a positive integer, got 2.5"),
    ({"device": "tpu"}, "unknown device 'tpu'"),
    ({"amp_dtype": "bfloat16"}, "amp_dtype must be torch.float32, torch.bfloat16 or torch.float16, got 'bfloat16'"),
    ({"amp_dtype": torch.int64}, "amp_dtype must be torch.float32"),
    ({"progress": True}, "progress must be a label (str) or None, got bool"),
    ({"stream": np.arange(50)}, "evaluate needs a TokenStream (switchhead.train.data), got ndarray"),
    ({"model": None}, "evaluate needs a TransformerLM, got NoneType"),
])
def test_evaluate_refuses_arguments_of_the_wrong_kind(changes, message):
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=50))
    args = {"model": model, "stream": TokenStream([np.arange(50)]), "n_lanes": 2, "device": "cpu", **changes}
    with pytest.raises(SwitchheadError) as e:
        evaluate(**args)
    assert message in str(e.value)


def test_evaluate_takes_a_device_name():
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=50))
    stream = TokenStream([np.random.default_rng(0).integers(0, 50, 80)])
    assert evaluate(model, stream, 2, "cpu") == evaluate(model, stream, 2, torch.device("cpu"))
