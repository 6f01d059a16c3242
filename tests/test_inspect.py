"""`switchhead inspect`: recorded attention against an independent float64 computation, recorded expert choices
against a recomputation from the LN1 inputs (and against the layer output they produced), and the command's
figures, index.html, --json and errors."""

import html
import json
import math
import random
import re

import naive
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from switchhead import PRESETS, TransformerLM, save
from switchhead.analysis import collect, head_selection, inspect_text, run_inspect, selection_scores, windows
from switchhead.cli import main
from switchhead.model.tokenizer import train_tokenizer

SMALL = PRESETS["tiny-switchhead"].replace(d_model=32, d_head=8, n_experts=4, k=2, chunk_len=6, n_layers=2,
                                           vocab_size=41)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # the dense baseline's u/v biases start at 0: randomise them so they are exercised
        for block in model.blocks:
            for name in ("u", "v"):
                p = getattr(block.attn, name, None)
                if isinstance(p, torch.nn.Parameter):
                    p.normal_()
            if isinstance(getattr(block.attn, "scale", None), torch.nn.Parameter):
                block.attn.scale.fill_(0.7)
    return model


def _layer_inputs(model, ids, chunk_len):
    """Per chunk, the inputs of every layer [L, T, d] (the memory the model returns holds exactly these)."""
    out, memory = [], None
    with torch.no_grad():
        for start in range(0, len(ids), chunk_len):
            _, memory = model(torch.tensor([ids[start:start + chunk_len]]), memory)
            out.append(memory[:, 0].double())
    return out


def _ln(x, ln):
    x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps)
    return x * ln.weight.double() + ln.bias.double()


def _manual_probs(attn, cfg, src, m):
    """softmax over visible keys of q.k (+ positional term) in float64, one query/key/head at a time."""
    h_n, dh = cfg.n_heads, cfg.d_head
    w = {n: p.detach().double() for n, p in attn.named_parameters()}
    dense = cfg.attention == "dense"
    qk_scale = 1.0 if dense else dh ** -0.25
    t_n, s_n = src.shape[0] - m, src.shape[0]
    probs = torch.zeros(h_n, t_n, s_n, dtype=torch.float64)
    for h in range(h_n):
        rows = slice(h * dh, (h + 1) * dh)
        for t in range(t_n):
            qpos = m + t
            q = w["w_q"][rows] @ src[qpos] * qk_scale
            logits = []
            for s in range(qpos + 1):
                k = w["w_k"][rows] @ src[s] * qk_scale
                qc = q + w["u"][h] if dense else q
                if cfg.positional == "rope":
                    score = float(naive.rope(qc, qpos) @ naive.rope(k, s))
                else:
                    r = w["pos.weight"][rows] @ naive.sinusoid(qpos - s, cfg.d_model) * qk_scale
                    score = float(qc @ k) + float(((q + w["v"][h]) if dense else q) @ r)
                logits.append(score * (float(w["scale"]) if dense else 1.0))
            top = max(logits)
            ex = [math.exp(v - top) for v in logits]
            probs[h, t, :qpos + 1] = torch.tensor(ex) / sum(ex)
    return probs


@pytest.mark.parametrize("cfg", [SMALL, SMALL.replace(positional="rope"),
                                 SMALL.replace(attention="dense", n_heads=3)],
                         ids=["switchhead-xl", "switchhead-rope", "dense-xl"])
def test_recorded_attention_matches_float64_computation(cfg):
    model = _model(cfg)
    ids = random.Random(0).choices(range(cfg.vocab_size), k=14)  # chunks of 6, 6, 2 tokens
    chunks = collect(model, ids)
    inputs = _layer_inputs(model, ids, cfg.chunk_len)
    assert [c.memory for c in chunks] == [0, 6, 6] and [c.n_tokens for c in chunks] == [6, 6, 2]
    for c, chunk in enumerate(chunks):
        for i, block in enumerate(model.blocks):
            probs = chunk.layers[i].probs
            assert probs.shape == (cfg.n_heads, chunk.n_tokens, chunk.memory + chunk.n_tokens)
            np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=1e-5)
            with torch.no_grad():
                h = _ln(inputs[c][i], block.ln1)
                src = h if c == 0 else torch.cat([_ln(inputs[c - 1][i], block.ln1), h])
                want = _manual_probs(block.attn, cfg, src, chunk.memory)
            np.testing.assert_allclose(probs, want.numpy(), rtol=1e-4, atol=1e-6)


def test_selections_are_those_the_forward_used():
    cfg = SMALL
    model = _model(cfg, seed=1)
    ids = random.Random(1).choices(range(cfg.vocab_size), k=12)
    chunks = collect(model, ids)
    inputs = _layer_inputs(model, ids, cfg.chunk_len)
    h_n, e_n, k = cfg.n_heads, cfg.n_experts, cfg.k
    for c, chunk in enumerate(chunks):
        for i, block in enumerate(model.blocks):
            att = block.attn
            trace = chunk.layers[i]
            with torch.no_grad():
                h = _ln(inputs[c][i], block.ln1)
                src = h if c == 0 else torch.cat([_ln(inputs[c - 1][i], block.ln1), h])
                for side, x, sel in (("v", src, att.sel_v), ("o", h, att.sel_o)):
                    scores = torch.sigmoid(x @ sel.double().T).view(x.shape[0], h_n, e_n)
                    experts, gates = getattr(trace, side)
                    assert experts.shape == (x.shape[0], h_n, k)
                    top = scores.topk(k, -1).indices.sort(-1).values
                    np.testing.assert_array_equal(np.sort(experts, -1), top.numpy())
                    np.testing.assert_allclose(gates, scores.gather(-1, torch.from_numpy(experts).long()).numpy(),
                                               rtol=1e-5)
            if i == 0:
                # The recorded maps and choices must rebuild the layer's output: x + attn, then the FF residual,
                # equals the next layer's input.
                w_v, w_o = att.w_v.detach().double(), att.w_o.detach().double()
                y = torch.zeros_like(h)
                for hd in range(h_n):
                    ve, vg = head_selection(cfg, trace, "v", hd)
                    oe, og = head_selection(cfg, trace, "o", hd)
                    vals = torch.stack([sum(float(vg[s, j]) * src[s] @ w_v[hd * e_n + int(ve[s, j])]
                                            for j in range(k)) for s in range(src.shape[0])])
                    a = torch.from_numpy(trace.probs[hd]).double() @ vals
                    y += torch.stack([sum(float(og[t, j]) * a[t] @ w_o[hd * e_n + int(oe[t, j])] for j in range(k))
                                      for t in range(h.shape[0])])
                x1 = inputs[c][0] + y
                with torch.no_grad():
                    x2 = x1 + block.ff(block.ln2(x1.float())).double()
                torch.testing.assert_close(x2, inputs[c][1], rtol=1e-4, atol=1e-4)


def test_moa_records_one_map_per_selected_slot():
    cfg = SMALL.replace(attention="moa", n_experts=5, n_heads=2, k=2)
    model = _model(cfg, seed=2)
    chunks = collect(model, list(range(8)), layers=[1])
    trace = chunks[1].layers[1]
    assert set(chunks[1].layers) == {1} and trace.v is None
    assert trace.probs.shape == (2, 2, 8) and trace.o[0].shape == (2, 1, 2)
    inputs = _layer_inputs(model, list(range(8)), cfg.chunk_len)
    with torch.no_grad():
        logits = _ln(inputs[1][1], model.blocks[1].ln1) @ model.blocks[1].attn.sel.double().T
    for slot in range(2):
        experts, gates = head_selection(cfg, trace, "o", slot)
        chosen = logits.gather(-1, torch.from_numpy(trace.o[0][:, 0]).long())
        np.testing.assert_array_equal(experts[:, 0], trace.o[0][:, 0, slot])
        np.testing.assert_allclose(gates[:, 0], chosen.softmax(-1)[:, slot].numpy(), rtol=1e-5)


def test_expert_usage_counts_each_tokens_choices_once():
    """Usage counts against a count of the top-k choices recomputed from the LN1 inputs, token by token and head by
    head: V counts each token of the text once (its memory-column repeat in the next chunk is not counted again);
    and the balance figure against the normalised entropy written out."""
    from switchhead.analysis import balance, expert_usage

    cfg = SMALL
    model = _model(cfg, seed=3)
    ids = random.Random(3).choices(range(cfg.vocab_size), k=14)  # chunks of 6, 6, 2 tokens
    chunks = collect(model, ids)
    inputs = _layer_inputs(model, ids, cfg.chunk_len)
    h_n, e_n, k = cfg.n_heads, cfg.n_experts, cfg.k
    for i, block in enumerate(model.blocks):
        want = {"v": np.zeros((h_n, e_n), np.int64), "o": np.zeros((h_n, e_n), np.int64)}
        for c in range(len(chunks)):
            with torch.no_grad():
                h = _ln(inputs[c][i], block.ln1)
                for side, sel in (("v", block.attn.sel_v), ("o", block.attn.sel_o)):
                    scores = torch.sigmoid(h @ sel.double().T).view(h.shape[0], h_n, e_n)
                    for t in range(h.shape[0]):
                        for hd in range(h_n):
                            for e in scores[t, hd].topk(k).indices.tolist():
                                want[side][hd, e] += 1
        got = expert_usage(cfg, chunks, i)
        assert set(got) == {"v", "o"}
        for side in ("v", "o"):
            np.testing.assert_array_equal(got[side], want[side], err_msg=f"layer {i} {side}")
            for row in got[side]:
                p = [c / row.sum() for c in row if c]
                assert balance(row) == pytest.approx(-sum(q * math.log(q) for q in p) / math.log(e_n), abs=1e-12)
    assert balance(np.array([5, 5, 5, 5])) == pytest.approx(1.0) and balance(np.array([0, 9, 0, 0])) == 0.0


def test_windows_and_scores():
    chunk = collect(_model(SMALL), list(range(10)))[1]  # 4 tokens after 6 memory columns
    assert [(w.q0, w.q1, w.k0, w.k1) for w in windows(chunk, 3)] == [(0, 3, 3, 9), (3, 4, 4, 10)]
    assert [(w.q0, w.q1, w.k0, w.k1) for w in windows(chunk, 64)] == [(0, 4, 0, 10)]
    s = selection_scores(np.array([[2, 0]]), np.array([[0.9, 0.6]]), 4)
    np.testing.assert_allclose(s, [[0.6, 0, 0.9, 0]])


# ------------------------------------------------------------------------------------------------ command
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dogs while birds sing in trees costs $5 a_b".split()
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(300)))
    sp = train_tokenizer([corpus], vocab_size=320)
    torch.manual_seed(0)
    model = TransformerLM(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size(), chunk_len=8))
    save(root / "ckpt", model, sp)
    save(root / "no-tokenizer", model)
    (root / "latin1.txt").write_bytes("the café\n".encode("latin-1"))
    return root


TEXT = "the quick brown fox jumps over the lazy dogs, costs $5 a_b"


def _run(*args):
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


def test_command_writes_figures_index_and_json(ckpt, tmp_path):
    out = tmp_path / "report"
    r = _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", out, "--layers", "1", "--heads", "0", "--json")
    assert r.exit_code == 0, r.output
    pngs = sorted(out.glob("*.png"))
    data = json.loads((out / "attention.json").read_text())
    n_chunks = len(data["chunks"])
    assert n_chunks >= 2, "the text must span several chunks to exercise the memory columns"
    # One usage histogram, then per chunk (one window each at the default window) the max map and head 0.
    assert len(pngs) == 1 + 2 * n_chunks
    assert "inspect: 100%" in r.stderr and f"{len(pngs)}/{len(pngs)}" in r.stderr  # the progress bar's count
    for png in pngs:
        blob = png.read_bytes()
        assert blob[:8] == PNG_MAGIC and len(blob) > 2000, png.name
    index = (out / "index.html").read_text()
    assert set(re.findall(r'src="([^"]+\.png)"', index)) == {p.name for p in pngs}
    assert all(html.escape(p) in index for p in json.loads((out / "attention.json").read_text())["tokens"])

    assert data["layers"] == [1] and data["heads"] == [0] and data["config"]["chunk_len"] == 8
    assert len(data["tokens"]) == len(data["ids"]) == sum(c["n_tokens"] for c in data["chunks"])
    assert [c["memory"] for c in data["chunks"]] == [0] + [8] * (n_chunks - 1)
    e_n = data["config"]["n_experts"]
    for chunk in data["chunks"]:
        t, s = chunk["n_tokens"], chunk["memory"] + chunk["n_tokens"]
        (layer,) = chunk["layers"]
        (head,) = layer["heads"]
        att = np.array(head["attention"])
        assert layer["layer"] == 1 and head["head"] == 0 and att.shape == (t, s)
        np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-6)  # 7 significant digits: float32's precision
        assert all(len(repr(v)) <= 14 for row in head["attention"] for v in row)  # e.g. 0.0001234567, not 17
        assert np.array(head["v"]["experts"]).shape == (s, 2) and np.array(head["o"]["gates"]).shape == (t, 2)
        gates = np.array(head["o"]["gates"] + head["v"]["gates"])
        assert ((gates > 0) & (gates < 1)).all()
        assert 0 <= np.min(head["v"]["experts"]) and np.max(head["o"]["experts"]) < e_n
    assert data["chunks"][1]["layers"][0]["heads"][0]["attention"][0][0] > 0  # memory column is attended
    usage = data["usage"]["1"]
    assert np.array(usage["o"]).sum() == len(data["ids"]) * 2 * 2  # tokens x heads x k
    assert np.array(usage["v"]).sum() == len(data["ids"]) * 2 * 2  # memory columns are not counted twice


@pytest.mark.parametrize("args,message", [
    (["--ckpt", "{root}/missing", "--text", "x"], "not found"),
    (["--ckpt", "{root}/no-tokenizer", "--text", "x"], "no tokenizer"),
    (["--ckpt", "{root}/ckpt", "--text", "  \n"], "empty"),
    (["--ckpt", "{root}/ckpt", "--text-file", "{root}/nope.txt"], "cannot read"),
    (["--ckpt", "{root}/ckpt", "--text-file", "{root}/latin1.txt"],
     "latin1.txt: not valid UTF-8 (byte 0xe9 at offset 7, line 1)"),
    (["--ckpt", "{root}/ckpt", "--text", "x", "--text-file", "{root}/corpus.txt"], "exactly one"),
    (["--ckpt", "{root}/ckpt"], "exactly one"),
    (["--ckpt", "{root}/ckpt", "--text", "x", "--layers", "0,2"], "layer 2 out of range"),
    (["--ckpt", "{root}/ckpt", "--text", "x", "--heads", "-1"], "head -1 out of range"),
    (["--ckpt", "{root}/ckpt", "--text", "x", "--layers", "a,b"], "comma-separated"),
    (["--ckpt", "{root}/ckpt", "--text", "x", "--window", "0"], "window"),
    (["--ckpt", "{root}/ckpt", "--text", "a\udcffb"], "not valid UTF-8 (byte 0xFF at character 1)"),
], ids=["missing-ckpt", "no-tokenizer", "empty-text", "missing-file", "latin1-file", "both-texts", "no-text",
        "layer-range", "head-range", "bad-list", "bad-window", "undecodable-byte"])
def test_bad_input_is_one_line_exit_2(ckpt, tmp_path, args, message):
    r = _run(*[a.format(root=ckpt) for a in args], "--out", tmp_path / "out")
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.startswith("Error:") and r.output.count("\n") == 1, r.output


def test_library_bad_arguments(ckpt, tmp_path):
    from switchhead import load
    from switchhead.analysis import inspect_text
    from switchhead.errors import SwitchheadError

    model, sp = load(ckpt / "ckpt")
    with pytest.raises(SwitchheadError, match="the text to inspect must be a string, got NoneType"):
        inspect_text(model, sp, None, tmp_path / "a")
    with pytest.raises(SwitchheadError, match="no layer given: name at least one, or none for all 2"):
        inspect_text(model, sp, TEXT, tmp_path / "a", layers=[])
    with pytest.raises(SwitchheadError, match="pieces but the model's vocab_size"):
        inspect_text(TransformerLM(model.config.replace(vocab_size=sp.get_piece_size() + 1)), sp, TEXT, tmp_path / "b")
    for ids in ([5, model.config.vocab_size], [-1]):
        with pytest.raises(SwitchheadError, match="is outside the vocabulary"):
            collect(model, ids)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("call,message", [
    (lambda m, sp, out: collect(m, [1.0, 2.0]), "token id 1.0 is outside the vocabulary"),
    (lambda m, sp, out: collect(m, "the"), "ids must be one sequence of token ids, got str"),
    (lambda m, sp, out: collect(m, [1, 2], layers=0), "the layers must be a list of integers, got int"),
    (lambda m, sp, out: collect(m, [1, 2], layers=[0.5]), "layer indices must be integers, got 0.5"),
    (lambda m, sp, out: collect(m.state_dict(), [1, 2]), "inspect needs a TransformerLM"),
    (lambda m, sp, out: inspect_text(m, sp, TEXT, out, heads=[True]), "head indices must be integers, got True"),
    # falsy wrong values, which would otherwise pass as index 0 or fail deeper in
    (lambda m, sp, out: collect(m, [1, 2], layers=[0.0]), "layer indices must be integers, got 0.0"),
    (lambda m, sp, out: collect(m, [1, 2], layers=[1, None]), "layer indices must be integers, got None"),
    (lambda m, sp, out: inspect_text(m, sp, TEXT, out, heads=[False]), "head indices must be integers, got False"),
    (lambda m, sp, out: inspect_text(m, sp, TEXT, out, window=True), "--window must be a positive integer, got True"),
    (lambda m, sp, out: inspect_text(m, sp, TEXT, 5), "--out must be a str or Path, got int"),
    (lambda m, sp, out: inspect_text("ckpt", sp, TEXT, out), "inspect needs a TransformerLM"),
    (lambda m, sp, out: run_inspect(None, TEXT, None, out, layers=7), "--layers must be comma-separated integers"),
    (lambda m, sp, out: run_inspect(None, None, 3, out), "--text-file must be a str or Path, got int"),
    (lambda m, sp, out: run_inspect(None, b"the", None, out), "the text to inspect must be a string, got bytes"),
])
def test_library_arguments_of_the_wrong_kind(ckpt, tmp_path, call, message):
    from switchhead import load
    from switchhead.errors import SwitchheadError

    model, sp = load(ckpt / "ckpt")
    with pytest.raises(SwitchheadError) as e:
        call(model, sp, tmp_path / "out")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_layers_and_heads_lists_are_taken_sorted_and_once(ckpt, tmp_path):
    from switchhead import load

    model, sp = load(ckpt / "ckpt")
    result = run_inspect(ckpt / "ckpt", TEXT, None, tmp_path / "out", layers=[1, 0, 1], heads=(1, 0))
    assert result.layers == [0, 1] and result.heads == [0, 1]
    again = inspect_text(model, sp, TEXT, tmp_path / "again", layers=range(2), heads=[1, 1])
    assert again.layers == [0, 1] and again.heads == [1]
    ids = sp.encode(TEXT)
    from_tensor, from_list = collect(model, torch.tensor(ids)), collect(model, ids)
    assert len(from_tensor) == len(from_list) > 0
    assert all(np.array_equal(a.layers[i].probs, b.layers[i].probs)
               for a, b in zip(from_tensor, from_list) for i in (0, 1))


def test_output_path_that_is_a_file(ckpt, tmp_path):
    target = tmp_path / "file.txt"
    target.write_text("keep me")
    r = _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", target)
    assert r.exit_code == 2 and "refusing to replace" in r.output and r.output.count("\n") == 1, r.output
    assert target.read_text() == "keep me"


def test_output_directory_is_new_empty_or_an_earlier_report(ckpt, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("my own page")
    r = _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", mine)
    assert r.exit_code == 2 and "refusing to replace" in r.output and r.output.count("\n") == 1, r.output
    assert [p.name for p in mine.iterdir()] == ["index.html"] and (mine / "index.html").read_text() == "my own page"

    out = tmp_path / "report"
    out.mkdir()
    assert _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", out, "--layers", "0", "--json").exit_code == 0
    first = {p.name for p in out.iterdir()}
    assert "usage_L0.png" in first and "attention.json" in first
    # Drawing another layer replaces the report as a whole: no figure or JSON of the first run is left.
    r = _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", out, "--layers", "1")
    assert r.exit_code == 0, r.output
    second = {p.name for p in out.iterdir()}
    assert "usage_L1.png" in second and not second & (first - {"index.html"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "report"]  # no temporary directory left

    (out / "notes.txt").write_text("mine")  # a report with a user's file in it is no longer ours to replace
    r = _run("--ckpt", ckpt / "ckpt", "--text", TEXT, "--out", out, "--layers", "1")
    assert r.exit_code == 2 and "refusing to replace" in r.output, r.output
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("n_groups, n_experts, peak", [(1, 16, 0), (2, 5, 4), (4, 8, 7), (4, 8, 0)])
def test_usage_legend_covers_no_bar(tmp_path, n_groups, n_experts, peak):
    from switchhead.analysis import usage_figure

    rng = np.random.default_rng(0)
    counts = rng.integers(1, 20, (n_groups, n_experts))
    counts[:, peak] = 400  # one expert takes most selections: its bar reaches the top of the data
    fig = usage_figure(tmp_path / "u.png", {"v": counts, "o": counts[::-1]}, "t", [f"head {g}" for g in
                                                                                   range(n_groups)])
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        bars = [p.get_window_extent(renderer) for p in ax.patches]
        assert len(bars) == n_groups * n_experts
        assert not any(legend.overlaps(b) for b in bars), (n_groups, peak)


@pytest.mark.parametrize("projections, sides", [(("v",), {"v"}), (("k",), {"v"}), (("q",), {"o"}),
                                                (("v", "k"), {"v"}), ((), set())])
def test_only_choices_that_feed_a_projection_are_reported(projections, sides):
    from switchhead.analysis import expert_usage, to_json

    cfg = SMALL.replace(moe_projections=projections)
    model = _model(cfg)
    chunks = collect(model, list(range(9)))
    for chunk in chunks:
        for trace in chunk.layers.values():
            assert {s for s in ("v", "o") if getattr(trace, s) is not None} == sides
    assert set(expert_usage(cfg, chunks, 0)) == sides
    head = to_json(cfg, [str(i) for i in range(9)], list(range(9)), chunks, [0])["chunks"][0]["layers"][0]["heads"][0]
    assert {s for s in ("v", "o") if head[s] is not None} == sides
