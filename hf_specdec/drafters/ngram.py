"""Prompt lookup: propose the tokens that followed earlier occurrences of the current suffix.

Unlike transformers' `prompt_lookup_num_tokens`, which rescans the whole sequence every step,
this keeps, per row and per n-gram size, a hash index from each n-gram to the positions after its
latest occurrences, updated only with the tokens added since the last step. A lookup is then a
few dictionary probes (microseconds), so a miss costs nothing but a plain decoding step. A long
prompt is indexed in one numpy pass instead (`PromptNgrams`: sorted n-gram keys, searched once a
step), which answers every look-up as the dictionaries would.

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

import array
import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
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


# The prompt's n-grams are indexed in one numpy pass (`PromptNgrams`) from this many tokens on. A
# dict entry per n-gram and size costs about 1 us of Python a prompt token (4 sizes), paid before
# the first draft, and leaves lists that every full collection of the garbage collector walks: a
# batch of 8 prompts of 8,000 tokens spent 80 ms indexing, and up to 4 times that counting the
# collections they set off. The pass costs about 0.25 us a token (2 ms for 8,000), and a step's
# look-up a search of it more (about 5 us a row). Below this many tokens the dicts cost
# under a millisecond a row, and the pass would save less than its searches add over a few hundred
# steps (`benchmarks/micro/ngram_index.py`).
PROMPT_PASS_TOKENS = 1024
HASH_BASE = 0x9E3779B97F4A7C15  # odd: an n-gram's key is a polynomial in it, modulo 2^64
HASH_MASK = (1 << 64) - 1


def _ints(values: np.ndarray | list[int]) -> array.array:
    """int64s as an `array.array`: read from Python without numpy's per-call cost, and no objects
    for the garbage collector to walk (a list of ints is walked item by item on every full
    collection)."""
    return array.array("q", np.asarray(values, dtype=np.int64).tobytes())


class PromptNgrams:
    """The prompt's n-grams of every size, indexed at once: each distinct n-gram's key, sorted, and
    the positions after its latest `keep` occurrences (ascending), as `NgramIndex.tables` would
    hold them. An n-gram's key is Σ token_i · B^i + B^n modulo 2^64 (B = `HASH_BASE`, i counted
    from its last token; B^n sets sizes apart), computed over the whole prompt at once in numpy,
    and for the suffix at each step in Python. Two n-grams sharing a key make `build` return None
    (the dict indexes that prompt instead), so a key names one n-gram, and a look-up checks one of
    its occurrences against the suffix it asks for (a suffix the prompt never had may share a key
    with an n-gram it has). It is kept in flat arrays of ints, which the garbage collector does not
    walk, and which a step's look-up searches from Python (numpy's per-call cost is dearer there)."""

    def __init__(
        self, sizes: range, keys: np.ndarray, widths: array.array, bounds: array.array, positions: array.array
    ) -> None:
        self.sizes = sizes
        self.keys = array.array("Q", keys.tobytes())  # [ngrams] sorted
        self.widths = widths  # [ngrams] its tokens
        self.bounds = bounds  # [ngrams + 1]: n-gram g's positions are positions[bounds[g] : bounds[g + 1]]
        self.positions = positions
        self.powers = [pow(HASH_BASE, i, 1 << 64) for i in range(sizes.stop)]  # B^i

    @classmethod
    def build(cls, tokens: list[int], sizes: range, keep: int) -> PromptNgrams | None:
        """The n-grams of `sizes` that end before the prompt's last token (the others have no
        continuation yet), or None where two of them share a key."""
        ids = np.array(tokens, dtype=np.int64)
        length, powers = len(ids), [np.uint64(pow(HASH_BASE, i, 1 << 64)) for i in range(sizes.stop)]
        hashes = np.zeros(length, np.uint64)  # hashes[j]: Σ token_i · B^i over the n tokens before j
        keys, ends, widths = [], [], []
        for n in range(1, min(sizes.stop, length)):
            hashes[n:] += ids[: length - n].astype(np.uint64) * powers[n - 1]
            if n in sizes:
                keys.append(hashes[n:] + powers[n])
                ends.append(np.arange(n, length))
                widths.append(np.full(length - n, n))
        if not keys:
            return cls(sizes, np.zeros(0, np.uint64), _ints([]), _ints([0]), _ints([]))
        keys, ends, widths = (np.concatenate(column) for column in (keys, ends, widths))
        order = np.argsort(keys)
        keys, ends, widths = keys[order], ends[order], widths[order]
        new = np.r_[True, keys[1:] != keys[:-1]]  # [entries]: the first of its key's entries
        group = np.cumsum(new) - 1  # [entries]: its key's rank
        first = np.flatnonzero(new)  # [ngrams]: each key's first entry
        last = np.r_[first[1:], len(keys)]  # [ngrams]: one past each key's last entry
        repeats = np.flatnonzero(~new)  # entries that are not their key's first, checked against it
        leader = first[group[repeats]]
        if not np.array_equal(widths[repeats], widths[leader]):
            return None
        for i in range(1, sizes.stop):
            same = ids[ends[repeats] - i] == ids[ends[leader] - i]
            if not np.all(same | (widths[repeats] < i)):
                return None
        # Positions ascending under each key (a stable sort of the keys is 5x dearer than this).
        positions = np.sort(group * length + ends) - group * length
        kept = last[group] - np.arange(len(keys)) <= keep  # [entries]: among its key's latest `keep`
        bounds = np.r_[0, np.cumsum(np.minimum(last - first, keep))]
        return cls(sizes, keys[first], _ints(widths[first]), _ints(bounds), _ints(positions[kept]))

    def find(self, tokens: list[int]) -> dict[int, int]:
        """Per size n (under len(tokens)) whose key the last n of `tokens` share: that n-gram's rank,
        for `occurrences` (which checks that it is theirs)."""
        newest_first = tokens[-1 : -min(len(self.powers), len(tokens)) : -1]
        sums = itertools.accumulate(map(operator.mul, newest_first, self.powers))  # n = 1, 2, ...
        found = {}
        for n, (h, power) in enumerate(zip(sums, self.powers[1:]), 1):
            if n < self.sizes.start:
                continue
            key = (h + power) & HASH_MASK
            g = bisect.bisect_left(self.keys, key)
            if g == len(self.keys) or self.keys[g] != key:
                break  # the prompt lacks this suffix, so it lacks the longer ones
            found[n] = g
        return found

    def occurrences(self, g: int, tokens: list[int], n: int) -> list[int]:
        """Positions after the latest `keep` occurrences of the n-gram of rank `g` (`find`), if it is
        the last n of `tokens`; none if only its key is theirs."""
        if self.widths[g] != n:
            return []
        positions = self.positions[self.bounds[g] : self.bounds[g + 1]].tolist()
        return positions if tokens[positions[0] - n : positions[0]] == tokens[-n:] else []


class NgramIndex:
    """N-gram → positions after its latest occurrences (most recent last), for one row's tokens."""

    def __init__(self, sizes: range, keep: int) -> None:
        self.sizes = sizes
        self.keep = keep  # occurrences remembered per n-gram (trees branch over them)
        # The prompt's n-grams, where it was long enough to index in one pass (`PROMPT_PASS_TOKENS`);
        # `tables` then holds those ending after it only.
        self.prompt: PromptNgrams | None = None
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.tokens: list[int] = []
        self.indexed = 0  # continuation positions already indexed
        self.padding = 0  # left padding before the row's prompt, never indexed
        self.last_trie: tuple[list[int], list[int]] | None = None  # tokens, parents of the last trie
        self._in_prompt: tuple[int, dict[int, int]] = (-1, {})  # at a length: `PromptNgrams.find`

    def extend(self, new_tokens: list[int]) -> None:
        if not self.tokens and len(new_tokens) >= PROMPT_PASS_TOKENS:
            self.prompt = PromptNgrams.build(new_tokens, self.sizes, self.keep)
            if self.prompt is not None:
                self.indexed = len(new_tokens)
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

    def in_prompt(self) -> dict[int, int]:
        """`PromptNgrams.find` of the tokens so far: one search of the prompt a step, all sizes."""
        if self.prompt is None:
            return {}
        if self._in_prompt[0] != len(self.tokens):
            self._in_prompt = (len(self.tokens), self.prompt.find(self.tokens))
        return self._in_prompt[1]

    def starts(self, n: int, in_prompt: dict[int, int]) -> list[int]:
        """Positions after the latest `keep` occurrences of the last n tokens, ascending (none until
        there are more than n tokens: the suffix itself has no continuation)."""
        toks = self.tokens
        if len(toks) <= n:
            return []
        later = self.tables[n].get(tuple(toks[-n:]), [])
        if n not in in_prompt or len(later) >= self.keep:
            return later
        return (self.prompt.occurrences(in_prompt[n], toks, n) + later)[-self.keep :]

    def lookup(self, max_tokens: int) -> tuple[list[int], int, list[str]]:
        """The continuation voted among the occurrences of the longest matching suffix (module
        docstring), that suffix's size, and how the occurrences agreed on each token (`ONE`,
        `ALL`, `SPLIT`)."""
        toks, in_prompt = self.tokens, self.in_prompt()
        for n in reversed(self.sizes):
            starts = self.starts(n, in_prompt)
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
        toks, found, in_prompt = self.tokens, [], self.in_prompt()
        for n in reversed(self.sizes):
            for start in reversed(self.starts(n, in_prompt)):
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
