"""Export a `TransformerLM` decode step to ONNX (file format in docs/EXPORT.md).

The graph is one cached decode step of the same block code the model trains with (`TransformerLM.decode`),
run against a cache stand-in that attends over ``concat(past, new)``:

    input_ids [batch, seq] int64, position_ids [batch, seq] int64, attention_mask [batch, seq] bool,
    past_position_ids [batch, past] int64, past_attention_mask [batch, past] bool,
    past_key_values.{i}.key|value [batch, heads, past, d_head]
      -> logits [batch, seq, vocab], present.{i}.key|value [batch, heads, seq, d_head]

``present`` holds only this step's keys/values: the XL window is a fixed 2T-slot ring managed by the caller
(`switchhead.runtime.cache.XLCache`), not a growing concatenation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import Tensor, nn

from switchhead.errors import SwitchheadError, brief, is_int
from switchhead.export import schema
from switchhead.fileio import as_path, atomic_directory, check_output_dir, holds_only, require_dir
from switchhead.model.accounting import kv_heads
from switchhead.model.config import ModelConfig
from switchhead.model.lm import TransformerLM, eval_mode
from switchhead.model.tokenizer import check_tokenizer

MODEL_FILE, LAYOUT_FILE, CONFIG_FILE, TOKENIZER_FILE = "model.onnx", "layout.json", "config.json", "tokenizer.model"
# Weights of models too large for one protobuf message (2 GiB) go to this file beside MODEL_FILE (ONNX external
# data, which ONNX Runtime reads from the model's directory).
DATA_FILE = "model.onnx.data"
EXTERNAL_DATA_BYTES = 2**31 - 2**28  # weights above this leave too little room for the graph in one message
FORMAT = "switchhead-onnx/1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
QUANTIZE = ("int8",)
# ONNX Runtime 1.31 reads models up to IR version 13; this is what onnx 1.23 writes for opset 18 anyway.
IR_VERSION = 10
DYNAMIC = ("batch", "seq", "past")
# past + seq never exceeds this many chunks: the 2-chunk window plus one step of at most a chunk.
MAX_WINDOW_CHUNKS = 3


class ExportError(SwitchheadError):
    """A model, option or target the exporter cannot handle."""


def input_names(cfg: ModelConfig) -> list[str]:
    names = ["input_ids", "position_ids", "attention_mask", "past_position_ids", "past_attention_mask"]
    for i in range(cfg.n_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(cfg: ModelConfig) -> list[str]:
    names = ["logits"]
    for i in range(cfg.n_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


class _ConcatCache:
    """`KVCache` for the traced step: the key window is the past followed by this step's tokens."""

    def __init__(self, past: list[tuple[Tensor, Tensor]], pos_q: Tensor, new_mask: Tensor, past_pos: Tensor,
                 past_valid: Tensor):
        self.past, self.pos_q = past, pos_q
        self.pos_k = torch.cat([past_pos, pos_q], 1)
        self.valid = torch.cat([past_valid, new_mask], 1)
        self.present: list[Tensor] = []

    def update(self, layer: int, k: Tensor, v: Tensor):
        pk, pv = self.past[layer]
        self.present += [k.transpose(1, 2), v.transpose(1, 2)]
        kw = torch.cat([pk.transpose(1, 2).to(k.dtype), k], 1)
        vw = torch.cat([pv.transpose(1, 2).to(v.dtype), v], 1)
        return kw, vw, self.pos_q, self.pos_k, self.valid


class DecodeStep(nn.Module):
    """The exported function: one decode step over flat graph inputs (see the module docstring)."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.model = model
        cfg = model.config
        # Relative-position tables as graph constants, instead of a [window, d] x [d, H*dh] projection per layer
        # and step (which would cost more than the rest of a decode step). A step sees past + seq <= 2T + T keys
        # (the cache window plus at most one chunk), so 3T rows cover every window the runtime can build.
        self.tables = nn.ParameterList()
        for block in model.blocks:
            if block.attn.pos is not None:
                with torch.no_grad():
                    table = block.attn.rel_pos(MAX_WINDOW_CHUNKS * cfg.chunk_len, None)
                self.tables.append(nn.Parameter(table.detach().clone(), requires_grad=False))

    def forward(self, input_ids, position_ids, attention_mask, past_position_ids, past_attention_mask, *past):
        cfg = self.model.config
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(cfg.n_layers)]
        cache = _ConcatCache(pairs, position_ids, attention_mask, past_position_ids, past_attention_mask)
        tables = iter(self.tables)
        for block in self.model.blocks:
            if block.attn.pos is not None:
                block.attn.rel_pos = _table(next(tables))
        try:
            logits = self.model.decode(input_ids, cache)
        finally:
            for block in self.model.blocks:
                block.attn.__dict__.pop("rel_pos", None)
        return (logits.float(), *cache.present)


def _table(table: Tensor):
    def rel_pos(n, device=None):
        # Exactly the first n rows, as the model's own rel_pos(n) returns, so that the mix's clamp to n - 1
        # behaves identically (padding tokens and empty slots can lie further away than any visible key).
        return table[:n]
    return rel_pos


def check_options(dtype: str = "fp32", quantize: str | None = None, opset: int = 18) -> None:
    """Raise ExportError naming the unsupported option before any work is done."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ExportError(f"unsupported --dtype {brief(dtype)}; supported: {', '.join(DTYPES)}")
    if quantize is not None and (not isinstance(quantize, str) or quantize not in QUANTIZE):
        raise ExportError(f"unsupported --quantize {brief(quantize)}; supported: {', '.join(QUANTIZE)}")
    if quantize is not None and dtype != "fp32":
        raise ExportError(f"--quantize {quantize} needs --dtype fp32 (dynamic quantisation starts from fp32 "
                          f"weights), got --dtype {dtype}")
    if not is_int(opset):
        raise ExportError(f"the opset must be an integer, got {opset!r}")
    if opset != schema.OPSET:
        raise ExportError(f"unsupported --opset {opset}: the exporter targets opset {schema.OPSET} only "
                          "(what ONNX Runtime 1.31 and the expert-projection function body are tested with)")


# What the decode graph and its cache layout were written and tested for.
SUPPORTED = {"attention": ("switchhead", "dense", "moa"), "positional": ("xl", "rope"), "ff": ("dense", "sigma_moe"),
             "mem_chunks": (0, 1)}


def check_config(cfg: ModelConfig) -> None:
    """Raise ExportError naming the part of a model configuration the exporter cannot handle."""
    for name, ok in SUPPORTED.items():
        if getattr(cfg, name) not in ok:
            raise ExportError(f"cannot export {name}={getattr(cfg, name)!r}; the ONNX exporter supports "
                              f"{name} in {ok}")


def _example_inputs(cfg: ModelConfig, dtype: torch.dtype, batch: int = 2, seq: int = 3, past: int = 5):
    """Sizes chosen distinct and > 1 so that the exporter cannot specialise or unify any dynamic axis."""
    heads = kv_heads(cfg)
    # A private generator: exporting must not advance the caller's random stream (a training run that exports
    # a checkpoint would otherwise continue differently from one that does not).
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    pos_q = torch.arange(past, past + seq)[None].expand(batch, -1).contiguous()
    mask = torch.ones(batch, seq, dtype=torch.bool)
    past_pos = torch.arange(past)[None].expand(batch, -1).contiguous()
    past_valid = torch.ones(batch, past, dtype=torch.bool)
    kv = [torch.randn(batch, heads, past, cfg.d_head, dtype=dtype, generator=gen) for _ in range(2 * cfg.n_layers)]
    return (ids, pos_q, mask, past_pos, past_valid, *kv)


def _dynamic_shapes(cfg: ModelConfig):
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq")
    past = torch.export.Dim("past", min=0)
    shapes = [{0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: past}, {0: batch, 1: past}]
    # The *past varargs form one entry of the signature.
    return (*shapes, tuple({0: batch, 2: past} for _ in range(2 * cfg.n_layers)))


def export_model(model: TransformerLM, dtype: str = "fp32", opset: int = 18) -> onnx.ModelProto:
    """The decode-step graph of `model` with the expert-projection function attached (not yet quantised)."""
    if not isinstance(model, TransformerLM):
        raise ExportError(f"export needs a TransformerLM, got {type(model).__name__}")
    cfg = model.config
    check_options(dtype, None, opset)
    check_config(cfg)
    schema.register_schema()
    tdtype = DTYPES[dtype]
    if next(model.parameters()).dtype != tdtype or next(model.parameters()).device.type != "cpu":
        # A private copy: the caller's model keeps its dtype and device.
        import copy

        model = copy.deepcopy(model).to(device="cpu", dtype=tdtype)
    args = _example_inputs(cfg, tdtype)
    # The exporter logs one warning per optional torchvision op it cannot register; they do not concern us.
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    # Traced without dropout, and the caller's model keeps its mode: exporting a checkpoint in the middle of
    # training must not switch the rest of that training's dropout off.
    with eval_mode(model), warnings.catch_warnings(), torch.no_grad(), \
            _log_level(registration_log, logging.ERROR):
        step = DecodeStep(model).eval()
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            step, args, dynamo=True, opset_version=opset, input_names=input_names(cfg),
            output_names=output_names(cfg), dynamic_shapes=_dynamic_shapes(cfg),
            custom_translation_table={torch.ops.switchhead.expert_projection.default: schema.translation()},
            verbose=False, report=False,
        )
    proto = program.model_proto
    return finalize(proto, cfg)


def finalize(proto: onnx.ModelProto, cfg: ModelConfig) -> onnx.ModelProto:
    """Attach the function definition, pin versions, and verify the interface."""
    uses_op = any(n.domain == schema.DOMAIN for n in _all_nodes(proto.graph))
    del proto.functions[:]  # the exporter's own helper functions are already inlined into the graph
    if uses_op:
        proto.functions.append(schema.function_proto())
    imports = {o.domain: o.version for o in proto.opset_import}
    imports[""] = schema.OPSET
    if uses_op:
        imports[schema.DOMAIN] = schema.VERSION
    del proto.opset_import[:]
    proto.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(imports.items()))
    proto.ir_version = min(proto.ir_version, IR_VERSION) if proto.ir_version else IR_VERSION
    proto.producer_name = "switchhead"
    # The exporter annotates initializers in value_info too; redundant, and stale once the quantiser rewrites
    # a weight (it transposes Gemm weights into MatMul ones), which then fails its own shape inference.
    inits = {t.name for t in proto.graph.initializer}
    keep = [vi for vi in proto.graph.value_info if vi.name not in inits]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(keep)
    _positive_gather_axes(proto.graph)
    _check_interface(proto, cfg)
    return proto


def _positive_gather_axes(graph: onnx.GraphProto) -> None:
    """GatherElements with the axis counted from the end (sigma-MoE's gates, gathered with axis -1) as the same
    axis counted from the start: onnx.reference's GatherElements misreads a negative axis and refuses any index
    narrower than its data, so it could not run sigma-MoE models."""
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*graph.value_info, *graph.input)
             if vi.type.tensor_type.HasField("shape")}
    ranks.update((t.name, len(t.dims)) for t in graph.initializer)
    for node in _all_nodes(graph):
        if node.op_type != "GatherElements" or node.domain not in ("", "ai.onnx") or node.input[0] not in ranks:
            continue
        for attr in node.attribute:
            if attr.name == "axis" and attr.i < 0:
                attr.i += ranks[node.input[0]]


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)


def _dims(vi: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param if d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]


def _check_interface(proto: onnx.ModelProto, cfg: ModelConfig) -> None:
    """Every dynamic axis must still be symbolic: an axis fixed by the example input would silently restrict
    the graph to that size."""
    heads = kv_heads(cfg)
    want = {"input_ids": ["batch", "seq"], "position_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"],
            "past_position_ids": ["batch", "past"], "past_attention_mask": ["batch", "past"],
            "logits": ["batch", "seq", cfg.vocab_size]}
    for i in range(cfg.n_layers):
        for kind in ("key", "value"):
            want[f"past_key_values.{i}.{kind}"] = ["batch", heads, "past", cfg.d_head]
            want[f"present.{i}.{kind}"] = ["batch", heads, "seq", cfg.d_head]
    got = {vi.name: _dims(vi) for vi in list(proto.graph.input) + list(proto.graph.output)}
    if sorted(got) != sorted(want):
        raise ExportError(f"exported graph has inputs/outputs {sorted(got)}, expected {sorted(want)}")
    for name, dims in want.items():
        if len(got[name]) != len(dims):
            raise ExportError(f"{name}: exported rank {len(got[name])}, expected {len(dims)}")
        for axis, (g, w) in enumerate(zip(got[name], dims)):
            if isinstance(w, str) and not isinstance(g, str):
                raise ExportError(f"{name} axis {axis} ({w}) was fixed to {g} by the exporter; it must stay dynamic")
            if isinstance(w, int) and g != w:
                raise ExportError(f"{name} axis {axis} is {g!r}, expected {w}")
    # Rename the exporter's symbols (s0, s1, ...) to the names used in layout.json.
    symbol = {}
    for name, dims in want.items():
        for g, w in zip(got[name], dims):
            if isinstance(w, str):
                if symbol.setdefault(g, w) != w:
                    raise ExportError(f"axes {symbol[g]!r} and {w!r} were unified by the exporter")
    for vi in list(proto.graph.input) + list(proto.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in symbol:
                d.dim_param = symbol[d.dim_param]


def layout(cfg: ModelConfig, dtype: str, quantize: str | None) -> dict:
    """The JSON description of the graph interface and the cache memory layout (docs/EXPORT.md)."""
    heads, T = kv_heads(cfg), cfg.chunk_len
    kv_type = "float16" if dtype == "fp16" else "float32"
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"],
         "meaning": "position of each new token in the key window"},
        {"name": "attention_mask", "dtype": "bool", "shape": ["batch", "seq"],
         "meaning": "true for real new tokens, false for padding"},
        {"name": "past_position_ids", "dtype": "int64", "shape": ["batch", "past"],
         "meaning": "position of each past slot"},
        {"name": "past_attention_mask", "dtype": "bool", "shape": ["batch", "past"],
         "meaning": "true for past slots that hold a visible key"},
    ]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["batch", "seq", cfg.vocab_size]}]
    for i in range(cfg.n_layers):
        for kind in ("key", "value"):
            inputs.append({"name": f"past_key_values.{i}.{kind}", "dtype": kv_type,
                           "shape": ["batch", heads, "past", cfg.d_head]})
            outputs.append({"name": f"present.{i}.{kind}", "dtype": kv_type,
                            "shape": ["batch", heads, "seq", cfg.d_head]})
    return {
        "format": FORMAT,
        "model_file": MODEL_FILE,
        "dtype": dtype,
        "quantize": quantize,
        "opset": schema.OPSET,
        "custom_ops": [{"domain": schema.DOMAIN, "version": schema.VERSION, "name": schema.OP,
                        "definition": "model-local FunctionProto (standard ONNX ops)"}],
        "dynamic_axes": list(DYNAMIC),
        "inputs": inputs,
        "outputs": outputs,
        "visibility": "query t sees key s iff s is valid and position_ids[t] - pos[s] >= 0, where the keys are "
                      "the past slots followed by this step's tokens (valid keys all lie within the window)",
        "memory": {
            "kind": "transformer-xl fixed window",
            "chunk_len": T,
            "mem_chunks": cfg.mem_chunks,
            "window": 2 * T,
            "n_layers": cfg.n_layers,
            "kv_heads": heads,
            "d_head": cfg.d_head,
            "cache_shape": ["batch", heads, 2 * T, cfg.d_head],
            "keys": "after projection and the 1/d_head**0.25 scale (RoPE not applied: rotated inside the graph)",
            "values": "after the expert mixture",
            "present": "keys/values of this step's tokens only; the caller writes them into its cache",
            "positions": ("with memory, memory slots have positions 0..T-1 and the current chunk T..2T-1; "
                          "without memory the current chunk has 0..T-1"),
            "chunking": ("a step never crosses a chunk boundary; when the current chunk is full it becomes the "
                         "memory (mem_chunks=1) or is dropped (mem_chunks=0) and a new chunk starts"),
        },
    }


@contextlib.contextmanager
def _log_level(logger: logging.Logger, level: int):
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


def save_model(proto: onnx.ModelProto, path: Path) -> None:
    """`proto` as one file, or with its weights in DATA_FILE beside it when they are too large for that."""
    weights = sum(t.ByteSize() for t in proto.graph.initializer)
    external = weights > EXTERNAL_DATA_BYTES
    # Tensors under 1 KiB (shapes, scalars) stay in the graph, where shape inference can read them.
    onnx.save(proto, str(path), save_as_external_data=external, all_tensors_to_one_file=True, location=DATA_FILE,
              size_threshold=1024)


def model_bytes(path: Path) -> int:
    """The size of the model file at `path` with its external data file, if it has one."""
    data = path.with_name(DATA_FILE)
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def quantize_int8(src: Path, dst: Path) -> None:
    """ONNX Runtime dynamic quantisation: int8 weights for MatMul/Gather-free dense layers, fp32 activations."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # The quantiser writes a shape-inferred copy of the fp32 model beside it, which a full disk truncates without an
    # error (it then fails to parse the copy): room for that copy and the int8 model is checked first.
    need, free = model_bytes(src) * 5 // 4, shutil.disk_usage(src.parent).free
    if free < need:
        raise ExportError(f"cannot quantise to int8: it needs about {need / 2**20:.0f} MiB free on the output's "
                          f"disk, there are {free / 2**20:.0f} MiB")
    # The quantiser's shape inference has to know the custom operator too.
    schema.register_schema()
    # The quantiser logs a generic "consider pre-processing" warning on the root logger for every model.
    # reduce_range (7-bit weights): ONNX Runtime's u8 x s8 kernels on x86 CPUs without VNNI add pairs of
    # products in saturating 16-bit lanes, so full-range weights give CPU-dependent results, several percent of
    # perplexity off on small models; with 7 bits no sum can saturate and every CPU computes the graph exactly.
    # Quantised into a directory of its own, with external data where `src` has it, then saved as `dst` in the
    # form its own size asks for: the quantiser's data file is named after its output, not DATA_FILE.
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".int8-") as work_dir:
        work = Path(work_dir) / MODEL_FILE
        try:
            with _log_level(logging.getLogger(), logging.ERROR):
                quantize_dynamic(str(src), str(work), weight_type=QuantType.QInt8,
                                 op_types_to_quantize=["MatMul", "Gemm"], reduce_range=True,
                                 use_external_data_format=src.with_name(DATA_FILE).is_file())
        except (OSError, MemoryError):
            raise  # reported as such by the caller
        except Exception as e:  # another library's failure, of whatever type: one line, not its traceback
            raise ExportError(f"int8 quantisation failed: {type(e).__name__}: {e}") from None
        q = onnx.load(str(work))
    if not any(f.domain == schema.DOMAIN for f in q.functions) and any(
            n.domain == schema.DOMAIN for n in q.graph.node):
        q.functions.append(schema.function_proto())
    q.ir_version = min(q.ir_version, IR_VERSION)
    save_model(q, dst)


@dataclass
class ExportResult:
    out: Path
    model_bytes: int
    layout: dict


def is_export(path: Path) -> bool:
    """An earlier export, which may be replaced: its files only (a user's file beside them would be lost) and a
    layout.json of this format."""
    files = {MODEL_FILE, DATA_FILE, LAYOUT_FILE, CONFIG_FILE, TOKENIZER_FILE}
    if not holds_only(path, files, required={MODEL_FILE, LAYOUT_FILE}):
        return False
    try:
        layout = json.loads((path / LAYOUT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(layout, dict) and layout.get("format") == FORMAT


def export(ckpt: str | Path | None, out: str | Path | None = None, dtype: str = "fp32", quantize: str | None = None,
           opset: int = 18, model: TransformerLM | None = None, tokenizer=None, progress: bool = False) -> ExportResult:
    """Write an export directory (model.onnx, layout.json, config.json, tokenizer.model) atomically.

    Either `ckpt` (a checkpoint directory) or `model` (with an optional SentencePiece `tokenizer`) is given.
    """
    from switchhead.model.checkpoint import resolve_checkpoint

    check_options(dtype, quantize, opset)
    if model is not None and ckpt is not None:
        raise ExportError("give a checkpoint directory or a model, not both")
    builtin = model is None and ckpt is None
    if model is None and tokenizer is not None:
        # The checkpoint's own tokenizer is what its ids mean: another one would be exported silently wrong.
        raise ExportError("tokenizer= goes with model=; a checkpoint is exported with its own tokenizer")
    if out is not None:
        out = as_path(out, "the export directory", ExportError)
    if model is None:
        ckpt = resolve_checkpoint(ckpt)
        require_dir(ckpt, "checkpoint directory", ExportError)
        from switchhead.model.checkpoint import load

        model, tokenizer = load(ckpt)
    elif not isinstance(model, TransformerLM):
        raise ExportError(f"export needs a TransformerLM, got {type(model).__name__}")
    cfg = model.config
    check_config(cfg)
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg.vocab_size, error=ExportError)  # load_backend would refuse the export
    if out is None:
        # Never write next to the built-in model: that is inside the installed package.
        if builtin:
            src = Path.cwd() / "switchhead-default"
        else:
            src = Path(ckpt).resolve() if ckpt is not None else Path.cwd() / "model"
        out = src.with_name(f"{src.name}-onnx")
    out = check_output_dir(out, is_export, "a switchhead ONNX export")  # before tracing, which takes a while
    from tqdm import tqdm

    # Export takes from seconds (tiny) to minutes (large models): show which stage it is in.
    # A `with`: a bar left open when a signal stops the export is drawn again at exit, after the CLI's last line.
    with tqdm(total=4 if quantize else 3, desc="export", unit="stage", disable=not progress) as stages:
        stages.set_postfix_str("tracing the decode step")
        proto = export_model(model, dtype, opset)
        stages.update()
        info = layout(cfg, dtype, quantize)
        with atomic_directory(out) as tmp:
            path = tmp / MODEL_FILE
            if quantize == "int8":
                # Inside the export's own temporary directory: a process killed while quantising then leaves one
                # temporary beside the output, which later runs know as such, not a stray directory of its own.
                with tempfile.TemporaryDirectory(dir=tmp, prefix=".fp32-") as work:
                    fp32 = Path(work) / MODEL_FILE
                    stages.set_postfix_str("saving")
                    save_model(proto, fp32)
                    stages.update()
                    stages.set_postfix_str("quantising to int8")
                    quantize_int8(fp32, path)
            else:
                stages.set_postfix_str("saving")
                save_model(proto, path)
            stages.update()
            stages.set_postfix_str("checking the model")
            onnx.checker.check_model(str(path), full_check=True)
            stages.update()
            (tmp / LAYOUT_FILE).write_text(json.dumps(info, indent=2))
            (tmp / CONFIG_FILE).write_text(cfg.to_json())
            if tokenizer is not None:
                (tmp / TOKENIZER_FILE).write_bytes(tokenizer.serialized_model_proto())
            size = model_bytes(path)
    return ExportResult(out, size, info)
