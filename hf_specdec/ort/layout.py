"""The Hub's ONNX decoder layout (optimum / transformers.js, onnx-community repos): where the file
lies, what its inputs and outputs are called, and the optional dependencies that read it.

Inputs `input_ids`, `attention_mask` (2-D, over past + new positions), `position_ids` and
`past_key_values.{i}.key|value` [batch, kv_heads, past, head_dim]; outputs `logits` and
`present.{i}.key|value` [batch, kv_heads, past + new, head_dim]. Our exports add an optional
`num_logits_to_keep` (see `graph.add_logits_to_keep`) and, for models whose layers all attend to
the whole context, an optional `tree_attention_mask` (see `graph.add_tree_mask_default`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'hf-specdec[onnx]'  (or: pip install onnxruntime onnx onnxscript)"
MODEL_FILES = ("model.onnx", "onnx/model.onnx")  # flat folders, and onnx-community repos
LOGITS_TO_KEEP = "num_logits_to_keep"
TREE_MASK = "tree_attention_mask"


def require(module: str = "onnxruntime") -> Any:
    """Import an optional ONNX dependency, or fail with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"The ONNX features of hf-specdec need `{module}`: {INSTALL_HINT}") from err


def find_model_file(folder: str | Path) -> Path:
    """The decoder file in an exported folder: `model.onnx` or `onnx/model.onnx`."""
    folder = Path(folder)
    for name in MODEL_FILES:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"No ONNX decoder in {folder}: expected {' or '.join(MODEL_FILES)}.")


def is_onnx_folder(path: Any) -> bool:
    """A local folder with an ONNX decoder and no PyTorch weights (so only ONNX can load it)."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return False
    folder = Path(path)
    has_torch = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    return not has_torch and any((folder / name).is_file() for name in MODEL_FILES)


def io_names(num_layers: int, tree_mask: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names of the Hub decoder layout (with `TREE_MASK` last where asked)."""
    kv = [(i, part) for i in range(num_layers) for part in ("key", "value")]
    inputs = ["input_ids", "attention_mask", "position_ids"]
    inputs += [f"past_key_values.{i}.{part}" for i, part in kv]
    inputs += [TREE_MASK] if tree_mask else []
    outputs = ["logits"] + [f"present.{i}.{part}" for i, part in kv]
    return inputs, outputs


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim
