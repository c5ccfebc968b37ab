"""ONNX Runtime sessions of exported decoders, loaded once and kept while they are used."""

from __future__ import annotations

import functools
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from ..hub.tokenizer_files import saved_tokenizer
from .kv import OrtKV
from .layout import LOGITS_TO_KEEP, TREE_MASK, find_model_file, kv_shape, require

PROVIDERS = ("auto", "cpu", "cuda")  # what `provider=` may name
_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_TORCH = {np.float32: torch.float32, np.float16: torch.float16}


class OnnxDecoder:
    """An ONNX Runtime session of a decoder in the Hub layout, and what its inputs look like; a
    `drafters.decoder.DraftDecoder` (its cache: `new_cache`)."""

    def __init__(self, path: Path, session: Any, device: torch.device) -> None:
        self.path = path
        self.session = session
        self.device = device  # where the KV buffers and IO-bound tensors live
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        self.num_layers = sum(
            1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key")
        )
        _check_layout(path, inputs, outputs, self.num_layers)
        past = inputs["past_key_values.0.key"]
        self.np_dtype = _NUMPY[past.type]
        self.dtype = _TORCH[self.np_dtype]
        config = _read_config(path)
        _, kv_heads, head_dim = kv_shape(config) if config is not None else (0, None, None)
        self.kv_heads = past.shape[1] if isinstance(past.shape[1], int) else kv_heads
        self.head_dim = past.shape[3] if isinstance(past.shape[3], int) else head_dim
        logits = outputs["logits"].shape[-1]
        self.vocab_size = logits if isinstance(logits, int) else config.get_text_config().vocab_size
        self.has_position_ids = "position_ids" in inputs
        self.has_cache_branch = "use_cache_branch" in inputs  # optimum's merged decoders
        overridable = {i.name for i in session.get_overridable_initializers()}
        self.has_logits_to_keep = LOGITS_TO_KEEP in overridable | set(inputs)  # our own exports
        # Ours, of full-attention models; optional once `graph.add_tree_mask_default` gave it a default.
        self.has_tree_mask = TREE_MASK in overridable
        if self.kv_heads is None or self.head_dim is None:
            raise ValueError(f"{path}: the KV shape is symbolic and there is no config.json to read it from.")
        self.config = config if config is not None else _vocab_only_config(self.vocab_size)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer saved beside the export, or None where there is none; read when first asked
        for, so that a `draft_tokenizer=` given in its place spares reading damaged files.

        Raises:
            ValueError: tokenizer files are there but do not load.
        """
        return _read_tokenizer(self.path)

    def new_cache(self, batch_size: int) -> OrtKV:
        """An empty KV cache for `batch_size` rows, in IO-bound buffers on this session's device."""
        return OrtKV(self, batch_size)

    @classmethod
    def load(
        cls,
        folder: str | Path,
        provider: str = "auto",
        threads: int = 0,
        target_device: torch.device | str = "cpu",
    ) -> OnnxDecoder:
        """The session of `folder`'s decoder for a target on `target_device` (see `placement`),
        loaded once and kept while it is used."""
        threads = threads or torch.get_num_threads()
        target_device = torch.device(target_device)
        model_file = find_model_file(folder) if Path(folder).is_dir() else None
        stamp = model_file.stat().st_mtime_ns if model_file is not None else 0  # a rebuilt copy reloads
        key = (str(Path(folder).resolve()), stamp, provider, threads, str(target_device))
        with _LOADING:  # threads starting on one draft at once share its session
            decoder = _LOADED.pop(key, None) or cls._load(Path(folder), provider, threads, target_device)
            _LOADED[key] = decoder  # most recently used last
            while len(_LOADED) > _KEEP_LOADED:
                _LOADED.pop(next(iter(_LOADED)))
        return decoder

    @classmethod
    def _load(cls, folder: Path, provider: str, threads: int, target_device: torch.device) -> OnnxDecoder:
        ort = require("onnxruntime")
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(map(repr, PROVIDERS))}, got {provider!r}.")
        if not folder.is_dir():
            raise FileNotFoundError(f"ONNX draft folder {folder} does not exist.")
        path = find_model_file(folder)
        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
        if provider == "cuda" and not has_cuda:
            warnings.warn(
                "CUDAExecutionProvider was requested but is unavailable (no GPU, or onnxruntime without "
                "CUDA: pip install 'hf-specdec[onnx-gpu]'); drafting on CPU instead.",
                stacklevel=5,
            )
        default_gpu = torch.cuda.current_device() if has_cuda else 0
        device, providers = placement(provider, target_device, has_cuda, default_gpu)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        # ORT's threads spin-wait after each run by default; the target's PyTorch forward runs
        # right after a draft step on the same cores and would be starved of them.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        state = ort.capi.onnxruntime_pybind11_state
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except (state.InvalidProtobuf, state.InvalidGraph, state.InvalidArgument) as err:
            # What ONNX Runtime says of a truncated or overwritten file, or of a graph newer than it
            # reads; its own message names no remedy.
            raise ValueError(
                f"{path} is not a model ONNX Runtime can load ({type(err).__name__}: {err}); it may be "
                "truncated or damaged, or exported for a newer onnxruntime. Export the draft again "
                "(`hf-specdec export-onnx MODEL FOLDER`, then pass that folder), or download it again."
            ) from err
        return cls(path, session, device)


def placement(
    provider: str, target_device: torch.device, has_cuda: bool, default_gpu: int = 0
) -> tuple[torch.device, list[Any]]:
    """Where a session for a target on `target_device` runs, and the providers it is created with.

    CUDA (with `provider="cuda"`, or `"auto"` for a target on a GPU) goes on the target's own GPU:
    a target on cuda:1 gets `device_id` 1, and the KV buffers and IO-bound tensors live there too.
    A target off the GPU with `provider="cuda"` gets GPU `default_gpu` (torch's current device).
    Without a usable CUDA provider (`has_cuda` false) or with `"cpu"`, the session runs on the CPU;
    the drafter then moves its logits to the target's device.
    """
    use_cuda = has_cuda and (provider == "cuda" or (provider == "auto" and target_device.type == "cuda"))
    if not use_cuda:
        return torch.device("cpu"), ["CPUExecutionProvider"]
    on_target = target_device.type == "cuda" and target_device.index is not None
    device = torch.device("cuda", target_device.index if on_target else default_gpu)
    return device, [("CUDAExecutionProvider", {"device_id": device.index}), "CPUExecutionProvider"]


# Loaded sessions by (folder, provider, threads, target device): creating one takes seconds.
# `clear_loaded()` (called by `hf_specdec.clear_cache()`) frees them.
_LOADED: dict[tuple, OnnxDecoder] = {}
_KEEP_LOADED = 2
_LOADING = threading.Lock()  # held while a session loads: seconds, once a process


def clear_loaded() -> None:
    """Forget the sessions `OnnxDecoder.load` keeps loaded (a session frees its device memory once
    no drafter uses it either)."""
    _LOADED.clear()


def _check_layout(path: Path, inputs: dict[str, Any], outputs: dict[str, Any], num_layers: int) -> None:
    """Refuse a model that is not a decoder with past in the Hub layout, naming what is missing."""
    want_in = ["input_ids", "attention_mask"] + [
        f"past_key_values.{i}.{part}" for i in range(max(num_layers, 1)) for part in ("key", "value")
    ]
    want_out = ["logits"] + [
        f"present.{i}.{part}" for i in range(max(num_layers, 1)) for part in ("key", "value")
    ]
    missing_in = [n for n in want_in if n not in inputs]
    missing_out = [n for n in want_out if n not in outputs]
    if missing_in or missing_out:
        raise ValueError(
            f"{path} is not a decoder with past in the Hub's ONNX layout. "
            f"Missing inputs: {_short(missing_in)}; missing outputs: {_short(missing_out)}. "
            f"It has inputs {_short(list(inputs))} and outputs {_short(list(outputs))}. "
            "Export one with `hf-specdec export-onnx MODEL OUT`."
        )
    past = inputs["past_key_values.0.key"]
    if past.type not in _NUMPY or len(past.shape) != 4:
        raise ValueError(f"{path}: past_key_values must be float/float16 [batch, heads, past, head_dim].")


def _short(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_config(path: Path) -> Any:
    for folder in (path.parent, path.parent.parent):
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(folder, trust_remote_code=False)  # only its sizes are read
    return None


def _read_tokenizer(path: Path) -> Any:
    for folder in (path.parent, path.parent.parent):
        if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            remedy = "export it again, or pass its tokenizer as draft_tokenizer="
            return saved_tokenizer(folder, f"The ONNX draft {folder}", trust_remote_code=False, remedy=remedy)
    return None


def _vocab_only_config(vocab_size: int) -> Any:
    return PretrainedConfig(vocab_size=vocab_size)
