"""A draft model run by ONNX Runtime: an exported folder (`method="onnx"`), or an int8 copy of the
target itself (`method="quantized"`).

Drafting is the `draft_model` drafter's, token for token; only the forward pass differs. The KV
cache lives in preallocated buffers on the session's device, bound with IO binding so nothing
round-trips through the host per step. The Hub layout concatenates past and new keys into
`present`, so each tensor has two buffers that take turns: past is read from one, present is
written into the other. Holes left by rejected drafts in a batch are masked as in `kv.py`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from .. import onnx as hf_onnx
from . import register_drafter
from .base import options_to_config
from .draft_model import DraftModelDrafter, check_compatible

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_TORCH = {np.float32: torch.float32, np.float16: torch.float16}


@dataclass
class OnnxDraftConfig:
    """Settings of the `onnx` and `quantized` drafters.

    Args:
        provider: "auto" (CUDA when the target is on a GPU and onnxruntime-gpu has it, else CPU),
            "cpu" or "cuda". CUDA without a GPU falls back to CPU with a warning.
        threads: ONNX Runtime intra-op threads on CPU; 0: as many as torch uses
            (`torch.get_num_threads()`), since draft and target take turns on the same cores.
        min_confidence: as for `draft_model`: stop a greedy draft once its confidence drops below.
        tokenizer_verified: skip the tokenizer / vocabulary check.
    """

    provider: str = "auto"
    threads: int = 0
    min_confidence: float = 0.0
    tokenizer_verified: bool = False


class OnnxDecoder:
    """An ONNX Runtime session of a decoder in the Hub layout, and what its inputs look like."""

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
        _, kv_heads, head_dim = hf_onnx.kv_shape(config) if config is not None else (0, None, None)
        self.kv_heads = past.shape[1] if isinstance(past.shape[1], int) else kv_heads
        self.head_dim = past.shape[3] if isinstance(past.shape[3], int) else head_dim
        logits = outputs["logits"].shape[-1]
        self.vocab_size = logits if isinstance(logits, int) else config.get_text_config().vocab_size
        self.has_position_ids = "position_ids" in inputs
        self.has_cache_branch = "use_cache_branch" in inputs  # optimum's merged decoders
        overridable = {i.name for i in session.get_overridable_initializers()}
        self.has_logits_to_keep = hf_onnx.LOGITS_TO_KEEP in overridable | set(inputs)  # our own exports
        if self.kv_heads is None or self.head_dim is None:
            raise ValueError(f"{path}: the KV shape is symbolic and there is no config.json to read it from.")
        self.config = config if config is not None else _vocab_only_config(self.vocab_size)
        self.tokenizer = _read_tokenizer(path)

    @classmethod
    def load(
        cls, folder: str | Path, provider: str = "auto", threads: int = 0, prefer_cuda: bool = False
    ) -> OnnxDecoder:
        threads = threads or torch.get_num_threads()
        model_file = hf_onnx.find_model_file(folder) if Path(folder).is_dir() else None
        stamp = model_file.stat().st_mtime_ns if model_file is not None else 0  # a rebuilt copy reloads
        key = (str(Path(folder).resolve()), stamp, provider, threads, prefer_cuda)
        decoder = _LOADED.pop(key, None) or cls._load(Path(folder), provider, threads, prefer_cuda)
        _LOADED[key] = decoder  # most recently used last
        while len(_LOADED) > _KEEP_LOADED:
            _LOADED.pop(next(iter(_LOADED)))
        return decoder

    @classmethod
    def _load(cls, folder: Path, provider: str, threads: int, prefer_cuda: bool) -> OnnxDecoder:
        ort = hf_onnx.require("onnxruntime")
        if provider not in ("auto", "cpu", "cuda"):
            raise ValueError(f"provider must be 'auto', 'cpu' or 'cuda', got {provider!r}.")
        if not folder.is_dir():
            raise FileNotFoundError(f"ONNX draft folder {folder} does not exist.")
        path = hf_onnx.find_model_file(folder)
        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
        use_cuda = provider == "cuda" or (provider == "auto" and prefer_cuda)
        if use_cuda and not has_cuda:
            if provider == "cuda":
                warnings.warn(
                    "CUDAExecutionProvider was requested but is unavailable (no GPU, or onnxruntime without "
                    "CUDA: pip install 'hf-specdec[onnx-gpu]'); drafting on CPU instead.",
                    stacklevel=5,
                )
            use_cuda = False
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        # ORT's threads spin-wait after each run by default; the target's PyTorch forward runs
        # right after a draft step on the same cores and would be starved of them.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if use_cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            providers = [("CUDAExecutionProvider", {"device_id": device.index}), "CPUExecutionProvider"]
        else:
            device, providers = torch.device("cpu"), ["CPUExecutionProvider"]
        session = ort.InferenceSession(str(path), options, providers=providers)
        return cls(path, session, device)


# Loaded sessions by (folder, provider, threads, prefer_cuda): creating one takes seconds.
_LOADED: dict[tuple, OnnxDecoder] = {}
_KEEP_LOADED = 2


class OrtKV:
    """`kv.RaggedKV` for an ONNX decoder: same interface, KV in IO-bound ping-pong buffers."""

    def __init__(self, decoder: OnnxDecoder, batch_size: int) -> None:
        self.decoder = decoder
        device = decoder.device
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, cache_len]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens per row
        n = 2 * decoder.num_layers
        self.buffers = [[self._alloc(64 * batch_size), self._alloc(64 * batch_size)] for _ in range(n)]
        self.current = 0  # which buffer of each pair holds the cache
        self.logits = torch.empty(0, dtype=decoder.dtype, device=device)
        self.binding = decoder.session.io_binding()
        _, out_names = hf_onnx.io_names(decoder.num_layers)
        in_names, _ = hf_onnx.io_names(decoder.num_layers)
        self.past_names, self.present_names = in_names[3:], out_names[1:]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0) -> SimpleNamespace:
        """Run the decoder on `tokens` [B, T] (only `valid` [B, T] ones are real) and cache them.

        Returns, as `RaggedKV.forward` does, an output whose `.logits` are those of the last
        `logits_to_keep` positions (all if 0), [B, T', V].
        """
        device = self.decoder.device
        tokens, valid = tokens.to(device), valid.to(device)
        positions = (self.lengths[:, None] + valid.cumsum(dim=1) - 1).clamp_min(0)
        past = self.width
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.lengths = self.lengths + valid.sum(dim=1)
        batch, new = tokens.shape
        self._alive: list[torch.Tensor] = []  # ORT holds only pointers to bound tensors
        feeds = {"input_ids": tokens.contiguous(), "attention_mask": self.mask.long()}
        if self.decoder.has_position_ids:
            feeds["position_ids"] = positions.contiguous()
        if self.decoder.has_cache_branch:
            feeds["use_cache_branch"] = torch.ones(1, dtype=torch.bool, device=device)
        for name, tensor in feeds.items():
            self._bind(name, tensor, output=False)
        computed = new  # positions the session computes logits for
        if logits_to_keep and self.decoder.has_logits_to_keep:
            computed = min(logits_to_keep, new)
            # A shape-like input: ONNX Runtime reads it on the host whatever the provider.
            self._bind(hf_onnx.LOGITS_TO_KEEP, torch.tensor([computed]), output=False)
        for i, (past_name, present_name) in enumerate(zip(self.past_names, self.present_names)):
            self._bind(past_name, self._view(i, self.current, past), output=False)
            self._bind(present_name, self._view(i, 1 - self.current, self.width), output=True)
        self._bind("logits", self._logits_view(batch, computed), output=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # torch wrote the inputs
        self.decoder.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()
        self.current = 1 - self.current
        logits = self._logits_view(batch, computed)
        return SimpleNamespace(logits=(logits[:, -logits_to_keep:] if logits_to_keep else logits).clone())

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b; the rest become holes."""
        lengths = lengths.to(self.mask.device)
        self.mask &= self.mask.cumsum(dim=1) <= lengths[:, None]
        self.lengths = self.mask.sum(dim=1)
        self._relayout(torch.arange(self.mask.shape[0], device=self.mask.device))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch), e.g. when others have finished."""
        rows = rows.to(self.mask.device)
        old_batch = self.mask.shape[0]
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]
        self._relayout(rows, old_batch)

    def _relayout(self, rows: torch.Tensor, old_batch: int | None = None) -> None:
        """Copy the kept rows and the used columns into the other buffer of each pair."""
        old_batch = old_batch or self.mask.shape[0]
        old_width = self.width
        used = torch.nonzero(self.mask.any(dim=0))
        width = 0 if used.numel() == 0 else int(used[-1]) + 1
        if width == old_width and len(rows) == old_batch:
            return
        self.mask = self.mask[:, :width]
        for i in range(len(self.buffers)):
            kept = self._view(i, self.current, old_width, batch=old_batch)[rows, :, :width]
            self._view(i, 1 - self.current, width).copy_(kept)
        self.current = 1 - self.current

    def _view(self, i: int, which: int, width: int, batch: int | None = None) -> torch.Tensor:
        """Buffer `which` of KV tensor i as a contiguous [B, kv_heads, width, head_dim], grown if needed."""
        d = self.decoder
        shape = (batch or self.mask.shape[0], d.kv_heads, width, d.head_dim)
        size = int(np.prod(shape))
        if self.buffers[i][which].numel() < size:
            self.buffers[i][which] = self._alloc(max(size, 2 * self.buffers[i][which].numel()))
        return self.buffers[i][which][:size].view(shape)

    def _logits_view(self, batch: int, new: int) -> torch.Tensor:
        size = batch * new * self.decoder.vocab_size
        if self.logits.numel() < size:
            self.logits = torch.empty(size, dtype=self.decoder.dtype, device=self.decoder.device)
        return self.logits[:size].view(batch, new, self.decoder.vocab_size)

    def _alloc(self, rows: int) -> torch.Tensor:
        d = self.decoder
        return torch.empty(rows * d.kv_heads * d.head_dim, dtype=d.dtype, device=d.device)

    def _bind(self, name: str, tensor: torch.Tensor, output: bool) -> None:
        device = tensor.device
        args = (
            name,
            device.type,
            device.index or 0,
            _np_dtype(tensor.dtype),
            list(tensor.shape),
            tensor.data_ptr(),
        )
        if output:
            self.binding.bind_output(*args)
        else:
            self.binding.bind_input(*args)
        self._alive.append(tensor)


def _np_dtype(dtype: torch.dtype) -> Any:
    return {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.int64: np.int64,
        torch.bool: np.bool_,
    }[dtype]


@register_drafter
class OnnxDrafter(DraftModelDrafter):
    """Drafts with an exported decoder folder through ONNX Runtime (`draft=FOLDER`)."""

    name: ClassVar[str] = "onnx"
    supports_sampling: ClassVar[bool] = True

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> OnnxDrafter:
        if not isinstance(config.draft, (str, Path)):
            raise ValueError(
                f"method={cls.name!r} needs draft= a folder exported with `hf-specdec export-onnx` "
                "(holding model.onnx or onnx/model.onnx)."
            )
        options = options_to_config(OnnxDraftConfig, config.options)
        decoder = _load_decoder(config.draft, options, target)
        if not options.tokenizer_verified:
            check_compatible(target, tokenizer, decoder, config.draft_tokenizer or decoder.tokenizer)
        return cls(decoder, options, target.device)

    def _new_kv(self, batch_size: int) -> OrtKV:
        return OrtKV(self.model, batch_size)


@register_drafter
class QuantizedDrafter(OnnxDrafter):
    """Self-drafting: an int8 ONNX copy of the target (weights in blocks of 32), built once and cached."""

    name: ClassVar[str] = "quantized"

    @classmethod
    def from_config(
        cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any
    ) -> QuantizedDrafter:
        options = options_to_config(OnnxDraftConfig, config.options)
        folder = quantized_copy(target, tokenizer)
        return cls(_load_decoder(folder, options, target), options, target.device)


def _load_decoder(folder: str | Path, options: OnnxDraftConfig, target: PreTrainedModel) -> OnnxDecoder:
    return OnnxDecoder.load(
        folder, options.provider, options.threads, prefer_cuda=target.device.type == "cuda"
    )


def quantized_copy(target: PreTrainedModel, tokenizer: Any = None) -> Path:
    """The int8 ONNX copy of `target` under `cache_dir()/onnx/<name>-int8`, exported on first use."""
    from ..models import cache_dir

    name = Path(str(getattr(target, "name_or_path", "") or "")).name or type(target).__name__
    folder = cache_dir() / "onnx" / f"{name}-int8"
    fingerprint = f"{hf_onnx.INT8_FORMAT}:{_fingerprint(target)}"
    stamp = folder / "hf_specdec_fingerprint.txt"
    if stamp.exists() and stamp.read_text() == fingerprint:
        return folder
    if folder.exists():
        warnings.warn(
            f"{folder} holds a copy of another model, or one in an older format; rebuilding it.", stacklevel=5
        )
    warnings.warn(
        f"Building an int8 ONNX copy of the target in {folder} (once; minutes for a 100M+ model).",
        stacklevel=5,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        staging = Path(tmp) / "model"
        hf_onnx.export_onnx(target, staging, quantize="int8", tokenizer=tokenizer)
        (staging / stamp.name).write_text(fingerprint)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)  # atomic: a crash never leaves a half-written cache
    return folder


def _fingerprint(model: PreTrainedModel) -> str:
    """Identifies a model's weights cheaply: a sum and a few values of every tensor, with its shape.

    Not the config: `generate` writes into it (attention implementation, cache flags), which must
    not trigger a rebuild.
    """
    digest = hashlib.sha256(type(model).__name__.encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().flatten()
            summary = torch.cat([flat[:8].float().cpu(), flat.float().sum().cpu()[None]])
            digest.update(f"{name}{tuple(p.shape)}".encode() + summary.numpy().tobytes())
    return digest.hexdigest()


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
    from transformers import AutoConfig

    for folder in (path.parent, path.parent.parent):
        if (folder / "config.json").is_file():
            return AutoConfig.from_pretrained(folder)
    return None


def _read_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    for folder in (path.parent, path.parent.parent):
        if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            try:
                return AutoTokenizer.from_pretrained(folder)
            except (OSError, ValueError, json.JSONDecodeError):
                return None
    return None


def _vocab_only_config(vocab_size: int) -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig(vocab_size=vocab_size)
