"""Building a head and reading or writing its weights: what our checkpoint format (`checkpoint`) and
the published EAGLE / Medusa layouts (`published`) share.

Our format is a folder with `head_config.json` (the head's config, which names its target) and
`head.safetensors` (the trainable weights and the draft vocabulary; the target's embedding and LM
head are never copied).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.devices import execution_device
from ..hub.download import refetch_advice
from ..store.manifest import MANIFEST_NAME, manifest_problem, write_atomically, write_manifest
from .dflash import BlockDraft, BlockDraftConfig
from .eagle import EagleHead, EagleHeadConfig
from .eagle3 import Eagle3Head
from .medusa import MedusaHead, MedusaHeadConfig

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "head.safetensors"
_BUILT_FROM = {"format": "hf-specdec head"}  # what a head folder's manifest says it holds
VARIANTS = ("eagle", "eagle3")  # EagleHeadConfig.variant: EagleHead, Eagle3Head


def save_head(head: nn.Module, folder: str | Path) -> Path:
    """Write `head` to `folder` in our format; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()}
    metadata = {"format": "pt", "producer": "hf-specdec"}
    write_atomically(folder / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp), metadata=metadata))
    config = json.dumps({"format": "hf-specdec", **head.config.to_dict()}, indent=2)
    write_atomically(folder / CONFIG_NAME, lambda tmp: tmp.write_text(config))
    write_manifest(folder, _BUILT_FROM, files=[CONFIG_NAME, WEIGHTS_NAME])  # last: the folder is complete
    return folder


def check_saved_head(folder: Path) -> None:
    """Refuse a head folder whose files changed since `save_head` wrote them (truncated, overwritten,
    deleted). Folders without a manifest (published heads, heads saved by older versions) pass."""
    if not (folder / MANIFEST_NAME).exists():
        return
    problem = manifest_problem(folder, _BUILT_FROM)
    if problem is not None:
        advice = refetch_advice(
            folder,
            f"delete {folder} and train the head again (`hf-specdec train-draft`), or download it again",
        )
        raise ValueError(f"The draft head in {folder} is corrupt ({problem}): {advice}.")


def head_config(config_cls: type, fields: dict[str, Any], path: Path) -> Any:
    """`config_cls(**fields)` for the head config read from `path`, or an error naming the file."""
    try:
        return config_cls(**fields)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{path} does not describe a valid {config_cls.__name__}: {err} The checkpoint is corrupt or "
            "was not written for hf-specdec: fix the file, or train or download the head again."
        ) from None


def build_head(config: EagleHeadConfig | MedusaHeadConfig | BlockDraftConfig, target: Any) -> nn.Module:
    """A freshly initialised head for `target` (weights in the target's dtype and device).

    An EAGLE config without a context length (`max_position_embeddings` 0, as in heads saved
    before it was recorded) gets the target's.
    """
    if isinstance(config, EagleHeadConfig):
        text = target.config.get_text_config()
        if not config.max_position_embeddings:
            config.max_position_embeddings = int(getattr(text, "max_position_embeddings", 0) or 0)
        if config.variant == "eagle3":
            _check_eagle3_layers(config, text.num_hidden_layers)
            head = Eagle3Head(config, target.get_input_embeddings())
        elif config.variant == "eagle":
            head = EagleHead(config, target.get_input_embeddings(), target.get_output_embeddings())
        else:
            raise ValueError(
                f"Unknown EAGLE head variant {config.variant!r}; expected {' or '.join(VARIANTS)}."
            )
    elif isinstance(config, BlockDraftConfig):
        if not config.max_position_embeddings:
            text = target.config.get_text_config()
            config.max_position_embeddings = int(getattr(text, "max_position_embeddings", 0) or 0)
        head = BlockDraft(config, target.get_input_embeddings(), target.get_output_embeddings())
    else:
        head = MedusaHead(config, target.get_output_embeddings())
    return head.to(device=execution_device(target), dtype=target.dtype)


def _check_eagle3_layers(config: EagleHeadConfig, num_layers: int) -> None:
    layers = config.feature_layers
    if len(set(layers)) != 3 or min(layers) < 0 or max(layers) > num_layers:
        raise ValueError(
            f"The EAGLE-3 head{f' for {config.target}' if config.target else ''} reads target layers "
            f"{list(layers)}, but it needs three distinct ones among this {num_layers}-layer target's "
            f"0..{num_layers} (`output_hidden_states` indices)."
        )


def check_head_matches(config: Any, target: Any, source: Any) -> None:
    """Refuse a head trained for another target, saying which dimension differs (for a block draft,
    also the target layers it reads)."""
    text = target.config.get_text_config()
    trained_for = f" ({config.target})" if config.target else ""
    checks = [("hidden size", config.hidden_size, text.hidden_size)]
    checks.append(("vocabulary size", config.vocab_size, text.vocab_size))
    if config.target_num_layers:
        checks.append(("layer count", config.target_num_layers, text.num_hidden_layers))
    for what, head_value, target_value in checks:
        if head_value != target_value:
            raise ValueError(
                f"The draft head {source!r} was trained for a target{trained_for} with {what} {head_value}, "
                f"but this target ({getattr(target, 'name_or_path', None) or type(target).__name__}) has "
                f"{target_value}. A head only drafts for the model it was trained on: train one with "
                "`hf-specdec train-draft --target <this model>`."
            )
    layers = text.num_hidden_layers
    if isinstance(config, BlockDraftConfig) and max(config.target_layer_ids) >= layers:
        raise ValueError(
            f"The block draft {source} reads target layers {config.target_layer_ids}, but this target has "
            f"{layers} layers (0..{layers - 1}): it was trained for another model."
        )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors or torch file's tensors; a missing or damaged file gets a clear error."""
    if not path.is_file():
        raise ValueError(f"Head weights {path} are missing: the checkpoint is incomplete.")
    with _readable(path):
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)


def weight_names(path: Path) -> list[str]:
    """The tensor names in a safetensors or torch weights file, without reading the tensors (a
    safetensors header; a torch file mapped, unpickled with `weights_only=True`)."""
    with _readable(path):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        try:
            return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        except RuntimeError:  # the legacy (not zip) format cannot be mapped: read it whole
            return list(torch.load(path, map_location="cpu", weights_only=True))


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """A damaged weights file as a clear error."""
    try:
        yield
    except Exception as err:  # safetensors and torch raise many kinds for a damaged file
        advice = refetch_advice(path, "download or train it again")
        raise ValueError(
            f"Head weights {path} cannot be read ({type(err).__name__}: {err}): "
            f"the checkpoint is corrupt; {advice}."
        ) from None


def load_state(head: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Load `state` strictly, naming missing, unexpected and misshapen tensors."""
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(
        f"{name} {tuple(state[name].shape)} (expected {tuple(expected[name].shape)})"
        for name in set(state) & set(expected)
        if state[name].shape != expected[name].shape
    )
    if missing or unexpected or misshapen:
        parts = [
            f"{label}: {', '.join(items[:6])}{' ...' if len(items) > 6 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
            if items
        ]
        raise ValueError(f"Head weights {path} do not fit the head its config describes; " + "; ".join(parts))
    if "draft_vocab" in state:
        check_draft_vocab(state["draft_vocab"], head.config.vocab_size, path)
    head.load_state_dict(state)


def check_draft_vocab(
    vocab: torch.Tensor, vocab_size: int, path: Path, read_from: str = "draft_vocab"
) -> None:
    """Refuse a draft vocabulary (draft index -> target token id, [draft_vocab_size]) that is not
    distinct ids of the target's `vocab_size`: the head's logits are scattered to those ids at every
    step, where an id out of range fails with a bare IndexError and a repeated one drops a logit.
    `read_from`: the tensor of `path` the ids came from, as the error names it."""
    problem = None
    if vocab.dtype.is_floating_point or vocab.dtype == torch.bool or vocab.dim() != 1:
        problem = f"is a {vocab.dtype} tensor of shape {tuple(vocab.shape)}, not a list of token ids"
    elif len(vocab) and (int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size):
        outside = vocab[(vocab < 0) | (vocab >= vocab_size)]
        shown = ", ".join(str(int(i)) for i in outside[:4]) + (" ..." if len(outside) > 4 else "")
        problem = (
            f"maps {len(outside)} of its {len(vocab)} tokens to ids outside this target's vocabulary of "
            f"{vocab_size} (0..{vocab_size - 1}): {shown}"
        )
    elif len(torch.unique(vocab)) != len(vocab):
        repeats = len(vocab) - len(torch.unique(vocab))
        problem = f"gives {repeats} of its {len(vocab)} tokens an id another one already has"
    if problem is not None:
        raise ValueError(
            f"Head weights {path}: the draft vocabulary ({read_from}) {problem}. The head was written for "
            "a target with another vocabulary, or the file is corrupt: train a head for this target "
            "(`hf-specdec train-draft --target <this model>`), or download the head again."
        )
