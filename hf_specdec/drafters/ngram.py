"""Prompt lookup: propose the tokens that followed the last time the current suffix occurred.

Unlike transformers' `prompt_lookup_num_tokens`, which rescans the whole sequence every step,
this keeps, per row and per n-gram size, a hash index from each n-gram to the position after
its most recent occurrence, updated only with the tokens added since the last step. A lookup is
then a few dictionary probes (microseconds), so a miss costs nothing but a plain decoding step.
The longest matching suffix wins, and among equal lengths the most recent occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..draft import Draft, DraftRequest
from .base import Drafter, options_to_config
from .registry import register_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass
class NgramConfig:
    """Settings of the `ngram` drafter (`SpeculativeConfig(method="ngram", options={...})`).

    Args:
        max_ngram: longest suffix to look up.
        min_ngram: shortest suffix that counts as a match; 1 matches single tokens, which
            proposes often but is wrong often.
    """

    max_ngram: int = 4
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"ngram needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}."
            )


class _RowIndex:
    """N-gram → position after its latest occurrence, for one row's token list."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.tokens: list[int] = []
        self.indexed = 0  # continuation positions already indexed

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        # Index every n-gram that now has a continuation: ending at position j < len(tokens).
        toks = self.tokens
        for j in range(max(self.indexed, 1), len(toks)):
            for n in self.sizes:
                if j >= n:
                    self.tables[n][tuple(toks[j - n : j])] = j
        self.indexed = max(self.indexed, len(toks))

    def lookup(self, max_tokens: int) -> tuple[list[int], int]:
        """The continuation of the longest, most recent match of the current suffix, and its size."""
        toks = self.tokens
        for n in reversed(self.sizes):
            if len(toks) <= n:
                continue
            start = self.tables[n].get(tuple(toks[-n:]))
            if start is not None:
                return toks[start : start + max_tokens], n
        return [], 0


@register_drafter
class NgramDrafter(Drafter):
    """Draft-free drafting by prompt lookup over the prompt and the text generated so far."""

    name: ClassVar[str] = "ngram"
    supports_sampling: ClassVar[bool] = True

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.rows: dict[int, _RowIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> NgramDrafter:
        return cls(options_to_config(NgramConfig, config.options))

    def propose(self, request: DraftRequest) -> Draft:
        proposals: list[list[int]] = []
        sizes = range(self.config.min_ngram, self.config.max_ngram + 1)
        for b, row_id in enumerate(request.row_ids):
            index = self.rows.setdefault(row_id, _RowIndex(sizes))
            row = request.row(b)[0]
            real = request.attention_mask[b, : request.lengths[b]].bool()
            # Only the tokens added since the last step are new; left padding is never indexed.
            new = int(real.sum()) - len(index.tokens)
            index.extend(row[real][-new:].tolist() if new > 0 else [])
            proposals.append(index.lookup(request.max_tokens[b]) if request.max_tokens[b] > 0 else ([], 0))
        lengths = [len(p) for p, _ in proposals]
        width = max(lengths, default=0)
        tokens = torch.zeros(len(proposals), width, dtype=torch.long)
        confidence = torch.zeros(len(proposals), width)
        for b, (proposal, size) in enumerate(proposals):
            tokens[b, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            # A raw score, not a probability: longer matches are likelier to continue. The
            # draft-length policy learns what each score is worth in accepted tokens.
            confidence[b, : len(proposal)] = size / (size + 1)
        device = request.tokens.device
        return Draft(tokens.to(device), lengths, confidence=confidence.to(device))
