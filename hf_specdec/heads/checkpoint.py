"""Loading a draft head from a folder or the Hub: our format (see `io`), or the authors' layouts:
EAGLE and Medusa (via `published`), DFlash, DSpark and MuseGlimmer block drafts (`dflash_published`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..core.devices import execution_device
from ..hub.download import download_repo_files
from .dflash import BlockDraftConfig
from .dflash_published import is_block_draft_folder, load_block_draft
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
)
from .medusa import MedusaHeadConfig
from .published import load_published

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
    if isinstance(source, nn.Module):
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
    return head.to(device=execution_device(target)).eval()


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
    # Pickles (.bin, .pt) are read with `torch.load(weights_only=True)`, which runs no code.
    return download_repo_files(str(source), _is_head_file, what="draft head")


def _is_head_file(name: str) -> bool:
    return name.endswith((".json", ".safetensors", ".bin", ".pt"))
