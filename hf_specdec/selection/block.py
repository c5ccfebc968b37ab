"""Block drafts for `speculative=`: a published DFlash / DSpark draft trained for the target (one
given as `draft=` is told apart from a draft model by `drafters.kind`).

A block draft the reviewed registry lists for the target's Hub name (`[[head]]` entries of method
`dflash` or `dspark`: each names the exact model it was trained on) is what `speculative=True`
drafts with first: it is trained on that target's own hidden states, where a small model of the
family is not. It is loaded from its safetensors (nothing of its repo runs); one that cannot be
loaded (offline without it, the Hub unreachable, a changed repo) is passed over with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..drafters.dflash import BLOCK_METHODS, load_block_draft
from .choice import OWN_HEAD_METHODS, DraftChoice


def published_block_draft(model: Any, choice: DraftChoice) -> tuple[str, nn.Module, str] | None:
    """(method, loaded draft, why) of the first block draft the registry lists for `model` (in
    `select_draft`'s `choice`), or None; None too where the model drafts with its own heads (its
    MTP layers, its official assistant), which come first."""
    for entry in registry_block_heads(choice):
        try:
            reason = f"{entry['head']}: the registry's {entry['method']} draft trained on {choice.target}"
            return entry["method"], load_block_draft(entry["head"], model), reason
        except (ValueError, OSError) as err:  # the Hub unreachable, offline without it, a bad repo
            warnings.warn(
                f"speculative=True: the published block draft {entry['head']} for {choice.target} could not "
                f"be loaded ({err}); choosing another draft.",
                UserWarning,
                stacklevel=4,
            )
    return None


def registry_block_heads(choice: DraftChoice) -> list[dict[str, Any]]:
    """The registry's block drafts in `select_draft`'s `choice`, best first; none where the model
    drafts with its own heads (its MTP layers, its official assistant), which come first."""
    if choice.method in OWN_HEAD_METHODS:
        return []
    return [entry for entry in choice.heads if entry["method"] in BLOCK_METHODS]
