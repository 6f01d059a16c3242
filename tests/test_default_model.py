"""The built-in default model: loads without a path, and every command uses it when no checkpoint is given."""

import json
import math

import torch
from click.testing import CliRunner

import switchhead
from switchhead.cli import main
from switchhead.model.checkpoint import DEFAULT_CHECKPOINT, resolve_checkpoint


def test_default_model_loads_in_float32_with_its_tokenizer():
    model, tok = switchhead.load()
    assert resolve_checkpoint(None) == DEFAULT_CHECKPOINT
    assert model.config.name == "switchhead-small"
    assert next(model.parameters()).dtype == torch.float32
    assert tok.get_piece_size() == model.config.vocab_size
    # It is a trained model: plain English costs far fewer nats per token than a uniform guess (log V ~ 9.0).
    text = "She opened the door and walked into the room, and he followed her without a word."
    ids = torch.tensor([[tok.eos_id()] + tok.encode(text)])
    logits, _ = model(ids[:, :-1])
    nll = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert nll < 0.6 * math.log(model.config.vocab_size), nll


def test_weights_ship_in_half_precision_and_fit_the_package_budget():
    from safetensors import safe_open

    path = DEFAULT_CHECKPOINT / "model.safetensors"
    assert path.stat().st_size < 25 * 2**20
    with safe_open(str(path), "pt") as f:
        assert all(f.get_slice(k).get_dtype() in ("F16", "BF16") for k in f.keys())


def test_generate_without_checkpoint_uses_the_default_model():
    r = CliRunner().invoke(main, ["generate", "The old house", "--max-new-tokens", "8", "--seed", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["tokens"] >= 1 and out["text"]
    again = CliRunner().invoke(main, ["generate", "The old house", "--max-new-tokens", "8", "--seed", "3", "--json"])
    assert json.loads(again.output)["text"] == out["text"]
    # The text is the built-in model's own: greedy CLI output equals the library's greedy generation on it.
    from switchhead.runtime import Generator, SamplingParams, TorchBackend

    model, tok = switchhead.load()
    (want,) = Generator(TorchBackend(model), tok).generate(["The old house"],
                                                          SamplingParams(temperature=0, max_new_tokens=8))
    r = CliRunner().invoke(main, ["generate", "The old house", "--max-new-tokens", "8", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert r.stdout == want.text + "\n" and want.tokens


def test_inspect_without_checkpoint_uses_the_default_model(tmp_path):
    r = CliRunner().invoke(main, ["inspect", "--text", "The cat sat.", "--out", str(tmp_path / "o"), "--layers", "0",
                                  "--heads", "0"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "index.html").is_file()


def test_eval_without_checkpoint_records_the_default_model(tmp_path):
    (tmp_path / "held.txt").write_text("The cat sat on the mat. The dog lay by the door.\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["eval", "--text", str(tmp_path / "held.txt"), "--output", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    results = json.loads(out.read_text())
    assert results["switchhead"]["builtin_model"] is True
    assert results["config"]["model_args"] == "ckpt=<built-in model>"
