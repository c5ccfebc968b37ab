"""Prompt lookup: propose the tokens that followed earlier occurrences of the current suffix.

Unlike transformers' `prompt_lookup_num_tokens`, which rescans the whole sequence every step,
this keeps, per row and per n-gram size, a hash index from each n-gram to the positions after its
latest occurrences, updated only with the tokens added since the last step. A lookup is then a
few dictionary probes (microseconds), so a miss costs nothing but a plain decoding step.

The longest matching suffix wins (down to single tokens: where verifying is cheap even a weak
match is worth a try, and where it is dear the draft-length policy cuts such drafts, having
learnt per match size how often they are accepted, from odds measured beforehand:
`FIRST_TOKEN_ODDS`). Among that suffix's occurrences the
continuation is voted token by token: each next token is the one most of the still-agreeing
occurrences continue with (the most recent among equals), as a suffix tree's counts would say.
Replayed on SmolLM2's greedy answers to 24 Spec-Bench prompts kept apart from the benchmark's
(10-token drafts), that votes 2.19 tokens per target forward against 2.11 for the most recent
occurrence and 2.13 for transformers' earliest one (`benchmarks/micro/ngram_rules.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.fields import check_fields
from ..core.policy.acceptance import PRIOR_ACCEPTANCE, beta_mean
from ..core.tree import kept_parents
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
        min_ngram: shortest suffix that counts as a match; 1 (the default) matches single tokens,
            which proposes often and is wrong often: the draft-length policy learns how often
            each match size is accepted and verifies such drafts only where that pays.
        max_matches: latest occurrences of an n-gram kept; the continuation is voted among them,
            and a tree draft branches over them.
    """

    max_ngram: int = 4
    min_ngram: int = 1
    max_matches: int = 16

    def __post_init__(self) -> None:
        check_fields(self, ranges={"max_ngram": (1, None), "min_ngram": (1, None), "max_matches": (1, None)})
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"ngram needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}."
            )


# How a draft token's match backs it: one remembered occurrence of the suffix continues with it,
# several do and all agree, or several disagree and it won their vote.
ONE, ALL, SPLIT = "one", "all", "split"


class NgramIndex:
    """N-gram → positions after its latest occurrences (most recent last), for one row's tokens."""

    def __init__(self, sizes: range, keep: int) -> None:
        self.sizes = sizes
        self.keep = keep  # occurrences remembered per n-gram (trees branch over them)
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.tokens: list[int] = []
        self.indexed = 0  # continuation positions already indexed
        self.padding = 0  # left padding before the row's prompt, never indexed
        self.last_trie: tuple[list[int], list[int]] | None = None  # tokens, parents of the last trie

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

    def lookup(self, max_tokens: int) -> tuple[list[int], int, list[str]]:
        """The continuation voted among the occurrences of the longest matching suffix (module
        docstring), that suffix's size, and how the occurrences agreed on each token (`ONE`,
        `ALL`, `SPLIT`)."""
        toks = self.tokens
        for n in reversed(self.sizes):
            starts = self.tables[n].get(tuple(toks[-n:])) if len(toks) > n else None
            if not starts:
                continue
            continuation: list[int] = []
            agreement: list[str] = []
            while len(continuation) < max_tokens:
                if len(starts) == 1:  # one occurrence left: the rest is a copy, nothing to vote on
                    start = starts[0]
                    copied = toks[start : start + max_tokens - len(continuation)]
                    continuation += copied
                    agreement += [ONE] * len(copied)
                    break
                votes: dict[int, list[int]] = {}  # next token -> its occurrences, oldest first
                for start in starts:
                    if start < len(toks):
                        votes.setdefault(toks[start], []).append(start)
                if not votes:
                    break
                token = max(votes, key=lambda t: (len(votes[t]), votes[t][-1]))
                continuation.append(token)
                voters = sum(map(len, votes.values()))
                agreement.append(ONE if voters == 1 else ALL if len(votes) == 1 else SPLIT)
                starts = [start + 1 for start in votes[token]]
            return continuation, n, agreement
        return [], 0, []

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


# What a draft token's odds of acceptance are, by the size of the match it continues and how that
# suffix's occurrences backed it (`ONE`, `ALL`, `SPLIT`): how often SmolLM2-135M's greedy answers
# (fp32, the 24 Spec-Bench train-split prompts, 128 tokens) went on as the voted continuation
# said, for a draft's first token and for a later one once those before it held (`python
# benchmarks/micro/ngram_rules.py`, its last table). They are the drafter's confidences, so the
# draft-length policy's calibration starts near them rather than at a raw score (a single token
# matched looked 55% likely to it, and held 27% of the time); it then learns each call's own
# rates. Where occurrences disagree the vote is a guess: a four-token match held 94% of the time
# where its occurrences agreed and 39% where they did not (80% for a single occurrence), and an
# open answer's lists and headings repeat their openings often with other words after them.
# Larger matches take the largest size listed.
FIRST_TOKEN_ODDS = {
    1: {ONE: 0.36, ALL: 0.57, SPLIT: 0.20},
    2: {ONE: 0.56, ALL: 0.92, SPLIT: 0.21},
    3: {ONE: 0.63, ALL: 0.68, SPLIT: 0.33},
    4: {ONE: 0.80, ALL: 0.94, SPLIT: 0.39},
}
LATER_TOKEN_ODDS = {
    1: {ONE: 0.75, ALL: 0.84, SPLIT: 0.23},
    2: {ONE: 0.75, ALL: 0.77, SPLIT: 0.37},
    3: {ONE: 0.80, ALL: 0.85, SPLIT: 0.43},
    4: {ONE: 0.85, ALL: 0.98, SPLIT: 0.63},
}


def _by_size(table: dict[int, dict[str, float]], size: int) -> dict[str, float]:
    """The table's row for a match of `size` tokens (larger matches take the largest size listed)."""
    return table[min(size, max(table))]


def token_odds(size: int, agreement: str, first: bool) -> float:
    """A draft token's prior odds of acceptance, by its match's size and how the match backs it."""
    return _by_size(FIRST_TOKEN_ODDS if first else LATER_TOKEN_ODDS, size)[agreement]


def chain_odds(size: int, agreement: list[str]) -> list[float]:
    """`token_odds` of each token of a chain continuing a match of `size` tokens (none if none), each
    table's row looked up once: this runs every step."""
    if not agreement:
        return []
    first, later = _by_size(FIRST_TOKEN_ODDS, size), _by_size(LATER_TOKEN_ODDS, size)
    return [first[agreement[0]], *(later[agreed] for agreed in agreement[1:])]


# γ of `_trie` before anything is seen: another match rarely has the token the best one missed.
OTHER_MATCH_PRIOR = 0.2


def _trie(
    continuations: list[list[int]],
    budget: int,
    alpha: float = PRIOR_ACCEPTANCE,
    gamma: float = OTHER_MATCH_PRIOR,
    lead_odds: list[float] | None = None,
) -> tuple[list[int], list[int], list[float]]:
    """Merge continuations, best first, into a trie and keep its `budget` likeliest nodes, likeliest
    first: tokens, parents (-1: a child of the last token) and each node's odds of acceptance once
    its parent held.

    A node's likelihood of lying on the accepted path is the product of those odds down its path:
    α for a node that continues its parent's best continuation (the first one through the parent;
    `lead_odds[i]` for the best continuation's own i-th token, as a chain of it would be judged)
    and (1 - a)·γ·2^-(j-1) for the parent's j-th other child, a the odds of its first child: α is
    how often a best continuation's next token is accepted, γ how often another match has the
    token when the best does not. Children are less likely than their parents, so the order keeps
    parents first and any prefix of the nodes is a tree: where the best continuation is mostly
    right the trie is nearly a chain, where it often fails early the other matches' tokens come in.
    """
    tokens: list[int] = []
    parents: list[int] = []
    likelihood: list[float] = []
    odds: list[float] = []
    children: dict[tuple[int, int], int] = {}
    first_child: dict[int, int] = {}
    child_count: dict[int, int] = {}
    for c, continuation in enumerate(continuations):
        parent = -1
        for i, token in enumerate(continuation):
            node = children.get((parent, token))
            if node is None:
                node = children[(parent, token)] = len(tokens)
                j = child_count[parent] = child_count.get(parent, 0) + 1
                if j == 1:
                    first_child[parent] = node
                    factor = lead_odds[i] if c == 0 and lead_odds and i < len(lead_odds) else alpha
                else:
                    factor = (1 - odds[first_child[parent]]) * gamma * 0.5 ** (j - 2)
                tokens.append(token)
                parents.append(parent)
                odds.append(factor)
                likelihood.append((likelihood[parent] if parent >= 0 else 1.0) * factor)
            parent = node
    kept = sorted(range(len(tokens)), key=lambda i: (-likelihood[i], i))[:budget]
    return [tokens[i] for i in kept], kept_parents(parents, kept), [odds[i] for i in kept]


@dataclass
class _TrieOdds:
    """α and γ of `_trie`, learnt from the tokens that followed each trie (Beta means; priors as
    drafted before anything was seen)."""

    best_hits: float = 0.0
    best_trials: float = 0.0
    other_hits: float = 0.0
    other_trials: float = 0.0

    @property
    def alpha(self) -> float:
        return beta_mean(self.best_hits, self.best_trials)

    @property
    def gamma(self) -> float:
        return beta_mean(self.other_hits, self.other_trials, OTHER_MATCH_PRIOR)

    def observe(self, tokens: list[int], parents: list[int], followed: list[int]) -> None:
        """Walk the trie (`tokens`, `parents`) down the tokens that `followed` its proposal."""
        node = -1
        for token in followed:
            kids = [i for i, parent in enumerate(parents) if parent == node]
            if not kids:
                return
            best, others = kids[0], kids[1:]
            self.best_trials += 1
            if tokens[best] == token:
                self.best_hits += 1
                node = best
                continue
            if not others:
                return
            self.other_trials += 1
            match = next((i for i in others if tokens[i] == token), None)
            if match is None:
                return
            self.other_hits += 1
            node = match


Proposal = tuple[list[int], list[int] | None, list[float]]  # tokens, parents (None: a chain), odds


def pack(proposals: list[Proposal], device: torch.device, tree: bool) -> Draft:
    """Rows' proposals as one `Draft`, padded to the longest; the odds as its confidence (by match
    size and agreement: the policy learns what each is worth in the call)."""
    lengths = [len(tokens) for tokens, _, _ in proposals]
    width = max(lengths, default=0)
    if width == 0:  # no match in any row: the step is a plain one, and cheap to say so
        return Draft.empty(len(proposals), device)

    def padded(rows: list[list[Any]], fill: Any) -> list[list[Any]]:
        return [row + [fill] * (width - len(row)) for row in rows]

    tokens = torch.tensor(padded([p[0] for p in proposals], 0), dtype=torch.long)
    confidence = torch.tensor(padded([p[2] for p in proposals], 0.0))
    parents = None
    if tree:
        parents = torch.tensor(padded([p[1] or [] for p in proposals], 0), dtype=torch.long).to(device)
    return Draft(tokens.to(device), lengths, confidence=confidence.to(device), parents=parents)


@register_drafter
class NgramDrafter(Drafter):
    """Draft-free drafting by prompt lookup over the prompt and the text generated so far."""

    name: ClassVar[str] = "ngram"
    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True  # a trie of the continuations of several matches
    draft_cost: ClassVar[DraftCost] = DraftCost.FREE  # a look-up in the text, whatever its length
    takes_draft: ClassVar[bool] = False
    options_class: ClassVar[type] = NgramConfig

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.rows: dict[int, NgramIndex] = {}
        self.trie_odds = _TrieOdds()

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> NgramDrafter:
        return cls(options_to_config(cls.options_class, config.options))

    def propose(self, request: DraftRequest) -> Draft:
        return pack(self.proposals(request), request.tokens.device, request.tree)

    def proposals(self, request: DraftRequest) -> list[Proposal]:
        """Per row: its draft's tokens, parents (None for a chain) and each token's odds."""
        proposals: list[Proposal] = []
        sizes = range(self.config.min_ngram, self.config.max_ngram + 1)
        for b, row_id in enumerate(request.row_ids):
            index = self.rows.get(row_id)
            if index is None:  # the prompt: skip its left padding, once
                index = self.rows[row_id] = NgramIndex(sizes, self.config.max_matches)
                index.padding = int((request.attention_mask[b, : request.lengths[b]] == 0).sum())
            # Only the tokens added since the last step are new (generated tokens are never padding).
            start = index.padding + len(index.tokens)
            if request.lengths[b] > start:
                followed = request.tokens[b, start : request.lengths[b]].tolist()
                if index.last_trie is not None:  # what the target kept after the last trie
                    self.trie_odds.observe(*index.last_trie, followed)
                index.extend(followed)
            index.last_trie = None
            budget = request.max_tokens[b]
            if budget <= 0:
                proposals.append(([], None, []))
            elif request.tree:
                odds = self.trie_odds
                # The voted continuation leads, so it is the trie's best path.
                chain, size, agreement = index.lookup(budget)
                continuations = [chain, *(tokens for tokens, _ in index.matches(budget))]
                tokens, parents, confidence = _trie(
                    continuations, budget, odds.alpha, odds.gamma, chain_odds(size, agreement)
                )
                index.last_trie = (tokens, parents)
                proposals.append((tokens, parents, confidence))
            else:
                chain, size, agreement = index.lookup(budget)
                proposals.append((chain, None, chain_odds(size, agreement)))
        return proposals
