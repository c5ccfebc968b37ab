"""Loading a draft head from a folder or the Hub: our format (see `io`), or the authors' layouts:
EAGLE and Medusa (via `published`), DFlash, DSpark and MuseGlimmer block drafts (`dflash_published`);
and telling, before loading anything, which of them a folder or a Hub repo holds (`checkpoint_method`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HfHubHTTPError, SafetensorsParsingError
from torch import nn

from ..core.devices import execution_device
from ..hub.config_check import read_json
from ..hub.download import (
    HubFileError,
    HubUnreachable,
    download_repo_files,
    failed_for_now,
    repo_files,
    safetensors_names,
)
from . import TRAINED_METHODS
from .dflash import BlockDraftConfig
from .dflash_published import (
    has_dspark_heads,
    is_block_draft_folder,
    load_block_draft,
    loaded_block_draft,
    loaded_config,
)
from .eagle import EagleHeadConfig
from .io import (
    CONFIG_NAME,
    VARIANTS,
    WEIGHTS_NAME,
    build_head,
    check_head_matches,
    check_saved_head,
    head_config,
    load_state,
    read_weights,
    weight_names,
)
from .medusa import MedusaHeadConfig
from .published import (
    EAGLE_WEIGHTS,
    LAYOUT_METHODS,
    MEDUSA_WEIGHTS,
    load_published,
    published_layout,
    read_json_object,
)

_CONFIGS = {
    "eagle": EagleHeadConfig,
    "medusa": MedusaHeadConfig,
    "mtp": EagleHeadConfig,
    "dflash": BlockDraftConfig,
}


def load_head(source: Any, target: Any, method: str | None = None) -> nn.Module:
    """The head `source` names (a folder, a Hub repo id, or a head module), checked against `target`.

    `method` ("eagle", "medusa", "mtp" or "dflash") is what the caller wants; a head of another kind
    is refused.
    """
    if isinstance(source, nn.Module) and loaded_config(source) is not None:
        head = loaded_block_draft(source, target)  # e.g. transformers' MuseGlimmerAssistantModel
    elif isinstance(source, nn.Module):
        head = source
        if not isinstance(getattr(head, "config", None), tuple(_CONFIGS.values())):
            wanted = f"a {method} head" if method else "a draft head"
            raise ValueError(
                f"{type(head).__name__} is not {wanted}: draft= takes a head hf-specdec built or loaded, "
                "or a head's folder or Hub repo id. Another kind of draft: pass it with method='auto', "
                "which runs a draft by what it is."
            )
    else:
        folder = _local_folder(source)
        if (folder / CONFIG_NAME).is_file():
            head = _load_ours(folder, target)
        elif is_block_draft_folder(folder):
            head = load_block_draft(folder, target)
        else:
            head = load_published(folder, target)
    kind, name = head.config.method, type(source).__name__ if isinstance(source, nn.Module) else str(source)
    if method is not None and kind != method:
        raise ValueError(
            f"{name!r} is a {kind} head, not a {method} head: use SpeculativeConfig(method={kind!r})."
        )
    check_head_matches(head.config, target, name)  # a module's name, not its whole listing
    head = head.to(device=execution_device(target))
    return head if head is source else head.eval()  # a head passed in keeps its mode, as plain's models do


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint as far as its kind is told from it: `folder` holds its JSON files (a Hub repo's
    snapshot, no more), `names` all its files, `tensor_names(file)` the tensors one of its weights
    files holds; `commit`, the Hub commit they are of (None: a folder, or the Hub cache's copy)."""

    folder: Path
    names: frozenset[str]
    tensor_names: Callable[[str], Collection[str]]
    commit: str | None = None


def checkpoint_method(files: CheckpointFiles) -> str | None:
    """The method of the head or block draft `files` hold, told as `load_head` tells which loader
    reads them (in its order): ours, the method its config names; a block draft's layout, "dflash"
    or "dspark"; an EAGLE or Medusa layout of the authors', "eagle" or "medusa"
    (`published_layout`); None for none of them (a draft model's checkpoint, say)."""
    folder = files.folder
    if CONFIG_NAME in files.names:
        method = read_json_object(folder / CONFIG_NAME).get("method")
        return method if method in TRAINED_METHODS else None
    if is_block_draft_folder(folder):
        return "dspark" if has_dspark_heads(folder) else "dflash"
    # One that cannot be read (not JSON, too large) tells nothing: the loader asked next says why.
    config = read_json(folder / "config.json")[0] if "config.json" in files.names else None
    config = config if isinstance(config, dict) else None
    return LAYOUT_METHODS.get(published_layout(files.names, config, files.tensor_names))


def folder_files(folder: Path) -> CheckpointFiles:
    """A local folder's files, its weights' tensor names read from their headers."""
    names = frozenset(path.name for path in folder.iterdir())
    return CheckpointFiles(folder, names, lambda name: weight_names(folder / name))


def hub_files(repo_id: str) -> CheckpointFiles | None:
    """A Hub repo's files at the commit `main` is at: its listing, its JSON files (downloaded into the
    Hub cache) and the tensor names in its safetensors headers (range requests; the tensors are not
    downloaded). Offline, or where the Hub cannot be reached, what the Hub cache holds of it; None
    where the repo cannot be had (the loader asked next says why). Those of a pickled weights file
    (`pytorch_model.bin`) are not read: its kind is not told. `tensor_names` raises a `HubFileError`
    (not `lasting`) where the Hub failed to give a header for now (`failed_for_now`)."""
    try:
        files = repo_files(repo_id, lambda name: name in ("config.json", CONFIG_NAME), what="draft")
    except HubFileError:
        return None

    def tensor_names(name: str) -> Collection[str]:
        if not name.endswith(".safetensors"):  # a pickle, cached or not: the same answer either way
            return ()
        if (files.folder / name).is_file():  # the Hub cache's copy
            return weight_names(files.folder / name)
        if files.commit is None:  # offline, not cached
            return ()
        try:
            return safetensors_names(repo_id, name, commit=files.commit)
        except (HfHubHTTPError, HubUnreachable, SafetensorsParsingError) as err:
            if failed_for_now(err):  # no answer: nothing is told of the file, not even "no head"
                raise HubFileError(
                    f"The Hub failed to give {name}'s header of {repo_id} for now: {err}", lasting=False
                ) from err
            return ()  # not told: taken for a draft model, whose loading says what is wrong

    return CheckpointFiles(files.folder, files.names, tensor_names, files.commit)


def _load_ours(folder: Path, target: Any) -> nn.Module:
    try:
        raw = json.loads((folder / CONFIG_NAME).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{folder / CONFIG_NAME} is not valid JSON ({err.msg}): the checkpoint is corrupt."
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{folder / CONFIG_NAME} holds {json.dumps(raw)[:40]}, not a head config (a JSON object): "
            "the checkpoint is corrupt; train or download the head again."
        )
    raw.pop("format", None)
    method = raw.get("method")
    if method not in _CONFIGS:
        raise ValueError(
            f"{folder / CONFIG_NAME}: unknown head method {method!r}; expected {', '.join(_CONFIGS)}."
        )
    config = head_config(_CONFIGS[method], raw, folder / CONFIG_NAME)
    if getattr(config, "variant", "eagle") not in VARIANTS:
        raise ValueError(
            f"{folder / CONFIG_NAME}: unknown EAGLE head variant {config.variant!r}; "
            f"expected {' or '.join(VARIANTS)}."
        )
    check_head_matches(config, target, str(folder))
    state = read_weights(folder / WEIGHTS_NAME)
    check_saved_head(folder)  # what still parses may have changed since it was saved
    head = build_head(config, target)
    vocab = state.get("draft_vocab")
    if vocab is not None and vocab.shape != head.draft_vocab.shape and hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(vocab)  # a config that does not record its size (Eagle3Head's is its lm_head's)
    load_state(head, state, folder / WEIGHTS_NAME)
    return head


def _local_folder(source: Any) -> Path:
    """`source` as a local folder: itself, or its Hub snapshot (endpoint and cache read now)."""
    path = Path(str(source)).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(source).startswith((".", "/", "~")):
        raise ValueError(f"Draft head {source!r} is not a folder.")
    # Pickled weights (EAGLE's, Medusa's) are read with `torch.load(weights_only=True)`: no code runs.
    return download_repo_files(str(source), _is_head_file, what="draft head")


_PICKLED_WEIGHTS = frozenset(
    name for name in (*EAGLE_WEIGHTS, *MEDUSA_WEIGHTS) if not name.endswith(".safetensors")
)


def _is_head_file(name: str) -> bool:
    # Every layout read keeps its files at the repo's top level; a folder `train-draft` wrote, pushed
    # whole, also holds its training data and checkpoint (`data/`, `checkpoint/`), gigabytes unread.
    # Of the pickles, only the weights files a layout reads: a trainer's output pushed whole also
    # holds `optimizer.pt` (twice the head's size), `training_args.bin` and the like, never read.
    return "/" not in name and (name.endswith((".json", ".safetensors")) or name in _PICKLED_WEIGHTS)
