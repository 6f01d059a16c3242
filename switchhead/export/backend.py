"""`OnnxBackend`: the runtime's `Backend` over an exported directory, run by ONNX Runtime.

Only the logits computation differs from `TorchBackend`: the engine, the XL cache, sampling and stopping are
the runtime's own. Each step feeds the cache's whole 2T-slot window as the past (``plan.past_valid`` hides the
slots that are empty or about to be overwritten), the step's tokens with ``plan.pos_q`` / ``plan.new_mask``, and
writes ``present.*`` (this step's keys/values) back with ``cache.write``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from switchhead.devices import check_threads
from switchhead.errors import SwitchheadError, brief
from switchhead.export import exporter, schema
from switchhead.export.exporter import CONFIG_FILE, FORMAT, LAYOUT_FILE, MODEL_FILE, TOKENIZER_FILE, layout
from switchhead.fileio import as_path, read_utf8, require_dir
from switchhead.model.checkpoint import read_config, read_tokenizer
from switchhead.runtime.backends import Backend
from switchhead.runtime.cache import XLCache

PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)", "bool": "tensor(bool)"}


def _session(path: Path, providers: list[str] | None, threads: int | None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if providers is None:
        providers = [p for p in PROVIDERS if p in ort.get_available_providers()]
    # A GPU build of onnxruntime lists the CUDA EP even on machines without CUDA libraries, logs an error when
    # it cannot load it and falls back to the CPU EP; that fallback is expected here, so keep it quiet.
    quiet = "CUDAExecutionProvider" in providers
    if quiet:
        ort.set_default_logger_severity(4)
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types; report them as a user error
        raise SwitchheadError(f"ONNX Runtime cannot load {path}: {e}") from None
    finally:
        if quiet:
            ort.set_default_logger_severity(2)


class OnnxBackend(Backend):
    """Runs an export directory (see docs/EXPORT.md) with ONNX Runtime: CUDA EP when available, else CPU."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        path = as_path(path, "the ONNX export directory")
        if threads is not None:
            check_threads(threads)
        _check_providers(providers)
        if not (path / LAYOUT_FILE).is_file() or not (path / MODEL_FILE).is_file():
            raise SwitchheadError(f"{path} is not a switchhead ONNX export (needs {MODEL_FILE} and {LAYOUT_FILE})")
        self.layout = _json_object(path / LAYOUT_FILE)
        if self.layout.get("format") != FORMAT:
            raise SwitchheadError(f"{path}: unsupported export format {self.layout.get('format')!r}, "
                                  f"expected {FORMAT!r}")
        if not (path / CONFIG_FILE).is_file():
            raise SwitchheadError(f"{path} is not a complete switchhead ONNX export: {CONFIG_FILE} is missing")
        self.config = read_config(path / CONFIG_FILE)
        dtype, quantize = self.layout.get("dtype"), self.layout.get("quantize")
        if not isinstance(dtype, str) or dtype not in exporter.DTYPES:
            raise SwitchheadError(f"{path}: {LAYOUT_FILE} has dtype {brief(dtype)}; an export's dtype is one of "
                                  f"{', '.join(exporter.DTYPES)}")
        if quantize is not None and (not isinstance(quantize, str) or quantize not in exporter.QUANTIZE):
            raise SwitchheadError(f"{path}: {LAYOUT_FILE} has quantize {brief(quantize)}; an export's quantize is "
                                  f"null or one of {', '.join(exporter.QUANTIZE)}")
        if quantize is not None and dtype != "fp32":
            raise SwitchheadError(f"{path}: {LAYOUT_FILE} has quantize {quantize!r} with dtype {dtype!r}; only fp32 "
                                  "exports are quantised")
        want = layout(self.config, dtype, quantize)
        fixed, derived = _facts(want)
        if diff := _diff(self.layout, fixed):
            field, have, expected = diff
            raise SwitchheadError(f"{path}: {LAYOUT_FILE} {field} is {have}, but a {FORMAT} export has {expected}")
        schema.register_schema()
        self.session = _session(path / MODEL_FILE, providers, threads)
        if mismatch := _interface_mismatch(self.session, want):
            raise SwitchheadError(f"{path}: {MODEL_FILE} {mismatch}, so {CONFIG_FILE} and {LAYOUT_FILE} do not "
                                  f"belong to it")
        # The runtime sizes and rolls its cache by config.json alone, so a layout that disagrees with it (an
        # edited chunk_len or mem_chunks, or files of two exports) would run the graph with the wrong window.
        if diff := _diff(self.layout, derived):
            field, have, expected = diff
            raise SwitchheadError(f"{path}: {LAYOUT_FILE} {field} is {have}, but {CONFIG_FILE} gives {expected}, "
                                  "so the two do not belong together")
        self.providers = self.session.get_providers()
        self.device = torch.device("cpu")
        self.dtype = exporter.DTYPES[dtype]
        self.tokenizer = read_tokenizer(path / TOKENIZER_FILE, self.config)
        n = self.config.n_layers
        self._past = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(n)]
        self._outputs = ["logits"] + [f"present.{i}.{kind}" for i in range(n) for kind in ("key", "value")]

    @property
    def chunk_len(self) -> int:
        return self.config.chunk_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, ids: Tensor, cache: XLCache) -> Tensor:
        plan = cache.plan if isinstance(cache, XLCache) else None
        if plan is None:
            raise SwitchheadError("OnnxBackend.forward needs an XLCache inside a step: call cache.begin(counts) "
                                  "first (see engine.feed)")
        feeds = {
            "input_ids": _np(ids.long()),
            "position_ids": _np(plan.pos_q),
            "attention_mask": _np(plan.new_mask),
            "past_position_ids": _np(plan.pos_k),
            "past_attention_mask": _np(plan.past_valid),
        }
        for i, (kname, vname) in enumerate(self._past):
            k, v = cache.window(i)
            feeds[kname], feeds[vname] = _np(k), _np(v)
        out = self.session.run(self._outputs, feeds)
        for i in range(self.config.n_layers):
            cache.write(i, torch.from_numpy(out[1 + 2 * i]), torch.from_numpy(out[2 + 2 * i]))
        return torch.from_numpy(out[0])


def _json_object(path: Path) -> dict:
    text = read_utf8(path)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise SwitchheadError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise SwitchheadError(f"{path} is not a JSON object")
    return d


def _facts(want: dict) -> tuple[dict, dict]:
    """The checkable parts of a `layout()`: those fixed by the format, and those derived from the config (the
    rest is prose for readers)."""
    fixed = {"model_file": want["model_file"], "opset": want["opset"], "dynamic_axes": want["dynamic_axes"],
             "custom_ops": [{k: op[k] for k in ("domain", "version", "name")} for op in want["custom_ops"]]}
    derived = {"memory": {k: v for k, v in want["memory"].items() if not isinstance(v, str)},
               **{kind: [{k: io[k] for k in ("name", "dtype", "shape")} for io in want[kind]]
                  for kind in ("inputs", "outputs")}}
    return fixed, derived


_MISSING = object()


def _diff(have, want, field: str = "") -> tuple[str, str, str] | None:
    """The first place (dotted field, what `have` and `want` hold there, for a message) where `have` lacks or differs
    from `want`; keys `want` does not have are not compared."""
    if isinstance(want, dict) and isinstance(have, dict):
        for key, value in want.items():
            if diff := _diff(have.get(key, _MISSING), value, f"{field}.{key}" if field else key):
                return diff
        return None
    if isinstance(want, list) and isinstance(have, list) and len(have) == len(want):
        for i, (h, w) in enumerate(zip(have, want)):
            if diff := _diff(h, w, f"{field}[{i}]"):
                return diff
        return None
    if type(have) is type(want) and have == want and not isinstance(want, (dict, list)):
        return None
    return field, "missing" if have is _MISSING else brief(have), brief(want)


def _interface_mismatch(session, want: dict) -> str | None:
    """How the graph's inputs and outputs differ from those config.json and layout.json describe (None: they
    agree). The backend feeds and reads the graph by those files, so a graph from another model would fail
    mid-generation, or run with the wrong memory layout."""
    for kind, have, specs in (("input", session.get_inputs(), want["inputs"]),
                              ("output", session.get_outputs(), want["outputs"])):
        have = {io.name: io for io in have}
        if extra := sorted(set(have) - {spec["name"] for spec in specs}):
            return f"has the unexpected {kind} {extra[0]}"
        for spec in specs:
            io, dtype = have.get(spec["name"]), ORT_TYPES[spec["dtype"]]
            if io is None:
                return f"has no {kind} {spec['name']}"
            if io.type != dtype:
                return f"{kind} {spec['name']} is {io.type}, expected {dtype}"
            if len(io.shape) != len(spec["shape"]) or any(
                    isinstance(w, int) and g != w for w, g in zip(spec["shape"], io.shape)):
                return f"{kind} {spec['name']} has shape {io.shape}, expected {spec['shape']}"
    return None


def _np(t: Tensor) -> np.ndarray:
    # numpy views share memory with CPU tensors, so the cache window is not copied here.
    return t.detach().cpu().contiguous().numpy()


def load_backend(path: str | Path, providers: list[str] | None = None, threads: int | None = None) -> OnnxBackend:
    """The backend for ``switchhead generate --onnx DIR`` (the tokenizer is ``backend.tokenizer``)."""
    require_dir(as_path(path, "the ONNX export directory"), "ONNX export directory")
    return OnnxBackend(path, providers, threads)


def _check_providers(providers: object) -> None:
    """None or known execution providers: ONNX Runtime itself falls back to the CPU for a misspelt or
    unavailable one, after printing a banner, so a user asking for CUDA could silently get the CPU."""
    if providers is None:
        return
    import onnxruntime as ort

    available = ort.get_available_providers()
    if isinstance(providers, str) or not isinstance(providers, (list, tuple)) or not providers:
        raise SwitchheadError(f"providers must be a non-empty list of ONNX Runtime execution providers (available "
                              f"here: {', '.join(available)}), got {brief(providers)}")
    names = [p[0] if isinstance(p, tuple) and p else p for p in providers]  # (name, options) pairs too
    if bad := next((p for p in names if not isinstance(p, str) or p not in available), None):
        raise SwitchheadError(f"execution provider {brief(bad)} is not available in this onnxruntime (available: "
                              f"{', '.join(available)})")
