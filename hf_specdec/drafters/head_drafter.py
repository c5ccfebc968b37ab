"""What the head drafters (EAGLE, Medusa) share: their settings, finding their head, and scattering a
head's draft-vocabulary logits into the full vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.fields import check_fields
from ..heads.layers import is_whole_vocab


@dataclass
class HeadDrafterConfig:
    """Settings of the `eagle` and `medusa` drafters.

    Args:
        min_confidence: stop a greedy draft once the head's probability of its next token falls
            below this; 0 leaves the cut to the draft-length policy.
        tree_top_k: with `SpeculativeConfig(tree=...)`: for `eagle`, the children drafted per
            expanded node and the nodes expanded per level (EAGLE-2's top-k); for `medusa`, the
            guesses per head whose combinations make the tree (Medusa's top-k per head).
    """

    min_confidence: float = 0.0
    tree_top_k: int = 4

    def __post_init__(self) -> None:
        check_fields(self, ranges={"min_confidence": (0, 1), "tree_top_k": (1, None)})


def full_vocab_logits(logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [B, draft_vocab] scattered into [B, vocab_size]; tokens outside the subset get -inf,
    so the draft never proposes them and its sampling distribution gives them probability 0."""
    if logits.shape[-1] == vocab_size and is_whole_vocab(draft_vocab, vocab_size):
        return logits
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, draft_vocab.to(logits.device), logits)


def head_source(config: Any, method: str) -> Any:
    if config.draft is None:
        raise ValueError(
            f"method={method!r} needs a trained head: "
            f"SpeculativeConfig(method={method!r}, draft='folder/or/repo'). Train one with "
            f"`hf-specdec train-draft --target <model> --method {method} --out <folder>`."
        )
    return config.draft
