"""Config validation and JSON, presets, parameter matching and the paper's accounting formulas."""

import json

import pytest
from click.testing import CliRunner

from switchhead import PRESETS, ConfigError, ModelConfig, TransformerLM
from switchhead.cli import main
from switchhead.model.accounting import (
    attention_macs,
    attention_memory,
    count_params,
    kv_cache_bytes_per_token,
    match_params,
    summary,
    xl_memory_bytes_per_token,
)
from switchhead.model.config import resolve_config


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_json(name):
    cfg = PRESETS[name]
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.name == name


@pytest.mark.parametrize("field,value", [
    ("d_model", 0), ("n_heads", -1), ("k", 2.5), ("vocab_size", True), ("dropout", 1.0), ("attention", "sparse"),
    ("positional", "alibi"), ("ff", "glu"), ("mem_chunks", 2), ("moe_projections", ("v", "x")),
    ("grad_clip", -1.0), ("ff_expert_dropout", -0.1), ("mem_chunks", True), ("dropout", False),
    ("grad_clip", True), ("shared_selection", "yes"), ("shared_selection", 1), ("name", 5),
    ("n_layers", 4097), ("d_model", 2**24 + 1), ("vocab_size", 10**12),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{field: value})


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="k"):
        ModelConfig(n_experts=2, k=3)
    with pytest.raises(ConfigError, match="n_heads"):
        ModelConfig(attention="moa", n_heads=4, k=4, n_experts=2)
    with pytest.raises(ConfigError, match="d_head"):
        ModelConfig(positional="rope", d_head=10)
    with pytest.raises(ConfigError, match="ff_k"):
        ModelConfig(ff="sigma_moe", ff_n_experts=2, ff_k=3)


def test_unknown_keys_and_bad_json():
    with pytest.raises(ConfigError, match="unknown config key.*n_hedas"):
        ModelConfig.from_dict({"n_hedas": 3})
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_json("{nope")
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): 1, None, n_hedas$"):
        ModelConfig.from_dict({1: 2, "n_hedas": 3, None: 4, "k": 2})
    with pytest.raises(ConfigError, match="unknown config"):
        resolve_config("not-a-preset")
    with pytest.raises(ConfigError, match="a config must be a preset name or a path to a config JSON file, got int"):
        resolve_config(5)
    assert resolve_config(PRESETS["tiny-moa"]) is PRESETS["tiny-moa"]
    # Still a dict's KeyError, but one that says which names there are.
    with pytest.raises(KeyError, match=r"^unknown preset 'tiny-switchheda'; presets: switchhead-47m, .*tiny-moa"):
        PRESETS["tiny-switchheda"]
    with pytest.raises(ConfigError):
        PRESETS["tiny-switchheda"]
    assert PRESETS.get("tiny-switchheda") is None and "tiny-switchheda" not in PRESETS


def test_resolve_config_from_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(PRESETS["tiny-moa"].to_json())
    assert resolve_config(p) == PRESETS["tiny-moa"]
    with pytest.raises(ConfigError, match="not found"):
        resolve_config(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b'{"d_model": 64\xff}')
    with pytest.raises(ConfigError, match=r"cannot read .*bin.json: not valid UTF-8 \(byte 0xff at offset 14, "
                                          r"line 1\)"):
        resolve_config(tmp_path / "bin.json")
    (tmp_path / "bad.json").write_text('{"d_model": -1}')
    with pytest.raises(ConfigError, match=r"bad.json: ModelConfig.d_model must be a positive integer"):
        resolve_config(tmp_path / "bad.json")


def test_largest_allowed_sizes_are_counted_quickly():
    # `info` builds the model on the meta device: at the limits that is still a matter of seconds.
    from switchhead.model.config import MAX_LAYERS, MAX_SIZE

    big = ModelConfig(n_layers=MAX_LAYERS, d_model=MAX_SIZE, vocab_size=MAX_SIZE, d_ff=64, d_head=64,
                      chunk_len=MAX_SIZE)
    params = count_params(big)
    assert params["total"] > MAX_SIZE ** 2


@pytest.mark.parametrize("value,message", [
    ("vo", "must be a list"), (None, "must be a list"), ({"v": 1}, "must be a list"), (b"vo", "must be a list"),
    (("v", "v"), r"repeated projection\(s\) \['v'\]"), (["o", "v", "o"], r"repeated projection\(s\) \['o'\]"),
    (("V", "O"), r"unknown projection\(s\) \['V', 'O'\]"),
])
def test_moe_projections_are_a_list_of_distinct_names(value, message):
    for make in (ModelConfig, PRESETS["tiny-switchhead"].replace):
        with pytest.raises(ConfigError, match=f"ModelConfig.moe_projections.*{message}"):
            make(moe_projections=value)
    if not isinstance(value, bytes):
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_json(json.dumps({"moe_projections": value}))


@pytest.mark.parametrize("text,repeated", [
    ('{"k": 2, "k": 3}', "k"), ('{"d_model": 64, "k": 2, "d_model": 64}', "d_model"),
    ('{"n_heads": 2, "k": 1, "n_heads": 1, "k": 1}', "k, n_heads"),
])
def test_repeated_json_keys_are_refused(text, repeated, tmp_path):
    with pytest.raises(ConfigError, match=f"duplicate config key\\(s\\): {repeated}$"):
        ModelConfig.from_json(text)
    (tmp_path / "c.json").write_text(text)
    r = CliRunner().invoke(main, ["info", "--config", str(tmp_path / "c.json")])
    assert r.exit_code == 2 and r.output.strip().endswith(f"c.json: duplicate config key(s): {repeated}"), r.output


def test_moe_projection_order_is_canonical():
    assert ModelConfig(moe_projections=("o", "v")) == ModelConfig(moe_projections=["v", "o"])


def test_dense_rows_reproduce_the_paper_exactly():
    t47, t262 = PRESETS["transformer-47m"], PRESETS["transformer-262m"]
    assert round(attention_macs(t47) / 1e6, 1) == 453.4
    assert round(attention_memory(t47) / 1e6, 1) == 3.5
    assert round(attention_memory(PRESETS["transformer-47m-2head"]) / 1e6, 2) == 1.36
    assert round(attention_macs(t262) / 1e9, 2) == 5.37
    assert round(attention_memory(t262) / 1e6, 1) == 21.0
    assert round(attention_memory(PRESETS["transformer-262m-4head"]) / 1e6, 1) == 8.4


def test_switchhead_rows_follow_the_formula():
    # The paper prints 170.4M / 203M / 2.4G for these; the formula with Table 9's values gives:
    assert round(attention_macs(PRESETS["switchhead-47m-wt103"]) / 1e6, 1) == 200.3
    assert round(attention_macs(PRESETS["switchhead-47m"]) / 1e6, 1) == 232.5
    assert round(attention_macs(PRESETS["switchhead-262m"]) / 1e9, 2) == 2.82
    assert round(attention_memory(PRESETS["switchhead-262m"]) / 1e6, 2) == 6.03


@pytest.mark.parametrize("projections", [(), ("v",), ("k", "q"), ("v", "k", "q", "o")])
def test_switchhead_macs_count_each_projection_as_it_is_built(projections):
    """V and O as mixtures is the paper's formula; other subsets cost T*dh*d per dense projection and
    T*k*dh*(d+1) per mixture, so an all-dense SwitchHead counts as dense attention without u/v."""
    cfg = PRESETS["switchhead-47m"].replace(moe_projections=projections)
    h, t, dh, d, k = cfg.n_heads, cfg.chunk_len, cfg.d_head, cfg.d_model, cfg.k
    n = len(projections)
    rest = 2 * 2 * t * t * dh + 2 * 2 * t * dh * d
    assert attention_macs(cfg) == h * ((4 - n) * t * dh * d + n * t * k * dh * (d + 1) + rest)
    if not projections:
        assert attention_macs(cfg) == attention_macs(cfg.replace(attention="dense"))


def test_moa_formula():
    cfg = PRESETS["moa-47m"]
    h, t, dh, d = cfg.n_heads, cfg.chunk_len, cfg.d_head, cfg.d_model
    assert attention_macs(cfg) == (2 * h + 2) * t * dh * d + 2 * h * 2 * t * t * dh + 2 * 2 * t * dh * d


@pytest.mark.parametrize("attention", ["dense", "switchhead", "moa"])
def test_rope_counts_no_position_projection(attention):
    """RoPE has no projected relative positions: exactly the formulas' positional term goes, with or without
    memory."""
    base = {"dense": "tiny-transformer", "switchhead": "tiny-switchhead", "moa": "tiny-moa"}[attention]
    for mem in (1, 0):
        xl = PRESETS[base].replace(mem_chunks=mem)
        rope = xl.replace(positional="rope")
        c, t, dh, d = 1 + mem, xl.chunk_len, xl.d_head, xl.d_model
        heads = 1 if attention == "moa" else xl.n_heads  # MoA projects positions for its one K/V head
        assert attention_macs(xl) - attention_macs(rope) == heads * 2 * c * t * dh * d
        assert attention_memory(xl) - attention_memory(rope) == heads * 2 * c * t * dh


@pytest.mark.parametrize("attention", ["dense", "switchhead", "moa"])
def test_memory_terms_match_the_built_model(attention):
    """Against the running model: the score maps' term of attention_memory (logits and probabilities, 2 floats per
    query-key pair and map) is twice the attention map recorded by a forward with a full memory, for mem_chunks 0
    and 1; and the XL memory per token is what the forward returns as memory."""
    import torch

    from switchhead.model.accounting import xl_memory_bytes_per_token

    base = {"dense": "tiny-transformer", "switchhead": "tiny-switchhead", "moa": "tiny-moa"}[attention]
    for mem in (1, 0):
        cfg = PRESETS[base].replace(mem_chunks=mem, positional="rope", n_layers=2)  # RoPE: no positional term
        t, dh = cfg.chunk_len, cfg.d_head
        torch.manual_seed(0)
        model = TransformerLM(cfg).eval()
        model.record_attention(True)
        ids = torch.randint(0, cfg.vocab_size, (3, 2 * t))
        with torch.no_grad():
            _, memory = model(ids)  # the second chunk sees the first as its memory
        probs = model.blocks[0].attn.last_probs
        assert probs.shape[-2:] == (t, (1 + mem) * t)
        maps = probs[0].numel()  # one sequence
        projections = (2 * cfg.n_heads + 2) * t * dh if attention == "moa" else cfg.n_heads * 4 * t * dh
        assert attention_memory(cfg) == projections + 2 * maps
        want = 0 if memory is None else memory.element_size() * memory[:, 0].numel() // t
        assert xl_memory_bytes_per_token(cfg) == want == 4 * mem * cfg.n_layers * cfg.d_model


def test_param_count_matches_hand_count():
    cfg = PRESETS["tiny-switchhead"]
    d, h, e, dh, v, f = cfg.d_model, cfg.n_heads, cfg.n_experts, cfg.d_head, cfg.vocab_size, cfg.d_ff
    attn = 2 * h * dh * d + 2 * h * e * d * dh + 2 * h * e * d + h * dh * d
    ff = d * f + f + f * d + d
    want = v * d + cfg.n_layers * (attn + ff + 4 * d) + 2 * d + d * v + v
    got = count_params(cfg)
    assert got["total"] == want
    assert got["attention"] == cfg.n_layers * attn


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
@pytest.mark.parametrize("n_layers", [1, 3, 7])
def test_param_count_equals_the_built_model(name, n_layers):
    cfg = PRESETS[name].replace(n_layers=n_layers)
    assert count_params(cfg)["total"] == sum(p.numel() for p in TransformerLM(cfg).parameters())


@pytest.mark.parametrize("a,b", [
    ("switchhead-47m", "transformer-47m"), ("switchhead-47m-wt103", "transformer-47m"),
    ("switchhead-47m", "transformer-47m-2head"), ("switchhead-47m-shared", "transformer-47m"),
    ("moa-47m", "transformer-47m"), ("switchall-47m", "transformer-47m"),
    ("switchhead-262m", "transformer-262m"), ("switchhead-262m-wt103", "transformer-262m"),
    ("switchhead-262m-shared", "transformer-262m"), ("transformer-262m-4head", "transformer-262m"),
])
def test_paper_pairs_are_parameter_matched(a, b):
    pa, pb = count_params(PRESETS[a])["total"], count_params(PRESETS[b])["total"]
    assert abs(pa - pb) / pb < 0.02, (pa, pb)


def test_match_params_solves_d_head_and_d_ff():
    target = PRESETS["switchhead-47m"]
    m = match_params(PRESETS["transformer-47m-2head"].replace(d_head=10), target)
    assert m.d_head == 205
    m = match_params(PRESETS["transformer-47m"].replace(d_ff=100), target, field="d_ff")
    assert abs(count_params(m)["total"] - count_params(target)["total"]) <= 2 * m.d_model
    with pytest.raises(ConfigError):
        match_params(target, target, field="n_layers")


def test_kv_cache_bytes():
    assert kv_cache_bytes_per_token(PRESETS["switchhead-47m"]) == 2 * 2 * 76 * 16 * 4
    assert kv_cache_bytes_per_token(PRESETS["moa-47m"], 2) == 2 * PRESETS["moa-47m"].d_head * 16 * 2


def test_info_cli():
    r = CliRunner().invoke(main, ["info", "--config", "transformer-47m"])
    assert r.exit_code == 0 and "453.43M" in r.output and "paper prints 453.40M" in r.output
    r = CliRunner().invoke(main, ["info", "--config", "switchhead-47m", "--json"])
    data = json.loads(r.output)
    assert data["params"]["total"] == count_params(PRESETS["switchhead-47m"])["total"]
    r = CliRunner().invoke(main, ["info"])
    assert r.exit_code == 0 and all(name in r.output for name in PRESETS)


def test_info_cli_errors_are_one_line_exit_2(tmp_path):
    for args in (["info", "--config", "nope"], ["info", "--ckpt", str(tmp_path / "missing")],
                 ["info", "--config", "tiny-moa", "--ckpt", str(tmp_path)], ["info", "--config", ""],
                 ["info", "--ckpt", ""]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2, r.output
        assert r.output.strip().startswith("Error:") and len(r.output.strip().splitlines()) == 1


def test_python_m_switchhead_is_the_cli():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "switchhead", "info", "--config", "tiny-switchhead"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == CliRunner().invoke(main, ["info", "--config", "tiny-switchhead"]).output
    r = subprocess.run([sys.executable, "-m", "switchhead", "info", "--config", "no-such"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("Error:") and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args", [
    ["export", "--onnx", "--out", ""], ["inspect", "--text", "hi", "--out", ""], ["info", "--ckpt", " "],
    ["train", "--config", "tiny-switchhead", "--data", "x.txt", "--out", ""],
    ["eval", "--text", "x.txt", "--output", ""],
    ["serve", "--onnx", ""], ["generate", "hi", "--prompts-file", ""],
])
def test_empty_paths_are_refused_not_read_as_the_current_directory(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "needs a path, got an empty one" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["eval", "--limit", "small"], "'--limit': 'small' is not a valid integer. (see 'main eval --help')"),
    (["export", "--onnx", "--bogus"], "No such option '--bogus'"),
    (["train", "--dtype", "f8"], "Invalid value for '--dtype': 'f8' is not one of"),
    (["generate", "--max-new-tokens"], "Option '--max-new-tokens' requires an argument"),
    (["nonsense"], "No such command 'nonsense'. (see 'main --help')"),
    (["--bogus"], "No such option '--bogus'. (see 'main --help')"),
])
def test_mistyped_options_are_one_line(args, message):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.startswith("Error: ") and message in r.stderr, r.output
    assert r.stderr.count("\n") == 1, r.stderr  # no usage line and blank line before it


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory, not a config file"):
        resolve_config(str(tmp_path))


def test_info_header_names_what_each_attention_routes(tmp_path):
    out = {name: CliRunner().invoke(main, ["info", "--config", name]).output.splitlines()[0]
           for name in ("tiny-moa", "switchhead-47m-shared", "switchhead-47m", "tiny-transformer")}
    assert "E=4 k=2 query/output experts, shared K/V" in out["tiny-moa"] and "MoE" not in out["tiny-moa"]
    assert "MoE V/O, shared selection" in out["switchhead-47m-shared"]
    assert "MoE V/O;" in out["switchhead-47m"] and "E=" not in out["tiny-transformer"]
    (tmp_path / "c.json").write_text('{"moe_projections": []}')
    assert "MoE none;" in CliRunner().invoke(main, ["info", "--config", str(tmp_path / "c.json")]).output


def test_match_params_for_rope_and_coarse_valid_values():
    target = count_params(PRESETS["tiny-switchhead-rope"])["total"]

    def gap(cfg, v):
        return abs(count_params(cfg.replace(d_head=v))["total"] - target) if v > 0 else float("inf")

    # Parameters grow with d_head, so the nearest accepted neighbours on both sides bound the optimum.
    m = match_params(PRESETS["tiny-transformer"].replace(positional="rope", d_head=8), target)
    assert m.d_head % 4 == 0 and gap(m, m.d_head) <= min(gap(m, m.d_head - 4), gap(m, m.d_head + 4))
    m = match_params(PRESETS["tiny-transformer"], target, valid=lambda v: v % 16 == 0)
    assert m.d_head % 16 == 0 and gap(m, m.d_head) <= min(gap(m, m.d_head - 16), gap(m, m.d_head + 16))


def test_accounting_refuses_values_of_the_wrong_kind():
    cfg = PRESETS["tiny-switchhead"]
    for f in (count_params, attention_macs, attention_memory, kv_cache_bytes_per_token, xl_memory_bytes_per_token,
              summary):
        for bad in (None, "tiny-switchhead", cfg.to_dict()):
            with pytest.raises(ConfigError, match=r"expected a ModelConfig \(e.g. PRESETS\[name\]\), got"):
                f(bad)
    for f in (kv_cache_bytes_per_token, xl_memory_bytes_per_token):
        for n in ("x", 0, -4, 2.5, True):  # "x" came back as a repeated string
            with pytest.raises(ConfigError, match="bytes_per_element must be an integer >= 1"):
                f(cfg, n)
        assert f(cfg, 2) * 2 == f(cfg, 4)
    for target in (0, True, "123456", 1.5e6, None):
        with pytest.raises(ConfigError, match="target must be a parameter count"):
            match_params(cfg, target)
    with pytest.raises(ConfigError, match="d_ff sets no parameter of a sigma_moe feedforward"):
        match_params(PRESETS["tiny-switchall"], 10**6, field="d_ff")
    with pytest.raises(ConfigError, match="valid must be a function"):
        match_params(cfg, 10**6, valid=4)
    with pytest.raises(ConfigError, match="expected a ModelConfig"):
        match_params("tiny-switchhead", 10**6)


def test_replace_and_from_json_refuse_in_one_line():
    cfg = PRESETS["tiny-switchhead"]
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): bogus, n_hedas$"):
        cfg.replace(n_hedas=3, bogus=1)
    assert cfg.replace(n_heads=3).n_heads == 3
    for text, message in [(None, "JSON must be text, got NoneType"), (5, "got int"),
                          ("[" * 100_000 + "]" * 100_000, "nested too deeply"), (b"\xff{}", "not UTF-8 text")]:
        with pytest.raises(ConfigError, match=message):
            ModelConfig.from_json(text)
    assert ModelConfig.from_json(cfg.to_json().encode()) == cfg
