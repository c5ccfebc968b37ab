"""A model's own multi-token-prediction (MTP) layers, shipped in its checkpoint (DeepSeek-V3, GLM-4.5,
ERNIE 4.5, ...), read out of it by transformers' `MtpModel`; and `MtpDepth`, one of them run as a
draft head over a cache of its own.

MTP layer k (DeepSeek-V3 §2.2) reads, at index t, the hidden state of the layer before it (the
target's last, post-norm one for k = 0) and the embedding of token x_{t+k+1}, each RMS-normalised,
projects their concatenation (`eh_proj`), runs one decoder block of the target's own kind, and
scores x_{t+k+2} with the target's LM head after a norm of its own. transformers numbers the
positions of depth k `k + 1` ahead of the target's (`MtpCache`); so do we.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers.modeling_utils import str_to_torch_dtype
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

from ..core.devices import module_device
from ..core.masks import in_attention_format
from ..hub.download import SINGLE_WEIGHTS, ShardIndexError, local_snapshot, weights_files
from ..store.manifest import SAFETENSORS_INDEX, file_stamp
from .eagle import HeadOutput, causal_mask

# Config fields under which checkpoints that transformers does not load MTP for still declare
# such layers (MiMo, Qwen3-Next, ...): named in the error rather than "no MTP layers".
_OTHER_MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")

# What was read of a checkpoint's files (a safetensors header, a shard index), by reader and path,
# with the file's `file_stamp` then: a model's MTP layers are asked about on every `generate` call,
# which reads a file again only once it changed. `clear_read_files` (hf_specdec.clear_cache) forgets.
_READ_FILES: dict[tuple[str, Path], tuple[tuple[int, int, int], Any]] = {}


def mtp_layer_count(target: Any) -> int:
    """How many MTP layers `target`'s config declares for transformers to load (0: none, or an
    architecture transformers loads none for)."""
    return int(getattr(target.config.get_text_config(), "num_mtp_layers", 0) or 0)


def checkpoint_folder(target: Any) -> Path | None:
    """The folder holding `target`'s checkpoint files: the one it was loaded from, or its snapshot in
    the Hub cache; None when there is none here (a model built in memory, or not downloaded)."""
    name = str(getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "") or "")
    return _local_folder(name) if name else None


def _local_folder(name: str) -> Path | None:
    """`name` as a folder here: itself, or a Hub repo id's snapshot in the local Hub cache."""
    if Path(name).is_dir():
        return Path(name)
    try:
        return local_snapshot(name, None)
    except ValueError:  # not a repo id either
        return None


def mtp_weight_keys(target: Any, folder: Path) -> tuple[list[str], str]:
    """The checkpoint keys in `folder`'s safetensors that transformers reads as `target`'s MTP layers,
    and the pattern it looks for (`MtpModel.get_mtp_weights_regex`). Reads the shard index or the
    files' headers only."""
    from transformers.modeling_layers import MtpModel

    pattern = MtpModel.get_mtp_weights_regex(target)
    # The target's own keys that its MTP layers also read (`_keys_shared_with_mtp`) do not make MTP.
    shared = re.compile("|".join(getattr(target, "_keys_shared_with_mtp", None) or ["(?!)"]))
    return [
        k for k in _checkpoint_keys(folder) if pattern.search(k) and not shared.search(k)
    ], pattern.pattern


def _checkpoint_keys(folder: Path) -> list[str]:
    """The weight names in the files of `folder` that loading reads (`weights_files`): the header of
    `model.safetensors`, else the weight map of the shard index (which transformers' MTP loader reads
    keys from); none where the folder has neither. Other safetensors files beside them (an adapter,
    a consolidated copy) are not the model's."""
    files = _weights_files(folder)
    if files == [SINGLE_WEIGHTS]:
        return list(_read_once(folder / SINGLE_WEIGHTS, _header))
    return sorted(_read_once(folder / SAFETENSORS_INDEX, _index)["weight_map"]) if files else []


def _weights_files(folder: Path) -> list[str]:
    """The safetensors files of `folder` that loading reads (`weights_files`).

    Raises:
        ValueError: its shard index names no weights, or files other than safetensors shards.
    """
    present = [name for name in (SINGLE_WEIGHTS, SAFETENSORS_INDEX) if (folder / name).is_file()]
    try:
        return weights_files(present, lambda: _read_once(folder / SAFETENSORS_INDEX, _index))
    except ShardIndexError as err:
        raise ValueError(
            f"The checkpoint in {folder} is not read: its {err} (loading reads {SINGLE_WEIGHTS}, else "
            f"the shards its {SAFETENSORS_INDEX} names). Save or download it again."
        ) from None


def clear_read_files() -> None:
    """Forget the safetensors headers and shard indexes read so far."""
    _READ_FILES.clear()


def _read_once(path: Path, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, read again only once `path` changed since the last time (`file_stamp`)."""
    stamp, key = file_stamp(path), (read.__name__, path)
    known = _READ_FILES.get(key)
    if known is None or known[0] != stamp:
        known = _READ_FILES[key] = (stamp, read(path))
    return known[1]


def _index(index: Path) -> Any:
    return json.loads(index.read_text())


def _header(path: Path) -> dict[str, tuple[list[int], str]]:
    """Each weight of the safetensors file `path`, by name: its shape and dtype name (its header only)."""
    with safe_open(str(path), framework="pt") as f:
        slices = [(key, f.get_slice(key)) for key in f.keys()]  # noqa: SIM118 (a file, not a dict)
        return {key: (weight.get_shape(), weight.get_dtype()) for key, weight in slices}


def checkpoint_model(target: Any) -> Any | None:
    """The model whose own MTP layers `target` (a loaded model, a model folder, or a Hub repo id whose
    snapshot is in the local Hub cache) names: the loaded model itself, or one built from the
    folder's config on the meta device (no weights: what `load_mtp_layers` needs of a model, its
    config, its classes and where its checkpoint is); None where its config declares no MTP layers
    transformers loads, or its checkpoint is not here. Downloads nothing, runs no code (a config
    that needs remote code counts as none)."""
    if hasattr(target, "config"):
        model = target if checkpoint_folder(target) is not None else None
    else:
        model = local_model(str(target))
    return model if model is not None and mtp_layer_count(model) > 0 else None


def local_model(name: str) -> Any | None:
    """The causal LM that `name` (a model folder, or a Hub repo id whose snapshot is in the local Hub
    cache) describes, built on the meta device from its config; None where that config is not here
    or names no causal LM transformers builds. Downloads nothing, runs no code."""
    folder = _local_folder(name)
    return _meta_model(folder) if folder is not None else None


def _meta_model(folder: Path) -> Any | None:
    """The causal LM `folder`'s config.json describes, built on the meta device (its config's name is
    the folder, so `checkpoint_folder` finds the checkpoint)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not (folder / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (ValueError, KeyError, OSError):
        return None
    with torch.device("meta"):
        return cls(config)


def declared_mtp_fields(
    config: Any, fields: tuple[str, ...] = ("num_mtp_layers", *_OTHER_MTP_FIELDS)
) -> list[str]:
    """The `fields` of a model config (its text config) that declare MTP layers, as `config.name=value`."""
    text = config.get_text_config()
    return [f"config.{name}={getattr(text, name)}" for name in fields if getattr(text, name, 0)]


def unloadable_mtp_keys(target: Any, folder: Path) -> list[str]:
    """Checkpoint keys that look like MTP layers of an architecture transformers loads none for
    (`mtp.*`, `model.mtp_layers.*`), or config fields that declare such layers."""
    declared = declared_mtp_fields(target.config, _OTHER_MTP_FIELDS)
    return declared + [k for k in _checkpoint_keys(folder) if re.search(r"(^|\.)mtp", k)][:4]


def load_mtp_layers(target: Any) -> nn.Module:
    """`target`'s MTP layers, read out of its checkpoint by transformers' `MtpModel.from_pretrained`
    (safetensors only), on the device of its last decoder layer, in its dtype. The one rule for
    whether a model drafts with its own MTP layers: `method="mtp"` loads them so, and automatic
    selection asks it too (of a `checkpoint_model` on the meta device, whose layers keep no weights:
    they are loaded from the safetensors headers alone, `_headers_only`, and so checked against the
    checkpoint's names and shapes without a weight read).

    Raises:
        ValueError: the architecture has no MTP layers transformers loads, the model was not loaded
            from a checkpoint, the checkpoint holds no MTP weights (the keys looked for are named)
            or malformed ones, or its MTP layers attend otherwise than to the whole context, or
            through an attention implementation whose masks `MtpDepth` cannot build, or the LM head or
            embedding they share with the model carries a PEFT adapter.
    """
    from transformers.modeling_layers import MtpModel

    kind = type(target).__name__
    folder = checkpoint_folder(target)
    if mtp_layer_count(target) == 0:
        found = unloadable_mtp_keys(target, folder) if folder is not None else []
        holds = f" Its checkpoint declares or holds MTP layers ({', '.join(found)})," if found else ""
        raise ValueError(
            f"method='mtp' drafts with a model's own multi-token-prediction layers, and transformers "
            f"{transformers.__version__} loads none for {kind} (model_type "
            f"{target.config.get_text_config().model_type!r}: its config has no num_mtp_layers).{holds} "
            f"transformers loads MTP layers for: {', '.join(mtp_architectures())}. Use another method "
            "(speculative=True chooses one)."
        )
    if folder is None:
        raise ValueError(
            f"method='mtp' reads the MTP layers out of the {kind}'s checkpoint files, but this model was "
            "not loaded from a folder or a Hub repo found in the local cache (name_or_path "
            f"{getattr(target, 'name_or_path', '')!r}): load it with from_pretrained(folder or repo id)."
        )
    for role, module in (
        ("LM head", target.get_output_embeddings()),
        ("embedding", target.get_input_embeddings()),
    ):
        if type(module).__module__.startswith("peft."):  # MtpModel would look for the wrapper's weights
            raise ValueError(
                f"{kind}'s {role} is wrapped by PEFT ({type(module).__module__}.{type(module).__name__}), "
                "and its MTP layers share it, which transformers' MtpModel does not load around. Merge the "
                "adapter (merge_and_unload()) for method='mtp', or use another method (speculative=True "
                "chooses one)."
            )
    keys, pattern = mtp_weight_keys(target, folder)
    if not keys:
        raise ValueError(
            f"{folder} holds no MTP weights: method='mtp' looked for keys matching {pattern!r} in its "
            f"safetensors ({', '.join(_weights_files(folder)) or 'none'}), "
            f"as its config (num_mtp_layers={mtp_layer_count(target)}) promises. Checkpoints converted or "
            "quantized without their MTP layers have none: use another method (speculative=True chooses one)."
        )
    device, dtype = mtp_placement(target)
    report = _LoadReport()
    reading = _headers_only() if device.type == "meta" else contextlib.nullcontext()
    try:
        with report.listening(), reading:
            mtp = MtpModel.from_pretrained(target, device_map={"": device}, trust_remote_code=False)
    except torch.OutOfMemoryError:
        raise  # the device's state, not the checkpoint's: nothing to remember as why they do not load
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(
            f"The MTP weights in {folder} ({len(keys)} keys matching {pattern!r}, e.g. {keys[0]}) do not "
            f"load as {kind}'s MTP layers: {err}{report.problems()}. The checkpoint's MTP layers do not "
            "match its config: use another method (speculative=True chooses one)."
        ) from None
    # MtpModel reads them in the config's dtype, which `model.to(dtype)` does not update; the
    # embedding and head they share with the model are in the model's.
    mtp.layers.to(dtype)
    if mtp.use_shared_post_norm:
        mtp.shared_post_norm.to(dtype)
    check_attention(mtp)
    layer_types = set(getattr(mtp.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"{kind}'s MTP layers attend as {sorted(layer_types)}; method='mtp' drafts with MTP layers of "
            "full attention only (their cache is rolled back after a rejected draft)."
        )
    return mtp.eval()


# `MtpModel.from_pretrained` takes no headers in place of files, and a second loader of ours would
# drift from its renamings and checks: `_headers_only` swaps the opener it reads files through, one
# such load at a time.
_HEADERS_ONLY = threading.Lock()


@contextlib.contextmanager
def _headers_only() -> Iterator[None]:
    """While open, `MtpModel.from_pretrained` called on this thread reads each safetensors file's
    header only (`_HeaderOnly`), for layers bound for the meta device, which keep no weights: the
    loader itself then decides whether they load (which keys, renamed how, missing or misshapen,
    with its own messages), and nothing of the weights is read. Loads on other threads read as usual."""
    import transformers.modeling_layers as loader

    with _HEADERS_ONLY:  # the check too: another load's swap is under way until the lock is free
        if getattr(loader, "safe_open", None) is not safe_open:  # a transformers that opens files otherwise
            yield  # reads the weights, as before this
            return
        opener, thread = loader.safe_open, threading.get_ident()

        def open_headers(path: str, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return opener(path, *args, **kwargs)
            return _HeaderOnly(Path(path))

        loader.safe_open = open_headers
        try:
            yield
        finally:
            loader.safe_open = opener


class _HeaderOnly:
    """A safetensors file as `MtpModel.from_pretrained` reads it under `_headers_only`: its keys, and
    each weight a meta tensor of its shape and dtype, from the file's header (`_header`; its dtype
    names as transformers maps them, `str_to_torch_dtype`). A dtype it has no name for is read as the
    loader reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header = _read_once(path, _header)

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, key: str) -> torch.Tensor:
        shape, dtype = self.header[key]
        if dtype in str_to_torch_dtype:
            return torch.empty(shape, dtype=str_to_torch_dtype[dtype], device="meta")
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(key)

    def __exit__(self, *exc: object) -> None:
        return None


def check_attention(mtp: nn.Module) -> str:
    """The attention implementation `mtp`'s layers run (their config's, the model's); ValueError where
    it is not one whose masks `MtpDepth` can build."""
    attention = mtp.config._attn_implementation
    if attention not in ("sdpa", "eager"):
        raise ValueError(
            f"method='mtp' builds the MTP layers' attention masks itself (holes of a batch, trees), "
            f"which needs attn_implementation 'sdpa' or 'eager' (the model has {attention!r}): "
            "load it with attn_implementation='sdpa'."
        )
    return attention


def mtp_placement(target: Any) -> tuple[torch.device, torch.dtype]:
    """The device and dtype `target`'s MTP layers run in: those of its last decoder layer, where
    transformers' `MTPCandidateGenerator` puts them; under a device_map, the device that layer
    computes on (`module_device`: not `meta` where it was offloaded)."""
    last = target.get_decoder().layers[-1]
    return module_device(last), next(last.parameters()).dtype


class _LoadReport(logging.Handler):
    """The load report transformers logs as `MtpModel.from_pretrained` reads the weights: its rows
    name the keys whose shapes did not match, which the error it then raises does not."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += record.getMessage().splitlines()

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        logger = logging.getLogger("transformers.modeling_layers")
        logger.addHandler(self)
        try:
            yield
        finally:
            logger.removeHandler(self)

    def problems(self) -> str:
        rows = [" ".join(line.split()) for line in self.lines if "MISMATCH" in line or "MISSING" in line]
        return "" if not rows else " (" + "; ".join(rows[:6]) + ")"


@functools.cache
def mtp_architectures() -> tuple[str, ...]:
    """The model folders of the installed transformers whose configuration declares `num_mtp_layers`
    (read from the sources, without importing every model)."""
    models = Path(transformers.__file__).parent / "models"
    found = set()
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        source = models / module / f"configuration_{module}.py"
        if source.is_file() and "num_mtp_layers" in source.read_text(errors="ignore"):
            found.add(module)
    return tuple(sorted(found))


class MtpDepth(nn.Module):
    """Depth k of a model's MTP layers as a draft head: `forward(input_ids, features, ...)` over a
    cache (index t reads the hidden state `features[t]` and the token x_{t+k+1} in `input_ids`),
    returning the logits of x_{t+k+2} and the layer's hidden states, which depth k + 1 (or this
    depth again, chaining past the last) reads next.

    The parts are transformers' (`MtpModel.layers[k]`, its rotary and shared head); the masks are
    ours: a ragged batch's holes and a tree's, which `MtpModel.forward_layer` cannot take.

    Each part runs where its weights are: the layer on its own device (`device`, beside the
    target's last decoder layer), the embedding and LM head, which are the target's, on theirs
    (its first and last devices where a device_map split it). Outputs are on `device`.
    """

    # The target's hidden states depth 0 reads: its last, post-norm ones, as transformers'
    # `MTPCandidateGenerator` passes them (`hidden_states[-1]`).
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, mtp: nn.Module, depth: int) -> None:
        super().__init__()
        self.mtp = mtp
        self.depth = depth
        self.config = mtp.config
        self.attention = check_attention(mtp)
        self.device = module_device(mtp.layers[depth])
        self.embed_device = module_device(mtp.embed_tokens)
        self.head_device = module_device(mtp.shared_head)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] x_{t+k+1}
        features: torch.Tensor,  # [B, T, H] the hidden state of the depth before at index t
        attention_mask: torch.Tensor | None = None,  # [B, past + T] 1 on real positions, or a 4D boolean mask
        position_ids: torch.Tensor | None = None,  # [B, T]
        cache: Any = None,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> HeadOutput:
        mtp, device = self.mtp, self.device
        embeds = mtp.embed_tokens(input_ids.to(self.embed_device)).to(device)
        past = cache.get_seq_length(self.depth) if cache is not None else 0
        queries = past + torch.arange(input_ids.shape[1], device=device)
        position_ids = (queries + self.depth + 1)[None] if position_ids is None else position_ids.to(device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        mask = causal_mask(queries, past + input_ids.shape[1], attention_mask)  # [B, T, total]
        mask = in_attention_format(mask, self.attention, embeds.dtype)
        rope = {"layer_type": mtp.config.layer_types[self.depth]} if mtp.has_per_layer_rope else {}
        rotary = None
        if mtp.rotary_emb is not None:  # the target's: under a device_map its hook computes on its device
            rotary = tuple(t.to(device) for t in mtp.rotary_emb(embeds, position_ids=position_ids, **rope))
        hidden = mtp.layers[self.depth](
            embeds,
            features.to(device, embeds.dtype),
            position_embeddings=rotary,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
        )
        if mtp.use_shared_post_norm:
            hidden = mtp.shared_post_norm(hidden)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = mtp._project_to_logits(kept.to(self.head_device)).to(device)
        return HeadOutput(logits=logits, hidden_states=hidden)
