"""ONNX Runtime: export a model in the Hub's ONNX decoder layout, quantize it, and run it with its KV
cache in IO-bound buffers. onnxruntime (and onnx, onnxscript for exporting) are optional:
`pip install 'hf-specdec[onnx]'`; they are imported when first used.

`layout` the file and tensor names; `export` torch -> ONNX with a parity check; `graph` surgery on
the exported graph; `quantize` int8 weights; `session` loaded decoders; `kv` their IO-bound KV
cache; `cache` the int8 copy of a target that `method="quantized"` drafts with.
"""

from __future__ import annotations

from .export import ExportReport, export_onnx, export_onnx_report
from .layout import INSTALL_HINT, find_model_file, is_onnx_folder
from .quantize import quantize_int8

__all__ = [
    "INSTALL_HINT",
    "ExportReport",
    "export_onnx",
    "export_onnx_report",
    "find_model_file",
    "is_onnx_folder",
    "quantize_int8",
]
