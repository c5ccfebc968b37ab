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
    max_matches: int = 8  # occurrences of an n-gram a tree draft branches over

    def __post_init__(self) -> None:
        if self.max_matches < 1:
            raise ValueError(f"ngram needs max_matches >= 1, got {self.max_matches}.")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"ngram needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}."
            )


class _RowIndex:
    """N-gram → positions after its latest occurrences (most recent last), for one row's tokens."""

    def __init__(self, sizes: range, keep: int) -> None:
        self.sizes = sizes
        self.keep = keep  # occurrences remembered per n-gram (trees branch over them)
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.tokens: list[int] = []
        self.indexed = 0  # continuation positions already indexed
        self.padding = 0  # left padding before the row's prompt, never indexed

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        # Index every n-gram that now has a continuation: ending at position j < len(tokens).
        toks = self.tokens
        for j in range(max(self.indexed, 1), len(toks)):
            for n in self.sizes:
                if j >= n:
                    starts = self.tables[n].setdefault(tuple(toks[j - n : j]), [])
                    starts.append(j)
                    if len(starts) > self.keep:
                        del starts[0]
        self.indexed = max(self.indexed, len(toks))

    def lookup(self, max_tokens: int) -> tuple[list[int], int]:
        """The continuation of the longest, most recent match of the current suffix, and its size."""
        for continuation, size in self.matches(max_tokens):
            return continuation, size
        return [], 0

    def matches(self, max_tokens: int) -> list[tuple[list[int], int]]:
        """Continuations of every remembered match of the current suffix, longest suffix first,
        then most recent first, each with the size of its match."""
        toks, found = self.tokens, []
        for n in reversed(self.sizes):
            if len(toks) <= n:
                continue
            for start in reversed(self.tables[n].get(tuple(toks[-n:]), [])):
                found.append((toks[start : start + max_tokens], n))
        return found


def _trie(continuations: list[tuple[list[int], int]], budget: int) -> tuple[list[int], list[int], list[int]]:
    """Merge continuations, best first, into a trie of at most `budget` nodes: tokens, parents
    (-1: a child of the last token) and the match size each node came from.

    The best continuation is not allowed the whole budget: each other continuation first gets the
    node where it leaves the trie (at most half of the budget goes to these), so that when the
    best goes wrong early another may still offer the next token; what is left extends the
    continuations in order.
    """
    tokens: list[int] = []
    parents: list[int] = []
    sizes: list[int] = []
    children: dict[tuple[int, int], int] = {}

    def insert(continuation: list[int], size: int, new_nodes: int) -> None:
        parent = -1
        for token in continuation:
            node = children.get((parent, token))
            if node is None:
                if new_nodes == 0 or len(tokens) >= budget:
                    return
                node = children[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                sizes.append(size)
                new_nodes -= 1
            parent = node

    distinct = {tuple(c) for c, _ in continuations[1:] if c and tuple(c) != tuple(continuations[0][0])}
    reserve = min(len(distinct), budget // 2)
    for rank, (continuation, size) in enumerate(continuations):
        if rank == 0:
            insert(continuation, size, budget - reserve)
        else:
            insert(continuation, size, 1)  # where it leaves the trie
    for continuation, size in continuations[1:]:
        insert(continuation, size, budget)
    return tokens, parents, sizes


@register_drafter
class NgramDrafter(Drafter):
    """Draft-free drafting by prompt lookup over the prompt and the text generated so far."""

    name: ClassVar[str] = "ngram"
    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True  # a trie of the continuations of several matches

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.rows: dict[int, _RowIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> NgramDrafter:
        return cls(options_to_config(NgramConfig, config.options))

    def propose(self, request: DraftRequest) -> Draft:
        proposals: list[tuple[list[int], list[int], list[int]]] = []  # tokens, parents, match sizes
        sizes = range(self.config.min_ngram, self.config.max_ngram + 1)
        for b, row_id in enumerate(request.row_ids):
            index = self.rows.get(row_id)
            if index is None:  # the prompt: skip its left padding, once
                index = self.rows[row_id] = _RowIndex(sizes, self.config.max_matches)
                index.padding = int((request.attention_mask[b, : request.lengths[b]] == 0).sum())
            # Only the tokens added since the last step are new (generated tokens are never padding).
            start = index.padding + len(index.tokens)
            if request.lengths[b] > start:
                index.extend(request.tokens[b, start : request.lengths[b]].tolist())
            budget = request.max_tokens[b]
            if budget <= 0:
                proposals.append(([], [], []))
            elif request.tree:
                proposals.append(_trie(index.matches(budget), budget))
            else:
                chain, size = index.lookup(budget)
                proposals.append((chain, list(range(-1, len(chain) - 1)), [size] * len(chain)))
        lengths = [len(tokens) for tokens, _, _ in proposals]
        width = max(lengths, default=0)
        device = request.tokens.device
        if width == 0:  # no match in any row: the step is a plain one, and cheap to say so
            return Draft.empty(len(proposals), device)

        def padded(rows: list[list[Any]], fill: Any) -> list[list[Any]]:
            return [row + [fill] * (width - len(row)) for row in rows]

        tokens = torch.tensor(padded([p[0] for p in proposals], 0), dtype=torch.long)
        parents = torch.tensor(padded([p[1] for p in proposals], 0), dtype=torch.long)
        # A raw score, not a probability: longer matches are likelier to continue. The
        # draft-length policy learns what each score is worth in accepted tokens.
        confidence = torch.tensor(padded([[n / (n + 1) for n in p[2]] for p in proposals], 0.0))
        return Draft(
            tokens.to(device),
            lengths,
            confidence=confidence.to(device),
            parents=parents.to(device) if request.tree else None,
        )
