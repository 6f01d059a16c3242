"""ONNX export of switchhead models and an ONNX Runtime backend for the generation engine (docs/EXPORT.md)."""

from switchhead.export.backend import OnnxBackend, load_backend
from switchhead.export.exporter import ExportError, export, export_model

__all__ = ["ExportError", "OnnxBackend", "export", "export_model", "load_backend"]
