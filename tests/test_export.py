"""ONNX export: graph structure, parity with PyTorch for every architecture, the ORT backend in the shared
engine, int8 quantisation, the CLI and its errors.

Exports take seconds each, so every exported directory is a module-scoped fixture shared by the tests, and the
architecture variants use one-layer versions of the tiny presets.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from tiny import word_tokenizer

import switchhead
from switchhead import PRESETS, TransformerLM
from switchhead.cli import main
from switchhead.export import ExportError, OnnxBackend, export, load_backend, schema
from switchhead.export.exporter import check_config, export_model, quantize_int8
from switchhead.runtime import Generator, SamplingParams, TorchBackend, XLCache, feed

WORDS = "a river runs past old mills where children play and boats drift slowly toward the sea".split()

VARIANTS = {
    "dense": PRESETS["tiny-transformer"].replace(n_layers=1),
    "moa": PRESETS["tiny-moa"].replace(n_layers=1),
    "switchall": PRESETS["tiny-switchall"].replace(n_layers=1),
    # RoPE with every projection a mixture and one selection matrix shared by both sides.
    "rope-vkqo-shared": PRESETS["tiny-switchhead-rope"].replace(n_layers=1, moe_projections=("v", "k", "q", "o"),
                                                               shared_selection=True),
    # RoPE without memory, only K a mixture (V dense but still routed by the source-side selection).
    "rope-nomem-k": PRESETS["tiny-switchhead-rope-nomem"].replace(n_layers=1, moe_projections=("k",)),
}



def _model(cfg, seed=0):
    torch.manual_seed(seed)
    m = TransformerLM(cfg).eval()
    with torch.no_grad():
        m.out.weight.mul_(3.0)  # peakier outputs, so greedy decoding is not dominated by near-ties
    return m



@pytest.fixture(scope="module")
def sp():
    return word_tokenizer(WORDS)


@pytest.fixture(scope="module")
def model(sp):
    m = _model(PRESETS["tiny-switchhead"].replace(vocab_size=sp.get_piece_size()))
    with torch.no_grad():
        m.out.bias[sp.eos_id()] = -20.0  # generations run to their limit
    return m


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, model, sp):
    return switchhead.save(tmp_path_factory.mktemp("ck") / "model", model, sp)


@pytest.fixture(scope="module")
def exported(ckpt, tmp_path_factory):
    """The main export, made through the CLI."""
    out = tmp_path_factory.mktemp("onnx") / "tiny"
    r = CliRunner().invoke(main, ["export", "--onnx", "--ckpt", str(ckpt), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "model.onnx" in r.output
    return out


@pytest.fixture(scope="module")
def variant_exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    out = {}
    for name, cfg in VARIANTS.items():
        m = _model(cfg, seed=1)
        out[name] = (m, export(None, root / name, model=m).out)
    return out


def _ids(vocab, batch, n, seed=0):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _forward(model, ids):
    with torch.no_grad():
        return model(ids)[0]


# --- graph structure ------------------------------------------------------------------------------------


def test_graph_keeps_custom_op_with_its_function(exported):
    proto = onnx.load(str(exported / "model.onnx"))
    schema.register_schema()
    onnx.checker.check_model(proto, full_check=True)
    custom = [n for n in proto.graph.node if n.domain == schema.DOMAIN]
    assert len(custom) == 2 * 2  # V and O projections of 2 layers: not inlined by the exporter
    assert all(n.op_type == schema.OP for n in custom)
    assert [(f.domain, f.name) for f in proto.functions] == [(schema.DOMAIN, schema.OP)]
    assert {o.domain: o.version for o in proto.opset_import}[schema.DOMAIN] == 1
    assert proto.ir_version <= 13


def test_dynamic_axes_stay_symbolic(exported):
    proto = onnx.load(str(exported / "model.onnx"))
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in list(proto.graph.input) + list(proto.graph.output)}
    assert dims["input_ids"] == ["batch", "seq"]
    assert dims["past_key_values.1.value"] == ["batch", 2, "past", 16]
    assert dims["present.0.key"] == ["batch", 2, "seq", 16]
    assert dims["logits"] == ["batch", "seq", 300] or dims["logits"][:2] == ["batch", "seq"]


def test_export_directory_contents(exported, sp):
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "layout.json", "model.onnx",
                                                          "tokenizer.model"]
    backend = load_backend(exported)
    assert backend.layout["memory"]["cache_shape"] == ["batch", 2, 32, 16]
    assert backend.tokenizer.encode("a river") == sp.encode("a river")
    assert not [p for p in exported.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_function_body_matches_torch_op_in_every_regime():
    """The FunctionProto alone, under ORT and the ONNX reference evaluator, for both formulations."""
    from switchhead.kernels.reference import forward as reference_forward

    schema.register_schema()
    rng = np.random.default_rng(0)
    for n_in, n_out, slots, experts in [(1, 2, 4, 8), (2, 1, 4, 8), (3, 1, 6, 5), (1, 3, 3, 4), (2, 2, 4, 3)]:
        node = onnx.helper.make_node(schema.OP, ["X", "W", "I", "G"], ["Y"], domain=schema.DOMAIN, n_out=n_out)
        graph = onnx.helper.make_graph([node], "g", [
            onnx.helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["n", n_in, 6]),
            onnx.helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [experts, 6, 7]),
            onnx.helper.make_tensor_value_info("I", onnx.TensorProto.INT64, ["n", slots]),
            onnx.helper.make_tensor_value_info("G", onnx.TensorProto.FLOAT, ["n", slots])],
            [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["n", n_out, 7])])
        proto = onnx.helper.make_model(graph, functions=[schema.function_proto()], ir_version=10, opset_imports=[
            onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid(schema.DOMAIN, 1)])
        onnx.checker.check_model(proto, full_check=True)
        feeds = {"X": rng.standard_normal((5, n_in, 6), dtype=np.float32),
                 "W": rng.standard_normal((experts, 6, 7), dtype=np.float32),
                 "I": rng.integers(0, experts, (5, slots)), "G": rng.random((5, slots), dtype=np.float32)}
        want = reference_forward(*(torch.from_numpy(feeds[k]) for k in "XWIG"), n_out).numpy()
        got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        ref = onnx.reference.ReferenceEvaluator(proto).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(ref, want, atol=1e-5)


def _expert_projection_loop(x, w, index, gate, n_out):
    """The operator's definition, one (token, slot) pair at a time in float64."""
    n, n_in, _ = x.shape
    slots = index.shape[1]
    y = np.zeros((n, n_out, w.shape[2]))
    for t in range(n):
        for s in range(slots):
            y[t, s // (slots // n_out)] += gate[t, s] * (x[t, s // (slots // n_in)].astype(np.float64)
                                                         @ w[index[t, s]].astype(np.float64))
    return y


@pytest.mark.parametrize("tokens", [0, 1, 3])
def test_function_body_on_awkward_shapes(tokens):
    """Both formulations against a float64 loop: no tokens, one token, one expert, k = 1..4, every pair on one
    expert (the others without tokens), and the all-ones gate the exporter feeds for an absent one."""
    from onnx.reference import ReferenceEvaluator

    schema.register_schema()
    rng = np.random.default_rng(tokens)
    h = onnx.helper
    # (I, R, k) with S = max(I, R) * k slots: the V/K/Q, O, sigma-MoE and MoA uses and a few more.
    shapes = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (1, 3, 1), (3, 1, 3), (2, 2, 4), (1, 4, 4), (4, 1, 1)]
    for (n_in, n_out, k), experts in zip(shapes, [1, 3, 2, 1, 4, 5, 2, 3]):
        slots = max(n_in, n_out) * k
        node = h.make_node(schema.OP, ["X", "W", "I", "G"], ["Y"], domain=schema.DOMAIN, n_out=n_out)
        graph = h.make_graph([node], "g", [
            h.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["n", n_in, 3]),
            h.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [experts, 3, 5]),
            h.make_tensor_value_info("I", onnx.TensorProto.INT64, ["n", slots]),
            h.make_tensor_value_info("G", onnx.TensorProto.FLOAT, ["n", slots])],
            [h.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["n", n_out, 5])])
        proto = h.make_model(graph, functions=[schema.function_proto()], ir_version=10, opset_imports=[
            h.make_opsetid("", 18), h.make_opsetid(schema.DOMAIN, 1)])
        onnx.checker.check_model(proto, full_check=True)
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = ReferenceEvaluator(proto)
        x = rng.standard_normal((tokens, n_in, 3), dtype=np.float32)
        w = rng.standard_normal((experts, 3, 5), dtype=np.float32)
        for index, gate in ((rng.integers(0, experts, (tokens, slots)), rng.random((tokens, slots), np.float32)),
                            (np.full((tokens, slots), experts - 1), np.ones((tokens, slots), np.float32))):
            feeds = {"X": x, "W": w, "I": index, "G": gate}
            want = _expert_projection_loop(x, w, index, gate, n_out)
            for got in (sess.run(None, feeds)[0], ref.run(None, feeds)[0]):
                assert got.shape == want.shape, (n_in, n_out, k, experts)
                np.testing.assert_allclose(got, want, atol=1e-5, err_msg=str((n_in, n_out, k, experts)))


def _step_feeds(cfg, ids, past_len=0):
    """Raw graph inputs for a first step: `past_len` empty past slots, then the tokens at positions 0..t-1."""
    b, t = ids.shape
    heads = 1 if cfg.attention == "moa" else cfg.n_heads
    feeds = {"input_ids": ids.numpy(), "position_ids": np.tile(np.arange(t), (b, 1)),
             "attention_mask": np.ones((b, t), bool), "past_position_ids": np.zeros((b, past_len), np.int64),
             "past_attention_mask": np.zeros((b, past_len), bool)}
    for i in range(cfg.n_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((b, heads, past_len, cfg.d_head), np.float32)
    return feeds


def test_empty_past_and_reference_evaluator(exported, model):
    """An empty past (past = 0) is valid, and onnx.reference runs the model and agrees with PyTorch."""
    ids = _ids(model.config.vocab_size, 2, 5)
    want = _forward(model, ids).numpy()
    feeds = _step_feeds(model.config, ids)
    sess = ort.InferenceSession(str(exported / "model.onnx"), providers=["CPUExecutionProvider"])
    out = sess.run(None, feeds)
    np.testing.assert_allclose(out[0], want, atol=1e-4)
    assert out[1].shape == (2, 2, 5, 16)  # present = this step's keys only
    schema.register_schema()
    ref = onnx.reference.ReferenceEvaluator(str(exported / "model.onnx")).run(["logits"], feeds)[0]
    np.testing.assert_allclose(ref, want, atol=1e-4)


def test_fp16_export_of_a_model_in_training():
    """Exporting a checkpoint in the middle of training: dropout stays on, the run's random numbers are those it
    would have drawn without the export, and the fp16 graph (both expert-projection regimes, a gate-less one
    among them) is valid and within fp16 error of the fp32 model."""
    cfg = PRESETS["tiny-switchall"].replace(n_layers=1, d_model=32, d_head=8, ff_expert_size=8, dropout=0.1)
    model = _model(cfg).train()
    model.blocks[0].ff.eval()  # a submodule its trainer keeps in eval mode
    torch.manual_seed(5)
    proto = export_model(model, dtype="fp16")
    drawn = torch.rand(4)
    assert model.training and model.blocks[0].attn.training and not model.blocks[0].ff.training
    assert next(model.parameters()).dtype == torch.float32
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(4))
    schema.register_schema()
    onnx.checker.check_model(proto, full_check=True)
    ids = _ids(cfg.vocab_size, 2, 9)
    feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in _step_feeds(cfg, ids).items()}
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    diff = np.abs(sess.run(["logits"], feeds)[0] - _forward(model.eval(), ids).numpy())
    assert diff.max() <= 3e-2 and diff.mean() <= 3e-3


# --- parity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_main_parity_multi_chunk(exported, model, batch):
    ids = _ids(model.config.vocab_size, batch, 2 * model.config.chunk_len + 7, seed=batch)
    logits, cache = load_backend(exported).logits(ids)
    assert (logits - _forward(model, ids)).abs().max() <= 1e-4
    assert int(cache.seen[0]) == ids.shape[1]


def test_bad_ids_are_refused_as_by_the_torch_backend(exported, model):
    # ONNX Runtime's Gather wraps negative ids around: -1 used to score as the last piece, silently.
    backend, V = load_backend(exported), model.config.vocab_size
    for ids, message in ((torch.tensor([[-1, 3]]), "token id -1 is outside the vocabulary"),
                         (torch.tensor([[3, V]]), f"token id {V} is outside the vocabulary"),
                         (torch.zeros(1, 0, dtype=torch.long), "input_ids must be [batch, tokens] with batch, tokens"),
                         (torch.zeros(0, 3, dtype=torch.long), "input_ids must be [batch, tokens] with batch, tokens")):
        for b in (backend, TorchBackend(model)):
            with pytest.raises(switchhead.SwitchheadError, match=re.escape(message)):
                b.logits(ids)


def test_backend_arguments_of_the_wrong_kind_are_one_clear_error(exported, model):
    backend, other = load_backend(exported), XLCache(model.config.replace(n_layers=1), 1)
    cases = [
        (lambda: load_backend(exported, threads=10**6), "--threads must be an integer between 1 and 1024"),
        (lambda: load_backend(exported, threads="2"), "--threads must be an integer between 1 and 1024, got '2'"),
        (lambda: load_backend(exported, threads=0), "--threads must be an integer between 1 and 1024, got 0"),
        (lambda: load_backend(exported, providers=5), "providers must be a non-empty list"),
        (lambda: load_backend(exported, providers="CPUExecutionProvider"), "providers must be a non-empty list"),
        (lambda: load_backend(exported, providers=["cpu"]), "execution provider 'cpu' is not available"),
        (lambda: load_backend(None), "the ONNX export directory must be a str or Path, got NoneType"),
        (lambda: OnnxBackend(123), "the ONNX export directory must be a str or Path, got int"),
        (lambda: backend.forward(torch.tensor([[1]]), None), "OnnxBackend.forward needs an XLCache inside a step"),
        (lambda: backend.forward(torch.tensor([[1]]), backend.new_cache(1)), "needs an XLCache inside a step"),
        (lambda: backend.logits(torch.tensor([[1.0, 2.0]])), "token ids must be an integer tensor, got torch.float32"),
        (lambda: backend.logits(torch.tensor([[True]])), "token ids must be an integer tensor, got torch.bool"),
        (lambda: backend.logits(torch.tensor([[1]]), other), "state is a cache of another model configuration"),
    ]
    for call, message in cases:
        with pytest.raises(switchhead.SwitchheadError, match=re.escape(message)):
            call()
    # Providers given as ONNX Runtime takes them, with options, still load.
    (logits, _), want = load_backend(exported, providers=[("CPUExecutionProvider", {})]).logits(
        torch.tensor([[3, 4]])), backend.logits(torch.tensor([[3, 4]]))[0]
    assert torch.equal(logits, want)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("batch", [1, 3])
def test_variant_parity_multi_chunk(variant_exports, name, batch):
    m, path = variant_exports[name]
    ids = _ids(m.config.vocab_size, batch, 2 * m.config.chunk_len + 9, seed=batch)
    logits, _ = OnnxBackend(path).logits(ids)
    assert (logits - _forward(m, ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["main", *VARIANTS])
def test_ragged_steps_match_torch_backend(exported, model, variant_exports, name):
    """Rows at different points of their chunks, padding slots and small steps, through the shared `feed`."""
    m, path = (model, exported) if name == "main" else variant_exports[name]
    ids = _ids(m.config.vocab_size, 3, 40, seed=7)
    rows = [ids[0, :37].tolist(), ids[1, :11].tolist(), ids[2].tolist()]
    onnx_backend, torch_backend = OnnxBackend(path), TorchBackend(m)
    a = feed(onnx_backend, onnx_backend.new_cache(3), rows, step=6, keep="all")
    b = feed(torch_backend, torch_backend.new_cache(3), rows, step=6, keep="all")
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["switchall", "moa"])
def test_variant_runs_under_the_reference_evaluator(variant_exports, name):
    from onnx.reference import ReferenceEvaluator

    m, path = variant_exports[name]
    ids = _ids(m.config.vocab_size, 2, 5)
    feeds = _step_feeds(m.config, ids)
    schema.register_schema()
    ref = ReferenceEvaluator(str(path / "model.onnx")).run(["logits"], feeds)[0]
    np.testing.assert_allclose(ref, _forward(m, ids).numpy(), atol=1e-4)


def test_greedy_generation_is_token_identical(exported, model, sp):
    backend = load_backend(exported)
    prompts = ["a river runs", "children play and", "boats"]
    params = SamplingParams(max_new_tokens=40, temperature=0.0)  # crosses chunk boundaries (T = 16)
    onnx_out = Generator(backend, backend.tokenizer).generate(prompts, params)
    torch_out = Generator(TorchBackend(model), sp).generate(prompts, params)
    assert [g.tokens for g in onnx_out] == [g.tokens for g in torch_out]
    assert all(len(g.tokens) == 40 for g in onnx_out)
    assert len({tuple(g.tokens) for g in onnx_out}) > 1


def test_generate_cli_with_onnx_matches_checkpoint(exported, ckpt):
    args = ["generate", "a river runs", "--temperature", "0", "--max-new-tokens", "24", "--json"]
    via_onnx = CliRunner().invoke(main, args + ["--onnx", str(exported)])
    via_torch = CliRunner().invoke(main, args + ["--ckpt", str(ckpt)])
    assert via_onnx.exit_code == 0 and via_torch.exit_code == 0, via_onnx.output + via_torch.output
    assert json.loads(via_onnx.output)["text"] == json.loads(via_torch.output)["text"]
    both = CliRunner().invoke(main, args + ["--onnx", str(exported), "--ckpt", str(ckpt)])
    assert both.exit_code == 2 and "not both" in both.output


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_reach_onnx_runtime(exported, threads):
    """--threads of generate, serve and eval sets ONNX Runtime's intra-op threads for an export (torch's are
    irrelevant there)."""
    from switchhead.evals import SwitchheadLM
    from switchhead.runtime.commands import load_generator

    backends = [load_generator(None, onnx_dir=str(exported), threads=threads).backend,
                SwitchheadLM(onnx=str(exported), threads=threads, progress=False).backend]
    assert [b.session.get_session_options().intra_op_num_threads for b in backends] == [threads, threads]
    before = torch.get_num_threads()
    try:
        args = ["generate", "a river runs", "--onnx", str(exported), "--max-new-tokens", "3", "--threads", threads]
        r = CliRunner().invoke(main, list(map(str, args)))
        assert r.exit_code == 0, r.output
    finally:
        torch.set_num_threads(before)


def test_generate_onnx_checks_the_device(exported):
    """The export picks its own provider, but a mistyped --device is still an error, as for a PyTorch model."""
    r = CliRunner().invoke(main, ["generate", "--onnx", str(exported), "--device", "banana", "a river"])
    assert r.exit_code == 2 and "unknown device 'banana'" in r.output and r.output.count("\n") == 1, r.output


# --- int8 ---------------------------------------------------------------------------------------------


def test_int8_on_a_full_disk_is_an_export_error(exported, tmp_path, monkeypatch):
    """The quantiser's shape-inferred copy of the model, truncated by a full disk without an error, used to surface
    as a protobuf traceback: too little room is refused before quantising, and a failure of the quantiser itself is
    an ExportError (one line on the command line)."""
    import onnxruntime.quantization

    fp32, dst = exported / "model.onnx", tmp_path / "int8.onnx"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=fp32.stat().st_size))
    with pytest.raises(ExportError, match=r"cannot quantise to int8: it needs about \d+ MiB free"):
        quantize_int8(fp32, dst)
    monkeypatch.undo()

    def truncated_copy(src, dst, **kwargs):  # what the quantiser meets when the disk fills while it writes its copy
        copy = tmp_path / "inferred.onnx"
        copy.write_bytes(Path(src).read_bytes()[:100])
        onnx.load(str(copy))

    monkeypatch.setattr(onnxruntime.quantization, "quantize_dynamic", truncated_copy)
    with pytest.raises(ExportError, match="int8 quantisation failed: DecodeError"):
        quantize_int8(fp32, dst)


def test_int8_quantisation(exported, model, tmp_path):
    q = export(None, tmp_path / "int8", model=model, quantize="int8")
    fp32_size = (exported / "model.onnx").stat().st_size
    assert q.model_bytes < 0.9 * fp32_size
    proto = onnx.load(str(q.out / "model.onnx"))
    assert any(n.domain == schema.DOMAIN for n in proto.graph.node)
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeLinear") for n in proto.graph.node)
    ids = _ids(model.config.vocab_size, 2, 40, seed=3)

    def ppl(logits):
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).exp())

    fp32, int8 = ppl(_forward(model, ids)), ppl(OnnxBackend(q.out).logits(ids)[0])
    assert abs(int8 / fp32 - 1) < 0.05


def test_int8_export_runs_as_its_graph_defines(tmp_path, monkeypatch):
    """ONNX Runtime agrees with onnx.reference's exact integer arithmetic on the quantised graph, whatever the
    CPU's int8 instructions (x86 without VNNI saturates full-range u8 x s8 products)."""
    from onnx.reference import ReferenceEvaluator

    from switchhead.export import exporter
    from switchhead.fileio import is_temporary

    beside = []  # what lies beside the output while it quantises: all a kill at that moment would leave
    quantize = exporter.quantize_int8
    monkeypatch.setattr(exporter, "quantize_int8", lambda *a: beside.extend(p.name for p in tmp_path.iterdir())
                        or quantize(*a))
    model = _model(PRESETS["tiny-transformer"].replace(n_layers=1))
    q = export(None, tmp_path / "int8", model=model, quantize="int8")
    assert len(beside) == 1 and is_temporary(beside[0]), beside
    feeds = _step_feeds(model.config, _ids(model.config.vocab_size, 2, 16))
    got = ort.InferenceSession(str(q.out / "model.onnx"), providers=["CPUExecutionProvider"]).run(["logits"], feeds)
    want = ReferenceEvaluator(str(q.out / "model.onnx")).run(["logits"], feeds)
    np.testing.assert_allclose(got[0], want[0], atol=1e-4)


def test_weights_too_large_for_one_file_go_beside_it(exported, tmp_path, monkeypatch):
    """Beyond protobuf's 2 GiB a model cannot be one file: its weights go to model.onnx.data (ONNX external data).
    The threshold is lowered so that the tiny model takes that path, fp32 and int8 (whose fp32 model is then in
    two files too); the exports compute what the one-file export does and are replaced like it."""
    from switchhead.export import exporter

    model = _model(PRESETS["tiny-switchhead"].replace(n_layers=1))  # one layer: four exports in this test
    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", 0)
    ckpt = switchhead.save(tmp_path / "ck", model)
    out = Path(shutil.copytree(exported, tmp_path / "big"))  # an earlier one-file export, replaced
    r = CliRunner().invoke(main, ["export", "--onnx", "--ckpt", str(ckpt), "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "layout.json", "model.onnx", "model.onnx.data"]
    graph, data = (out / "model.onnx").stat().st_size, (out / "model.onnx.data").stat().st_size
    assert graph < data and f"(model.onnx + model.onnx.data {(graph + data) / 1e6:.1f} MB, fp32" in r.output
    assert data >= 0.9 * 4 * sum(p.numel() for p in model.parameters())  # the weights (small tensors stay inline)
    ids = _ids(model.config.vocab_size, 2, 40, seed=5)
    want = _forward(model, ids)
    torch.testing.assert_close(OnnxBackend(out).logits(ids)[0], want, rtol=1e-5, atol=1e-5)
    q = export(None, tmp_path / "int8", model=model, quantize="int8")
    assert sorted(p.name for p in q.out.iterdir()) == ["config.json", "layout.json", "model.onnx", "model.onnx.data"]
    monkeypatch.undo()
    one_file = export(None, tmp_path / "int8-one", model=model, quantize="int8").out
    assert not (one_file / "model.onnx.data").exists()
    # the same quantised weights, wherever they are stored
    torch.testing.assert_close(OnnxBackend(q.out).logits(ids)[0], OnnxBackend(one_file).logits(ids)[0], rtol=0, atol=0)
    export(None, out, model=model)  # the two-file export, replaced by a one-file one
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "layout.json", "model.onnx"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- errors and the CLI ------------------------------------------------------------------------------


def _no_output(path: Path) -> bool:
    return not path.exists() and not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")]


@pytest.mark.parametrize("args, message", [
    (["--dtype", "bf16"], "unsupported --dtype 'bf16'"),
    (["--quantize", "int4"], "unsupported --quantize 'int4'"),
    (["--dtype", "fp16", "--quantize", "int8"], "needs --dtype fp32"),
    (["--opset", "17"], "unsupported --opset 17"),
])
def test_cli_rejects_unsupported_options(ckpt, tmp_path, args, message):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", "--onnx", "--ckpt", str(ckpt), "--out", str(out), *args])
    assert r.exit_code == 2
    assert message in r.output and r.output.count("\n") == 1
    assert _no_output(out)


def test_cli_needs_target_and_checkpoint(tmp_path):
    r = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--onnx" in r.output
    r = CliRunner().invoke(main, ["export", "--onnx", "--ckpt", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "not found" in r.output


def test_export_needs_a_model(tmp_path):
    with pytest.raises(ExportError, match="export needs a TransformerLM, got str"):
        export(None, tmp_path / "x", model="tiny-switchhead")
    assert not (tmp_path / "x").exists()


def test_python_api_refuses_ambiguous_or_mistyped_options(model, ckpt, tmp_path):
    with pytest.raises(ExportError, match="opset must be an integer, got '18'"):
        export(None, tmp_path / "a", model=model, opset="18")
    with pytest.raises(ExportError, match="not both"):
        export(ckpt, tmp_path / "b", model=model)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_refuses_a_tokenizer_of_another_vocabulary(model, tmp_path):
    other = word_tokenizer(WORDS + ["zebra", "quartz"], vocab_size=320)
    with pytest.raises(ExportError, match="the tokenizer has 320 pieces but the model's vocab_size is 300"):
        export(None, tmp_path / "x", model=model, tokenizer=other)
    assert _no_output(tmp_path / "x")


def test_unsupported_config_is_named():
    cfg = PRESETS["tiny-switchhead"].replace(n_layers=1)
    object.__setattr__(cfg, "attention", "linear")  # a kind a future config may add
    with pytest.raises(ExportError, match="attention='linear'"):
        check_config(cfg)


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "broken"
    model = _model(PRESETS["tiny-transformer"].replace(n_layers=1, d_model=32, d_head=8))  # the cheapest export

    def fail(*args, **kwargs):
        raise RuntimeError("the checker failed")

    monkeypatch.setattr(onnx.checker, "check_model", fail)  # after the model file is written into the temporary
    with pytest.raises(RuntimeError, match="the checker failed"):
        export(None, out, model=model)
    assert _no_output(out)


def test_python_api_refuses_arguments_of_the_wrong_kind(model, ckpt, sp, tmp_path):
    cases = [
        (lambda: export(None, tmp_path / "x", model=model, tokenizer="tokenizer.model"),
         "the tokenizer must be a sentencepiece.SentencePieceProcessor"),
        (lambda: export(ckpt, tmp_path / "x", tokenizer=sp), "tokenizer= goes with model="),
        (lambda: export(None, tmp_path / "x", model=model, dtype=["fp32"]), "unsupported --dtype ['fp32']"),
        (lambda: export(None, tmp_path / "x", model=model, quantize=8), "unsupported --quantize 8"),
        (lambda: export(None, 5, model=model), "the export directory must be a str or Path, got int"),
        (lambda: export_model("tiny-switchhead"), "export needs a TransformerLM, got str"),
    ]
    for call, message in cases:
        with pytest.raises(ExportError, match=re.escape(message)):
            call()
    assert not (tmp_path / "x").exists()


def test_replaces_only_an_earlier_export(model, exported, tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with_notes = Path(shutil.copytree(exported, tmp_path / "with-notes"))
    (with_notes / "README.md").write_text("my notes")
    lookalike = tmp_path / "lookalike"  # the file names, but no layout of ours
    lookalike.mkdir()
    (lookalike / "layout.json").write_text("{}")
    (lookalike / "model.onnx").write_bytes(b"mine")
    for path in (tmp_path / "precious", with_notes, lookalike, tmp_path / "precious" / "notes.txt"):
        with pytest.raises(switchhead.SwitchheadError, match="refusing to replace .*not a switchhead ONNX export"):
            export(None, path, model=model)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    assert (with_notes / "README.md").read_text() == "my notes" and (lookalike / "model.onnx").read_bytes() == b"mine"
    earlier = Path(shutil.copytree(exported, tmp_path / "earlier"))
    cheap = _model(PRESETS["tiny-transformer"].replace(n_layers=1, d_model=32, d_head=8))
    export(None, earlier, model=cheap)
    assert json.loads((earlier / "config.json").read_text())["d_model"] == 32
    assert sorted(p.name for p in earlier.iterdir()) == ["config.json", "layout.json", "model.onnx"]


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _edit_layout(d: Path, change) -> None:
    path = d / "layout.json"
    layout = json.loads(path.read_text())
    change(layout)
    path.write_text(json.dumps(layout))


def _logits_vocab_7(layout: dict) -> None:
    layout["outputs"][0]["shape"][2] = 7


DAMAGE = {
    "no config": (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{bad"), "config.json: config is not valid JSON"),
    "config of another model": (lambda d: _edit_json(d / "config.json", n_layers=3),
                                "model.onnx has no input past_key_values.2.key"),
    "config with another vocabulary": (lambda d: _edit_json(d / "config.json", vocab_size=700),
                                       "output logits has shape"),
    "unknown config key": (lambda d: _edit_json(d / "config.json", colour="red"), "unknown config key"),
    "layout not JSON": (lambda d: (d / "layout.json").write_text("{bad"), "layout.json is not readable JSON"),
    "layout not UTF-8": (lambda d: (d / "layout.json").write_bytes(b'{\n"dtype": "fp\xe9"}'),
                         r"cannot read .*layout.json: not valid UTF-8 \(byte 0xe9 at offset 14, line 2\)"),
    "config not UTF-8": (lambda d: (d / "config.json").write_bytes(b'{"name": "\xe9"}'),
                         r"cannot read .*config.json: not valid UTF-8 \(byte 0xe9 at offset 10, line 1\)"),
    "layout a list": (lambda d: (d / "layout.json").write_text("[]"), "layout.json is not a JSON object"),
    "layout claims fp16": (lambda d: _edit_json(d / "layout.json", dtype="fp16"), r"is tensor\(float\), expected"),
    # Neither changes the graph's interface, but the runtime would roll its cache at the wrong point.
    "config with another chunk_len": (lambda d: _edit_json(d / "config.json", chunk_len=8),
                                      "layout.json memory.chunk_len is 16, but config.json gives 8"),
    "config without memory": (lambda d: _edit_json(d / "config.json", mem_chunks=0),
                              "layout.json memory.mem_chunks is 1, but config.json gives 0"),
    "layout with another window": (lambda d: _edit_layout(d, lambda x: x["memory"].update(window=64)),
                                   "layout.json memory.window is 64, but config.json gives 32"),
    "layout without memory": (lambda d: _edit_layout(d, lambda x: x.pop("memory")), "layout.json memory is missing"),
    "layout with another vocabulary": (lambda d: _edit_layout(d, _logits_vocab_7),
                                       r"layout.json outputs\[0\].shape\[2\] is 7, but config.json gives \d+"),
    "layout dtype fp64": (lambda d: _edit_json(d / "layout.json", dtype="fp64"),
                          "layout.json has dtype 'fp64'; an export's dtype is one of fp32, fp16"),
    "layout dtype a list": (lambda d: _edit_json(d / "layout.json", dtype=["fp32"]), r"has dtype \['fp32'\]"),
    "layout quantize int4": (lambda d: _edit_json(d / "layout.json", quantize="int4"),
                             "layout.json has quantize 'int4'; an export's quantize is null or one of int8"),
    "layout int8 fp16": (lambda d: _edit_json(d / "layout.json", dtype="fp16", quantize="int8"),
                         "only fp32 exports are quantised"),
    "layout opset 17": (lambda d: _edit_json(d / "layout.json", opset=17),
                        "layout.json opset is 17, but a switchhead-onnx/1 export has 18"),
    "another tokenizer": (lambda d: (d / "tokenizer.model").write_bytes(
        word_tokenizer(WORDS, vocab_size=280).serialized_model_proto()), "pieces but the model's vocab_size is"),
    "corrupt tokenizer": (lambda d: (d / "tokenizer.model").write_bytes(b"\x00garbage"), "tokenizer.model is corrupt"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=str)
def test_damaged_export_directory_is_one_clear_error(exported, tmp_path, damage):
    """generate --onnx (and eval --onnx, through the same loader) on an export whose files do not belong
    together: one line and exit 2 when loading, not an ONNX Runtime error mid-generation."""
    import shutil

    d = tmp_path / "damaged"
    shutil.copytree(exported, d)
    damage_fn, message = DAMAGE[damage]
    damage_fn(d)
    with pytest.raises(switchhead.SwitchheadError, match=message):
        load_backend(d)
    r = CliRunner().invoke(main, ["generate", "--onnx", str(d), "--max-new-tokens", "2", "a river"])
    assert r.exit_code == 2 and re.search(message, r.output) and r.output.count("\n") == 1, r.output


def test_export_refuses_targets_it_could_not_rename_into_place(model, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(switchhead.SwitchheadError, match="afile is not a directory"):
        export(None, tmp_path / "afile" / "sub" / "out", model=model)
    assert (tmp_path / "afile").read_text() == "x"
    first = export(None, tmp_path / "exp", model=model).out
    monkeypatch.chdir(first)
    with pytest.raises(switchhead.SwitchheadError, match="current directory"):
        export(None, ".", model=model)
    assert (first / "model.onnx").is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
