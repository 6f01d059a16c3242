"""Checkpoint round trip and every bad-checkpoint case."""

import json
import os
import re

import pytest
import sentencepiece as spm
import torch
from tiny import file_size_limit

import switchhead
from switchhead import PRESETS, CheckpointError, TransformerLM
from switchhead.errors import SwitchheadError
from switchhead.fileio import atomic_directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    text = d / "t.txt"
    text.write_text("\n".join(f"the cat {i} sat on the mat number {i * 7}" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(d / "m"), vocab_size=60, model_type="bpe",
                                   split_digits=True, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(d / "m.model"))


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny")])
def test_round_trip_bit_exact(tmp_path, name):
    model = TransformerLM(PRESETS[name])
    switchhead.save(tmp_path / "ck", model)
    loaded, tok = switchhead.load(tmp_path / "ck")
    assert tok is None and loaded.config == model.config and not loaded.training
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    ids = torch.randint(0, 512, (1, 9))
    model.eval()
    assert torch.equal(model(ids)[0], loaded(ids)[0])


def test_tokenizer_round_trip_and_overwrite(tmp_path, tokenizer):
    cfg = PRESETS["tiny-switchhead"].replace(vocab_size=tokenizer.get_piece_size())
    switchhead.save(tmp_path / "ck", TransformerLM(cfg), tokenizer)
    _, tok = switchhead.load(tmp_path / "ck")
    assert tok.encode("the cat 42") == tokenizer.encode("the cat 42")
    model2 = TransformerLM(cfg)
    switchhead.save(tmp_path / "ck", model2, tokenizer)  # replacing a checkpoint is allowed
    loaded, _ = switchhead.load(tmp_path / "ck")
    assert torch.equal(loaded.out.weight, model2.out.weight)
    assert sorted(os.listdir(tmp_path)) == ["ck"], "no temporary directories left behind"


def test_half_precision_checkpoint_loads_as_float32(tmp_path):
    model = TransformerLM(PRESETS["tiny-switchhead"]).half()
    switchhead.save(tmp_path / "ck", model)
    loaded, _ = switchhead.load(tmp_path / "ck")
    assert loaded.out.weight.dtype == torch.float32
    assert torch.equal(loaded.out.weight, model.out.weight.float())
    kept, _ = switchhead.load(tmp_path / "ck", dtype=None)
    assert kept.out.weight.dtype == torch.float16


def test_replaces_only_its_own_checkpoints(tmp_path):
    model = TransformerLM(PRESETS["tiny-switchhead"])
    (tmp_path / "notes.txt").write_text("precious")
    foreign = tmp_path / "hf"  # another library's checkpoint: also a config.json and a model.safetensors
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "gpt2"}')
    (foreign / "model.safetensors").write_bytes(b"weights")
    ours = switchhead.save(tmp_path / "ck", model)
    switchhead.save(ours, model)  # an earlier checkpoint is replaced
    (ours / "README.md").write_text("my notes")  # ... but not once it holds a user's file
    for path in (tmp_path, foreign, ours, tmp_path / "notes.txt"):
        with pytest.raises(switchhead.SwitchheadError, match="refusing to replace .*not a switchhead checkpoint"):
            switchhead.save(path, model)
    assert (tmp_path / "notes.txt").read_text() == "precious" and (ours / "README.md").read_text() == "my notes"
    assert (foreign / "model.safetensors").read_bytes() == b"weights"


def test_crash_while_writing_leaves_old_checkpoint_intact(tmp_path):
    model = TransformerLM(PRESETS["tiny-switchhead"])
    switchhead.save(tmp_path / "ck", model)
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "ck") as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("crash")
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_save_that_crashes_midway_leaves_the_old_checkpoint_intact(tmp_path):
    """`save` itself, not only `atomic_directory`: a write that fails halfway through the weights (the kernel
    refusing to grow the file, as on a full disk) is one error naming the checkpoint, and leaves the old checkpoint
    whole and loadable, with no partial directory beside it. (safetensors reports the failed write as its own
    error type, which used to escape as a traceback.)"""
    torch.manual_seed(0)
    old = TransformerLM(PRESETS["tiny-switchhead"])
    path = switchhead.save(tmp_path / "ck", old)
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    limit, error = (path / "model.safetensors").stat().st_size // 2, f"cannot write {path}: File too large"
    torch.manual_seed(1)
    with file_size_limit(limit), pytest.raises(SwitchheadError, match=re.escape(error) + "$"):
        switchhead.save(path, TransformerLM(PRESETS["tiny-switchhead"]))
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    loaded, _ = switchhead.load(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), old.state_dict().values()))


@pytest.fixture
def ckpt(tmp_path, tokenizer):
    cfg = PRESETS["tiny-switchhead"].replace(vocab_size=tokenizer.get_piece_size())
    return switchhead.save(tmp_path / "ck", TransformerLM(cfg), tokenizer)


def _edit_weights(path, fn):
    from safetensors.torch import load_file, save_file
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"))


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    (lambda p: (p / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda p: ((p / "config.json").unlink(), (p / "config.json").mkdir()), "config.json is a directory"),
    (lambda p: ((p / "model.safetensors").unlink(), (p / "model.safetensors").symlink_to(p / "gone")),
     "model.safetensors is a dangling or looping symbolic link"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 5), "corrupt"),
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-100]), "corrupt"),
    (lambda p: (p / "config.json").write_text("{not json"), "JSON"),
    (lambda p: (p / "config.json").write_bytes(b'{"d_model": 1\xff}'),
     r"config.json: not valid UTF-8 \(byte 0xff at offset 13, line 1\)"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                          "bogus": 1})), "unknown config key"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                          "d_model": -3})), "d_model"),
    (lambda p: _edit_weights(p, lambda t: t.pop("out.bias")), "missing out.bias"),
    (lambda p: _edit_weights(p, lambda t: t.update(extra=torch.zeros(1))), "unexpected extra"),
    (lambda p: _edit_weights(p, lambda t: t.update({"out.bias": torch.zeros(3)})), "out.bias has shape"),
    (lambda p: _edit_weights(p, lambda t: t.update({"out.bias": t["out.bias"].int()})),
     "out.bias has dtype int32, the model expects a floating-point dtype"),
    (lambda p: _edit_weights(p, lambda t: t.update({"out.bias": t["out.bias"].bool()})), "out.bias has dtype bool"),
    (lambda p: _edit_weights(p, lambda t: t["out.bias"].__setitem__(3, float("nan"))), "out.bias has NaN or inf"),
    (lambda p: _edit_weights(p, lambda t: t["embed.weight"].__setitem__((0, 1), -float("inf"))),
     "embed.weight has NaN"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                          "n_layers": 3})), "missing blocks.2"),
    (lambda p: (p / "tokenizer.model").write_bytes(b"garbage"), "tokenizer.model is corrupt"),
    (lambda p: ((p / "tokenizer.model").unlink(), (p / "tokenizer.model").mkdir()),
     "tokenizer.model is a directory, not a tokenizer model"),
    (lambda p: ((p / "tokenizer.model").unlink(), (p / "tokenizer.model").symlink_to(p / "gone")),
     "tokenizer.model is a dangling or looping symbolic link, not a tokenizer model"),
    # a saved config has every key: a missing one (here the memory's) must not quietly become its default
    (lambda p: (p / "config.json").write_text(json.dumps({k: v for k, v in json.loads(
        (p / "config.json").read_text()).items() if k != "mem_chunks"})), r"config key\(s\) missing: mem_chunks"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                          "vocab_size": 512})), "shape|pieces"),
])
def test_bad_checkpoints_give_one_clear_error(ckpt, damage, message):
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        switchhead.load(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found: /nonexistent/ck"):
        switchhead.load("/nonexistent/ck")
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointError, match=r"f is not a directory \(expected a checkpoint directory\)"):
        switchhead.load(tmp_path / "f")


def test_nothing_is_unpickled(ckpt, monkeypatch):
    import pickle

    def boom(*a, **k):
        raise AssertionError("unpickling attempted")
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    switchhead.load(ckpt)


def test_checkpoint_gets_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        switchhead.save(tmp_path / "ck", TransformerLM(PRESETS["tiny-switchhead"]))
    finally:
        os.umask(old)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in (tmp_path / "ck").iterdir())


def test_weights_that_overflow_the_requested_dtype_are_refused(ckpt):
    _edit_weights(ckpt, lambda t: t["out.bias"].__setitem__(0, 1e6))  # finite in float32, inf in float16
    switchhead.load(ckpt)
    with pytest.raises(CheckpointError, match="out.bias overflows float16"):
        switchhead.load(ckpt, dtype=torch.float16)


def test_save_refuses_what_load_would_refuse(tmp_path):
    lm = TransformerLM(PRESETS["tiny-switchhead"])
    with torch.no_grad():
        lm.embed.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="cannot save: tensor embed.weight has NaN or infinite values"):
        switchhead.save(tmp_path / "ck", lm)
    with pytest.raises(CheckpointError, match="a SentencePieceProcessor or None as tokenizer, got str"):
        switchhead.save(tmp_path / "ck", TransformerLM(PRESETS["tiny-switchhead"]), tokenizer="tok.model")
    assert not (tmp_path / "ck").exists()


def test_paths_of_the_wrong_kind_are_one_clear_error():
    from switchhead.model.checkpoint import is_checkpoint, load_config

    lm = TransformerLM(PRESETS["tiny-switchhead"])
    for call in (lambda: switchhead.save(None, lm), lambda: switchhead.save(123, lm), lambda: load_config(5),
                 lambda: is_checkpoint(None), lambda: switchhead.save(b"ck", lm)):
        with pytest.raises(CheckpointError,
                           match=r"^a checkpoint path must be a str or Path, got (NoneType|int|bytes)$"):
            call()
    with pytest.raises(CheckpointError, match="^a checkpoint path is empty$"):
        switchhead.save("", lm)


_VARIANT = PRESETS["tiny-switchhead"].replace(d_model=20, d_head=8, n_experts=4, k=2, chunk_len=4, n_layers=2,
                                              vocab_size=31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", [
    _VARIANT,
    _VARIANT.replace(shared_selection=True),
    _VARIANT.replace(moe_projections=("k", "q")),
    _VARIANT.replace(positional="rope", mem_chunks=0),
    _VARIANT.replace(attention="dense", n_heads=3),
    _VARIANT.replace(attention="dense", positional="rope"),
    _VARIANT.replace(attention="moa", n_experts=5, n_heads=3, k=3, moa_gate="sigmoid"),
    _VARIANT.replace(ff="sigma_moe", ff_n_experts=5, ff_expert_size=6, ff_k=2),
], ids=lambda c: f"{c.attention}-{c.positional}-{''.join(c.moe_projections)}-{c.ff}-sh{int(c.shared_selection)}")
def test_every_variant_and_dtype_reloads_to_identical_outputs(tmp_path, cfg, dtype):
    torch.manual_seed(0)
    model = TransformerLM(cfg).to(dtype).eval()
    switchhead.save(tmp_path / "ck", model)
    loaded, _ = switchhead.load(tmp_path / "ck", dtype=None)
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        (want, want_mem), (got, got_mem) = model(ids), loaded(ids)
    assert torch.equal(want, got) and (want_mem is None or torch.equal(want_mem, got_mem))


def test_tied_weights_save_and_reload_to_identical_outputs(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"]).eval()
    model.out.weight = model.embed.weight  # tied by the user: two names, one storage
    switchhead.save(tmp_path / "ck", model)
    loaded, _ = switchhead.load(tmp_path / "ck")
    assert torch.equal(loaded.out.weight, model.embed.weight) and torch.equal(loaded.embed.weight, model.embed.weight)
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], loaded(ids)[0])


def test_dtypes_the_model_cannot_compute_in_are_refused(ckpt, tmp_path):
    f8 = torch.float8_e4m3fn
    with pytest.raises(CheckpointError, match="dtype must be a floating-point torch.dtype"):
        switchhead.load(ckpt, dtype=f8)
    model = TransformerLM(PRESETS["tiny-switchhead"])
    model.out.bias.data = model.out.bias.data.to(f8)
    with pytest.raises(CheckpointError, match="cannot save: .*out.bias has dtype float8_e4m3fn"):
        switchhead.save(tmp_path / "f8", model)
    assert not (tmp_path / "f8").exists()
    _edit_weights(ckpt, lambda t: t.update({"out.bias": t["out.bias"].to(f8)}))
    with pytest.raises(CheckpointError, match="out.bias has dtype float8_e4m3fn, the model expects a floating-point"):
        switchhead.load(ckpt)


def test_mixed_dtypes_load_only_cast_to_one(ckpt):
    _edit_weights(ckpt, lambda t: t.update({"out.weight": t["out.weight"].half()}))
    with pytest.raises(CheckpointError, match="model.safetensors mixes dtypes \\(float16, float32\\); pass a dtype"):
        switchhead.load(ckpt, dtype=None)
    model, tok = switchhead.load(ckpt, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.tensor([[1, 2, 3]]))[0].dtype == torch.bfloat16


def test_cpu_device_with_an_index_loads(ckpt):
    want, _ = switchhead.load(ckpt)
    for device in ("cpu:0", torch.device("cpu", 0)):
        got, _ = switchhead.load(ckpt, device=device)
        assert got.out.weight.device.type == "cpu" and torch.equal(got.out.weight, want.out.weight)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.register_buffer("scale", torch.ones(3)), "does not match its config: unexpected scale"),
    (lambda m: setattr(m, "out", torch.nn.Linear(64, 600)), "tensor out.weight has shape \\(600, 64\\), config "
                                                            "expects \\(512, 64\\)"),
    (lambda m: m.to("meta"), "embed.weight is on the meta device"),
])
def test_save_refuses_weights_load_would_not_take(tmp_path, change, message):
    model = TransformerLM(PRESETS["tiny-switchhead"])
    change(model)
    with pytest.raises(CheckpointError, match="cannot save: .*" + message):
        switchhead.save(tmp_path / "ck", model)
    assert not (tmp_path / "ck").exists()
