"""The int8 ONNX copy of a target that `method="quantized"` drafts with, built once and cached."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..store.fingerprint import weights_fingerprint
from ..store.manifest import (
    build_lock,
    manifest_problem,
    remove_stale_staging,
    replace_folder,
    staging_folder,
    write_manifest,
)
from ..store.paths import cache_dir
from .export import export_onnx
from .quantize import INT8_FORMAT

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def quantized_copy(target: PreTrainedModel, tokenizer: Any = None) -> Path:
    """The int8 ONNX copy of `target` under `cache_dir()/onnx/<name>-<dtype>-int8`, exported on first
    use (`copy_name` gives `<name>`). The target's dtype is in the name: a bf16 and an fp32 load of
    one checkpoint have different weights, and each keeps its own copy instead of rebuilding the
    other's. A copy whose files do not match the manifest written with them (truncated,
    overwritten, deleted) is rebuilt."""
    weights = weights_fingerprint(target)  # "<dtype>:<digest>"
    folder = cache_dir() / "onnx" / f"{copy_name(target)}-{weights.split(':')[0]}-int8"
    built_from = {"format": INT8_FORMAT, "weights": weights}
    remove_stale_staging(folder.parent)  # what crashed exports of any model left (GBs for a large one)
    if manifest_problem(folder, built_from) is None:
        return folder
    with build_lock(folder):
        problem = manifest_problem(folder, built_from)
        if problem is None:  # another process built it while this one waited
            return folder
        if folder.exists():
            warnings.warn(f"Rebuilding the int8 ONNX copy in {folder}: {problem}.", stacklevel=5)
        warnings.warn(
            f"Building an int8 ONNX copy of the target in {folder} (once; minutes for a 100M+ model).",
            stacklevel=5,
        )
        with staging_folder(folder.parent) as tmp:  # removes the staging folders of crashed exports
            staging = tmp / "model"
            export_onnx(target, staging, quantize="int8", tokenizer=tokenizer)
            write_manifest(staging, built_from)
            replace_folder(folder, staging)
    return folder


def copy_name(model: PreTrainedModel) -> str:
    """`<basename>-<8 hex digits>`: the last part of the model's Hub id or folder, to read, and a
    digest of the whole id (a folder: its absolute path), so that `org-a/x` and `org-b/x` keep a
    copy each instead of rebuilding one folder at every switch. A model with no id or folder (built
    in code) is named by its class: such models share a copy, rebuilt when the weights differ."""
    source = str(getattr(model, "name_or_path", "") or "")
    if not source:
        return type(model).__name__
    path = Path(source).expanduser()
    identity = str(path.resolve()) if path.exists() else source  # one folder by any relative path
    return f"{path.name}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"
