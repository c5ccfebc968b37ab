"""Suffix decoding: prompt lookup plus a corpus of the earlier calls' prompts and outputs.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's `method="suffix"`, over the
`arctic-inference` suffix tree) drafts without a model from two sources: the request's own
context and a bounded cache of earlier responses. At each step it matches the context's last
tokens in each, follows the continuation its occurrences most often took, speculates more tokens
the longer the match (at most `max_spec_factor * match + max_spec_offset`), stops where the
continuation's estimated probability falls under `min_token_prob`, and takes the better scoring
source. Here:

- **The context** is searched by the `ngram` drafter (its hash index and vote, its measured odds),
  which this drafter wraps: where the corpus has nothing better, the draft is prompt lookup's.
- **The corpus** is per model, in memory, bounded in tokens (`max_corpus_tokens`); each finished
  `generate` call adds every row's prompt and output (`Drafter.finish`), and the oldest sequences
  go first once it is full. It is a sorted array over every position of every sequence, keyed by
  the `MAX_MATCH` tokens before that position read backwards (nearest first), i.e. a suffix
  array of the reversed sequences: the positions whose preceding tokens end as the context does
  form one contiguous range for each match length m, and those ranges are nested, so one
  vectorised binary search gives all of them and the longest match. The continuation is voted
  token by token among the occurrences of that longest match, each weighing 2^(-age /
  `recency_half_life`) (age in sequences added since: frequency and recency); its tokens carry
  odds of acceptance by match length and by how the occurrences agreed, as `ngram`'s do, learnt
  across calls (`CorpusOdds`), so that the two sources' drafts compare on one scale. A tree
  (`SpeculativeConfig(tree=True)`) grows best-first over the corpus's continuations and is merged
  with prompt lookup's trie.
- **Why this structure.** A suffix tree (arctic-inference's, in C++) touches up to its depth of
  nodes for every token added, and each node would be a Python object here, its size depending on
  how the text branches. A suffix automaton finds the longest match in constant time per token,
  but cannot forget a sequence, and first-in-first-out eviction is the contract. The sorted array
  is numpy's: an add sorts the call's keys and merges them in (about 2 ms for 500 tokens into
  2^18 on this CPU), an eviction is a mask, a look-up a binary search; it costs a fixed
  `bytes_per_token` a token (40 for a vocabulary under 65535), so the bound in tokens is a bound
  in bytes; and readers take the arrays as they are while a writer builds the next ones
  (thread-safe without readers waiting).
- **When the corpus drafts.** Before each row's sequence is added, the call's output is replayed
  against the corpus as it was: at each step the loop would have taken, what prompt lookup alone
  and what this drafter would have drafted, and how many tokens of each the output held (greedy
  acceptance; a sample holds a drafted token with the probability the target gave it, as
  verification accepts it). The corpus drafts only while its recent replays gave at least
  `min_gain` times prompt lookup's tokens per step; otherwise its drafts are prompt lookup's
  exactly, and replays grow rarer (`MAX_REPLAY_EVERY`). `method="auto"` drafts with it wherever
  no draft model is chosen, so that a workload that repeats itself across calls gains, and one
  that does not loses nothing but the add and the occasional replay.

What the corpus holds is the users' text: in memory only, never written to disk, emptied by
`hf_specdec.clear_cache()` (docs/security.md).
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.fields import check_fields
from ..core.policy.acceptance import MAX_DRAFT, PRIOR_WEIGHT, beta_mean
from ..core.policy.decision import expected_gains
from .base import Drafter, options_to_config
from .ngram import ALL, FIRST_TOKEN_ODDS, LATER_TOKEN_ODDS, ONE, SPLIT, NgramConfig, NgramDrafter, _RowIndex
from .ngram import _chain_odds as context_odds
from .registry import register_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

MAX_MATCH = 16  # tokens of context a corpus match can span: the sort keys' width
MAX_OCCURRENCES = 64  # occurrences of a match voted among, the most recent
REPLAY_TOKENS = 256  # of each row's output, replayed against the corpus at the call's end
RECORD_ROWS = 8  # rows whose replays decide whether the corpus drafts
MIN_RECORD_TOKENS = 32  # replayed output tokens needed before they decide
MAX_REPLAY_EVERY = 4  # calls between replays, at most, while the corpus does not pay


@dataclass
class SuffixConfig(NgramConfig):
    """Settings of the `suffix` drafter: `ngram`'s for the context (`max_ngram`, `min_ngram`,
    `max_matches`), and the corpus's.

    Args:
        max_corpus_tokens: the corpus's bound, in tokens (prompts and outputs of earlier calls on
            the model); the oldest sequences go first. 0: no corpus (prompt lookup alone).
        min_match: shortest match in the corpus that drafts.
        max_spec_factor, max_spec_offset: a corpus match of m tokens drafts at most
            `max_spec_factor * m + max_spec_offset` tokens (SuffixDecoding's adaptive length).
        min_token_prob: a corpus continuation stops where the product of its tokens' shares of
            the vote falls below this.
        recency_half_life: an occurrence's vote halves with every this many sequences added to the
            corpus after it; None: frequency alone.
        min_gain: the corpus drafts while its recent replays gave at least this many times prompt
            lookup's tokens per step (module docstring); 0: whenever it has a better draft.
    """

    max_corpus_tokens: int = 1 << 18
    min_match: int = 1
    max_spec_factor: float = 1.0
    max_spec_offset: float = 8.0
    min_token_prob: float = 0.1
    recency_half_life: float | None = 256.0
    min_gain: float = 1.05

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(
            self,
            ranges={
                "max_corpus_tokens": (0, None),
                "min_match": (1, MAX_MATCH),
                "max_spec_factor": (0.0, None),
                "max_spec_offset": (0.0, None),
                "min_token_prob": (0.0, 1.0),
                "min_gain": (0.0, None),
            },
        )
        if self.recency_half_life is not None and self.recency_half_life <= 0:
            raise ValueError(
                f"`recency_half_life` of SuffixConfig must be a positive number of sequences or None "
                f"(frequency alone), got {self.recency_half_life!r}."
            )


# ---------------------------------------------------------------------------------------------
# The corpus's arrays
# ---------------------------------------------------------------------------------------------


def unit_bytes(vocab_size: int) -> int:
    """Bytes a token takes in a sort key: id + 1 big-endian (0 marks no token), and an all-0xFF
    unit left free to bound a range from above."""
    for width in (2, 3):
        if vocab_size + 1 < 256**width - 1:
            return width
    raise ValueError(
        f"The suffix corpus keys tokens in at most 3 bytes; a vocabulary of {vocab_size} ids is larger. "
        "Use method='ngram'."
    )


def encode(codes: np.ndarray, width: int) -> np.ndarray:
    """Rows of token codes (id + 1, 0 for none) [n, MAX_MATCH] as big-endian units of `width`
    bytes [n, MAX_MATCH * width]: compared as bytes, rows order as their codes do."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint32) * 8
    units = (codes.astype(np.uint32)[..., None] >> shifts) & 0xFF  # [n, MAX_MATCH, width]
    return np.ascontiguousarray(units.astype(np.uint8)).reshape(len(codes), -1)


def as_keys(encoded: np.ndarray) -> np.ndarray:
    """`encode`'s rows as fixed-width byte strings [n], which numpy sorts and searches."""
    return encoded.view(f"S{encoded.shape[1]}")[:, 0]


def preceding_codes(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each of `positions` in `tokens`, the codes of the MAX_MATCH tokens before it, nearest
    first (0 past the start) [n, MAX_MATCH]."""
    padded = np.concatenate([np.zeros(MAX_MATCH, dtype=np.int64), tokens.astype(np.int64) + 1])
    before = positions[:, None] + MAX_MATCH - 1 - np.arange(MAX_MATCH)  # padded index of each
    return padded[before]


@functools.cache
def _range_masks(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per match length m (row m - 1) of keys of `width`-byte units: 1 on the first m units' bytes,
    and 0xFF on the unit after them (none for m = MAX_MATCH) [MAX_MATCH, MAX_MATCH * width]."""
    m = np.arange(1, MAX_MATCH + 1)[:, None]
    column = np.arange(MAX_MATCH * width)[None, :]
    prefix = (column < m * width).astype(np.uint8)
    after = ((column >= m * width) & (column < (m + 1) * width)).astype(np.uint8) * 0xFF
    return prefix, after


@dataclass(frozen=True)
class Snapshot:
    """The corpus at one moment; never changed once built (a writer builds the next one), so a
    reader needs no lock. Sequences lie one after another in `tokens`, each followed by -1."""

    width: int  # bytes a token takes in a key
    keys: np.ndarray  # [N] sorted: the MAX_MATCH tokens before each position, nearest first
    where: np.ndarray  # [N] int32: the position in `tokens` each key precedes (a continuation start)
    tokens: np.ndarray  # [T] int32
    starts: np.ndarray  # [S] int64: where each sequence starts in `tokens`, oldest first
    numbers: np.ndarray  # [S] int64: each sequence's number, counted since the corpus was made

    @classmethod
    def empty(cls, width: int) -> Snapshot:
        return cls(
            width,
            np.zeros(0, dtype=f"S{MAX_MATCH * width}"),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
        )

    @property
    def num_tokens(self) -> int:
        """Tokens held, separators left out."""
        return len(self.tokens) - len(self.starts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.where, self.tokens, self.starts, self.numbers))

    def added(self, sequences: list[list[int]], bound: int) -> Snapshot:
        """This corpus with `sequences` added (numbered after the newest), then its oldest
        sequences dropped until it holds at most `bound` tokens; a sequence longer than the
        bound keeps its last `bound` tokens."""
        sequences = [s[len(s) - bound :] for s in sequences if s and bound > 0]
        if not sequences:
            return self._within(bound)
        base = len(self.tokens)
        new_tokens = np.concatenate([np.asarray(s + [-1], dtype=np.int32) for s in sequences])
        ends = base + np.cumsum([len(s) + 1 for s in sequences])  # one past each separator
        starts = ends - np.asarray([len(s) + 1 for s in sequences])
        # Keys for positions 1..len(s) of each sequence: len(s) is its end, whose continuation is
        # the separator (an occurrence that stops there dilutes the vote, as in a suffix tree).
        codes, where = [], []
        for seq, start in zip(sequences, starts):
            positions = np.arange(1, len(seq) + 1)
            codes.append(preceding_codes(np.asarray(seq), positions))
            where.append(start + positions)
        new_keys = as_keys(encode(np.concatenate(codes), self.width))
        order = np.argsort(new_keys, kind="stable")
        new_keys, new_where = new_keys[order], np.concatenate(where)[order].astype(np.int32)
        at = np.searchsorted(self.keys, new_keys)
        newest = int(self.numbers[-1]) + 1 if len(self.numbers) else 0
        grown = Snapshot(
            self.width,
            np.insert(self.keys, at, new_keys),
            np.insert(self.where, at, new_where),
            np.concatenate([self.tokens, new_tokens]),
            np.concatenate([self.starts, starts.astype(np.int64)]),
            np.concatenate([self.numbers, np.arange(newest, newest + len(sequences), dtype=np.int64)]),
        )
        return grown._within(bound)

    def _within(self, bound: int) -> Snapshot:
        """The oldest sequences dropped until at most `bound` tokens are held."""
        lengths = np.diff(np.append(self.starts, len(self.tokens))) - 1
        held_after = np.cumsum(lengths[::-1])[::-1]  # tokens held from each sequence on
        drop = int(np.count_nonzero(held_after > bound))
        if drop == 0:
            return self
        cut = int(self.starts[drop]) if drop < len(self.starts) else len(self.tokens)
        kept = self.where >= cut
        return Snapshot(
            self.width,
            self.keys[kept],
            (self.where[kept] - cut).astype(np.int32),
            self.tokens[cut:],
            self.starts[drop:] - cut,
            self.numbers[drop:],
        )

    def occurrences(self, tail: list[int]) -> tuple[np.ndarray, int]:
        """The positions that continue the longest match of `tail` (the context's last tokens,
        oldest first) and its length; the most recent MAX_OCCURRENCES of them."""
        tail = tail[-MAX_MATCH:]
        if not len(self.keys) or not tail:
            return np.zeros(0, dtype=np.int64), 0
        w, width = self.width, MAX_MATCH * self.width
        query = np.zeros(width, dtype=np.uint8)  # the tail's codes, nearest first, as `encode` lays them
        query[: len(tail) * w] = np.frombuffer(
            b"".join((token + 1).to_bytes(w, "big") for token in reversed(tail)), dtype=np.uint8
        )
        # The keys starting with the query's first m tokens, for every m at once: from that prefix
        # followed by no-token units (0) to the prefix followed by an all-0xFF unit, which no key
        # holds (for m = MAX_MATCH, which leaves no room after it, the whole query, side="right").
        prefix, after = _range_masks(w)
        lows = query * prefix[: len(tail)]  # [len(tail), width]
        lows, highs = as_keys(lows), as_keys(lows | after[: len(tail)])
        lo, hi = np.searchsorted(self.keys, lows), np.searchsorted(self.keys, highs, side="right")
        found = np.flatnonzero(hi > lo)
        if not len(found):
            return np.zeros(0, dtype=np.int64), 0
        m = int(found[-1]) + 1  # the ranges nest: the longest match is the last one not empty
        occurrences = self.where[lo[m - 1] : hi[m - 1]].astype(np.int64)
        if len(occurrences) > MAX_OCCURRENCES:
            occurrences = np.partition(occurrences, -MAX_OCCURRENCES)[-MAX_OCCURRENCES:]
        return np.sort(occurrences), m

    def match(self, tail: list[int], half_life: float | None) -> Match | None:
        """The longest match of `tail` with its occurrences' votes (`weights`), or None."""
        occurrences, size = self.occurrences(tail)
        return Match(self, occurrences, self.weights(occurrences, half_life), size) if size else None

    def weights(self, occurrences: np.ndarray, half_life: float | None) -> np.ndarray:
        """Each occurrence's vote: 2^(-age / half_life), age in sequences added after its own."""
        if half_life is None or not len(occurrences):
            return np.ones(len(occurrences))
        numbers = self.numbers[np.searchsorted(self.starts, occurrences, side="right") - 1]
        return np.exp2((numbers - self.numbers[-1]) / half_life)


# ---------------------------------------------------------------------------------------------
# Continuations: voted chains and best-first trees over a match's occurrences
# ---------------------------------------------------------------------------------------------


@dataclass
class Match:
    """The longest match of a context's last tokens in a corpus."""

    snapshot: Snapshot
    occurrences: np.ndarray  # [n] increasing: the positions that continue it
    weights: np.ndarray  # [n] each occurrence's vote
    size: int  # its length in tokens


@dataclass
class Vote:
    """The next tokens an occurrence set continues with, most weight first (ties to the most recent
    occurrence), and which occurrences go on with each."""

    tokens: list[int]
    weights: list[float]
    total: float  # every occurrence's weight, those whose sequence ends here included
    voters: int  # occurrences whose sequence goes on
    occurrences: np.ndarray  # [n] the positions voting, increasing
    occurrence_weights: np.ndarray  # [n]
    backers: list[list[int]] | None  # per token, its occurrences' indices; None: all back the one token

    def agreement(self) -> str:
        """How the occurrences backed the winner (`ngram`'s classes)."""
        return ONE if self.voters == 1 else ALL if len(self.tokens) == 1 else SPLIT

    def going_on(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The occurrences that continue with token i, advanced past it, and their weights."""
        if self.backers is None:
            return self.occurrences + 1, self.occurrence_weights
        kept = self.backers[i]
        return self.occurrences[kept] + 1, self.occurrence_weights[kept]


def vote(corpus_tokens: np.ndarray, occurrences: np.ndarray, weights: np.ndarray) -> Vote | None:
    """The vote among `occurrences` (positions in `corpus_tokens`, increasing) on the next token.
    Counted in Python: at most MAX_OCCURRENCES voters, where numpy's per-call cost would dominate."""
    following = corpus_tokens[occurrences].tolist()
    backing: dict[int, list[int]] = {}
    for i, token in enumerate(following):
        if token >= 0:  # -1: the occurrence's sequence ends here
            backing.setdefault(token, []).append(i)
    if not backing:
        return None
    total = float(weights.sum())
    if len(backing) == 1 and len(following) == len(next(iter(backing.values()))):  # all agree
        return Vote(list(backing), [total], total, len(following), occurrences, weights, None)
    per = weights.tolist()
    voted = [
        (sum(per[i] for i in backers), backers[-1], token, backers) for token, backers in backing.items()
    ]
    voted.sort(key=lambda v: (-v[0], -v[1]))  # most weight, then the latest occurrence
    voters = sum(len(v[3]) for v in voted)
    return Vote(
        [v[2] for v in voted],
        [v[0] for v in voted],
        total,
        voters,
        occurrences,
        weights,
        [v[3] for v in voted],
    )


def agreed_run(corpus_tokens: np.ndarray, occurrences: np.ndarray, most: int) -> list[int]:
    """The tokens (at most `most`) on which every one of `occurrences` goes on alike, before any
    sequence ends."""
    if len(occurrences) == 1:  # a copy, to its sequence's end
        copied = corpus_tokens[int(occurrences[0]) : int(occurrences[0]) + most].tolist()
        return copied[: copied.index(-1)] if -1 in copied else copied
    ahead = np.minimum(occurrences[:, None] + np.arange(most), len(corpus_tokens) - 1)  # the end is -1
    window = corpus_tokens[ahead]  # [n, most]
    same = (window == window[0]).all(axis=0) & (window[0] >= 0)
    run = most if bool(same.all()) else int(np.argmin(same))
    return window[0, :run].tolist()


@dataclass
class Chain:
    """A corpus continuation: its tokens, how the occurrences agreed on each, the match's size."""

    tokens: list[int]
    agreement: list[str]
    size: int


def draft_limit(size: int, budget: int, config: SuffixConfig) -> int:
    """Tokens a match of `size` tokens may draft (SuffixDecoding's adaptive length)."""
    return max(0, min(budget, int(config.max_spec_factor * size + config.max_spec_offset + 1e-6)))


def voted_chain(match: Match, budget: int, config: SuffixConfig) -> Chain:
    """Follow the vote token by token while the product of the winners' shares of it stays at or
    above `min_token_prob`, for at most `draft_limit` tokens."""
    snapshot, occurrences, weights = match.snapshot, match.occurrences, match.weights
    limit = draft_limit(match.size, budget, config)
    chain = Chain([], [], match.size)
    probability = 1.0
    while len(chain.tokens) < limit and len(occurrences):
        # Where every occurrence goes on alike (one occurrence: a copy) there is nothing to vote on.
        agreed = agreed_run(snapshot.tokens, occurrences, limit - len(chain.tokens))
        if agreed:
            chain.tokens += agreed
            chain.agreement += [ONE if len(occurrences) == 1 else ALL] * len(agreed)
            occurrences = occurrences + len(agreed)
            continue
        ballot = vote(snapshot.tokens, occurrences, weights)
        if ballot is None:
            break
        probability *= ballot.weights[0] / ballot.total
        if probability < config.min_token_prob:
            break
        chain.tokens.append(ballot.tokens[0])
        chain.agreement.append(ballot.agreement())
        occurrences, weights = ballot.going_on(0)
    return chain


# A match's size class for the learnt odds: the largest listed at or under it.
SIZE_CLASSES = (1, 2, 3, 4, 6, 8, 12, 16)
_SIZE_CLASS = [max((c for c in SIZE_CLASSES if c <= size), default=1) for size in range(MAX_MATCH + 1)]


class CorpusOdds:
    """Odds that a corpus-drafted token is accepted given the ones before it were, by the match's
    size class, first token or later, and how the occurrences agreed (`ONE`, `ALL`, `SPLIT`): a
    Beta mean per class, from `ngram`'s measured odds for in-context matches of that size
    (`FIRST_TOKEN_ODDS`, larger sizes taking the largest listed) towards what the replays of
    earlier outputs showed. On one scale with prompt lookup's, so the two compare."""

    def __init__(self) -> None:
        self.hits: dict[tuple[int, bool, str], float] = collections.defaultdict(float)
        self.trials: dict[tuple[int, bool, str], float] = collections.defaultdict(float)
        self._odds: dict[tuple[int, bool, str], float] = {}  # read every step, changed once a call

    @staticmethod
    def _key(size: int, first: bool, agreement: str) -> tuple[int, bool, str]:
        return _SIZE_CLASS[min(size, MAX_MATCH)], first, agreement

    def odds(self, size: int, agreement: str, first: bool) -> float:
        key = self._key(size, first, agreement)
        odds = self._odds.get(key)
        if odds is None:
            prior = (FIRST_TOKEN_ODDS if first else LATER_TOKEN_ODDS)[min(key[0], max(FIRST_TOKEN_ODDS))]
            odds = self._odds[key] = beta_mean(
                self.hits[key], self.trials[key], prior[agreement], PRIOR_WEIGHT
            )
        return odds

    def chain(self, chain: Chain) -> list[float]:
        return [self.odds(chain.size, agreed, i == 0) for i, agreed in enumerate(chain.agreement)]

    def observe(self, chain: Chain, actual: list[int]) -> None:
        """The tokens that followed where `chain` was drafted: each drafted token up to the first
        that differs (the last one tested) is one trial of its class."""
        for i, (token, agreed) in enumerate(zip(chain.tokens, chain.agreement)):
            if i >= len(actual):
                return
            key = self._key(chain.size, i == 0, agreed)
            self._odds.pop(key, None)
            self.trials[key] += 1
            if token != actual[i]:
                return
            self.hits[key] += 1


def expected_tokens(odds: list[float]) -> float:
    """Tokens a draft with these per-token odds adds in expectation, Σ_j Π_{i≤j} odds_i."""
    return expected_gains(odds)[-1] if odds else 0.0


Node = tuple[int, int, float]  # a tree node: token, parent (-1: the root's child), odds given its parent


def corpus_tree(match: Match, budget: int, config: SuffixConfig, odds: CorpusOdds) -> list[Node]:
    """Up to `budget` nodes (token, parent, odds given its parent), likeliest first, grown
    best-first over the continuations of a match (as SuffixDecoding's tree speculation): a node's
    likelihood is the product of its path's odds, the vote's winner at each node taking its
    class's odds and a runner-up those scaled by its weight over the winner's. A node's path is at
    most `draft_limit` deep, and its share of the votes down it at least `min_token_prob`."""
    snapshot, size = match.snapshot, match.size
    depth_limit = draft_limit(size, budget, config)
    nodes: list[Node] = []
    counter = itertools.count()
    # (−likelihood, tie-break, occurrences, weights, parent node, depth, votes' share, token, odds)
    pending: list[tuple[float, int, Any, Any, int, int, float, int, float]] = []

    def expand(
        occurrences: np.ndarray, weights: np.ndarray, parent: int, depth: int, likelihood: float, share: float
    ):
        if depth >= depth_limit:
            return
        ballot = vote(snapshot.tokens, occurrences, weights)
        if ballot is None:
            return
        best = odds.odds(size, ballot.agreement(), depth == 0)
        for i, (token, weight) in enumerate(zip(ballot.tokens, ballot.weights)):
            child_share = share * weight / ballot.total
            if child_share < config.min_token_prob:
                break  # the rest weigh less still
            p = best * weight / ballot.weights[0]
            going_on, kept = ballot.going_on(i)
            entry = (-likelihood * p, next(counter), going_on, kept, parent, depth + 1, child_share, token, p)
            heapq.heappush(pending, entry)

    expand(match.occurrences, match.weights, -1, 0, 1.0, 1.0)
    while pending and len(nodes) < budget:
        neg, _, going_on, kept, parent, depth, share, token, p = heapq.heappop(pending)
        nodes.append((token, parent, p))
        expand(going_on, kept, len(nodes) - 1, depth, -neg, share)
    return nodes


def merge_trees(trees: list[list[Node]], budget: int) -> tuple[list[int], list[int], list[float]]:
    """Trees of (token, parent, odds given its parent), parents first, merged into one trie (a path
    in several keeps its likeliest), cut to its `budget` likeliest nodes, parents first: tokens,
    parents, odds given the parent."""
    tokens: list[int] = []
    parents: list[int] = []
    likelihood: list[float] = []
    depth: list[int] = []
    where: dict[tuple[int, int], int] = {}
    for tree in trees:
        merged: list[int] = []  # this tree's node -> the merged node
        reach: list[float] = []  # this tree's node -> its likelihood down its own path
        for token, parent, p in tree:
            up = merged[parent] if parent >= 0 else -1
            own = (reach[parent] if parent >= 0 else 1.0) * p
            node = where.get((up, token))
            if node is None:
                node = where[(up, token)] = len(tokens)
                tokens.append(token)
                parents.append(up)
                likelihood.append(own)
                depth.append(depth[up] + 1 if up >= 0 else 1)
            else:
                likelihood[node] = max(likelihood[node], own)
            merged.append(node)
            reach.append(own)
    # A node is never likelier than its parent (odds are at most 1), so among equals the shallower
    # first keeps every parent before its children.
    kept = sorted(range(len(tokens)), key=lambda i: (-likelihood[i], depth[i], i))[:budget]
    new = {old: i for i, old in enumerate(kept)}
    out_parents = [new[parents[i]] if parents[i] >= 0 else -1 for i in kept]
    odds = [
        min(1.0, likelihood[i] / likelihood[parents[i]]) if parents[i] >= 0 and likelihood[parents[i]] > 0
        else likelihood[i]
        for i in kept
    ]  # fmt: skip
    return [tokens[i] for i in kept], out_parents, odds


# ---------------------------------------------------------------------------------------------
# The corpus: one per model, thread-safe
# ---------------------------------------------------------------------------------------------


def tokens_held(drafted: list[int], actual: list[int]) -> int:
    """How many of `drafted` the `actual` continuation begins with."""
    held = 0
    for token, real in zip(drafted, actual):
        if token != real:
            break
        held += 1
    return held


class SuffixCorpus:
    """One model's corpus of earlier prompts and outputs, its learnt odds and its replay record.

    Readers take `snapshot` (one attribute read) and never wait; writers (`add`) hold a lock while
    they replay the call's rows against the corpus and build the next snapshot."""

    def __init__(self, vocab_size: int) -> None:
        self.snapshot = Snapshot.empty(unit_bytes(vocab_size))
        self.odds = CorpusOdds()
        # Per replayed row: (steps, tokens prompt lookup alone would have given, tokens ours would have).
        self.record: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=RECORD_ROWS)
        self._lock = threading.Lock()
        # While a whole record of replays says the corpus does not pay, they grow rarer: every 2nd
        # call, then every MAX_REPLAY_EVERY-th (a call of a workload that does not repeat pays
        # nothing else for the corpus), and every call again once it pays.
        self.replay_every = 1
        self._until_replay = 0
        self.replayed_calls = 0

    def gain(self) -> float | None:
        """Tokens per step this drafter's replays gave over prompt lookup's alone (at the same
        steps), or None while too little output was replayed to say."""
        record = list(self.record)  # one copy (a writer may append meanwhile: no iterating it)
        ours = sum(r[2] for r in record)
        return ours / sum(r[1] for r in record) if ours >= MIN_RECORD_TOKENS else None

    def drafts(self, min_gain: float) -> bool:
        """Whether a call starting now should draft from the corpus."""
        if not self.snapshot.num_tokens:
            return False
        if min_gain == 0:
            return True
        gain = self.gain()
        return gain is not None and gain >= min_gain

    def chain(self, snapshot: Snapshot, tail: list[int], budget: int, config: SuffixConfig) -> Chain | None:
        """The voted continuation of the longest match of `tail`, if it is long enough."""
        match = snapshot.match(tail, config.recency_half_life)
        if match is None or match.size < config.min_match:
            return None
        return voted_chain(match, budget, config)

    def add(self, sequences: list[list[int]], prompt_lengths: list[int], config: SuffixConfig) -> None:
        """Replay each row's output against the corpus as it is (learning the odds and recording
        the gain), then add the rows, dropping the oldest sequences beyond `max_corpus_tokens`."""
        with self._lock:
            snapshot = self.snapshot
            if snapshot.num_tokens and self._until_replay == 0:
                for sequence, prompt_length in zip(sequences, prompt_lengths):
                    replayed = self._replay(snapshot, sequence, prompt_length, config)
                    if replayed[0]:
                        self.record.append(replayed)
                self.replayed_calls += 1
                gain = self.gain()
                # Backing off only once a whole record says the corpus does not pay: a workload
                # whose first calls gain nothing may repeat itself from the next ones.
                paid = len(self.record) < RECORD_ROWS or gain is None or gain >= config.min_gain
                self.replay_every = 1 if paid else min(2 * self.replay_every, MAX_REPLAY_EVERY)
                self._until_replay = self.replay_every
            self._until_replay = max(self._until_replay - 1, 0)
            self.snapshot = snapshot.added(sequences, config.max_corpus_tokens)

    def _replay(
        self, snapshot: Snapshot, sequence: list[int], prompt_length: int, config: SuffixConfig
    ) -> tuple[int, int, int]:
        """Walk the output as the loop would have, drafting `MAX_DRAFT` tokens a step with this
        drafter's rule and accepting what the output holds: (steps, tokens prompt lookup's drafts
        would have given at those steps, tokens this drafter's did)."""
        index = _RowIndex(range(config.min_ngram, config.max_ngram + 1), config.max_matches)
        index.extend(sequence[:prompt_length])
        at, end = prompt_length, min(len(sequence), prompt_length + REPLAY_TOKENS)
        steps = by_lookup = ours = 0
        while at < end:
            actual = sequence[at : at + MAX_DRAFT]
            lookup, size, agreement = index.lookup(MAX_DRAFT)
            held = tokens_held(lookup, actual)
            by_lookup += 1 + held
            chain = self.chain(snapshot, sequence[max(0, at - MAX_MATCH) : at], MAX_DRAFT, config)
            if chain is not None and chain.tokens:
                self.odds.observe(chain, actual)
                if expected_tokens(self.odds.chain(chain)) > expected_tokens(context_odds(size, agreement)):
                    held = tokens_held(chain.tokens, actual)
            ours += 1 + held
            steps += 1
            index.extend(sequence[at : at + held + 1])
            at += held + 1
        return steps, by_lookup, ours

    @property
    def num_tokens(self) -> int:
        return self.snapshot.num_tokens

    @property
    def nbytes(self) -> int:
        return self.snapshot.nbytes


_CORPORA: weakref.WeakKeyDictionary[Any, SuffixCorpus] = weakref.WeakKeyDictionary()
_CORPORA_LOCK = threading.Lock()


def corpus_for(model: Any) -> SuffixCorpus:
    """The corpus of `model` (made empty on first use; it goes with the model, held weakly)."""
    with _CORPORA_LOCK:
        corpus = _CORPORA.get(model)
        if corpus is None:
            corpus = _CORPORA[model] = SuffixCorpus(model.config.get_text_config().vocab_size)
        return corpus


def clear_corpora() -> None:
    """Forget every model's corpus (`hf_specdec.clear_cache()`)."""
    with _CORPORA_LOCK:
        _CORPORA.clear()


def bytes_per_token(vocab_size: int) -> int:
    """What the corpus holds per token: its key, its key's position, the token itself."""
    return MAX_MATCH * unit_bytes(vocab_size) + 4 + 4


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


@register_drafter
class SuffixDrafter(Drafter):
    """Prompt lookup plus a per-model corpus of earlier calls' prompts and outputs (module docstring)."""

    name: ClassVar[str] = "suffix"
    supports_sampling: ClassVar[bool] = True  # its drafts are a function of the context: certain
    supports_tree: ClassVar[bool] = True
    draft_cost: ClassVar[DraftCost] = DraftCost.FREE

    def __init__(self, config: SuffixConfig, corpus: SuffixCorpus | None) -> None:
        self.config = config
        self.lookup = NgramDrafter(NgramConfig(config.max_ngram, config.min_ngram, config.max_matches))
        self.corpus = corpus
        # Decided once, at the call's start, from the corpus's record (module docstring).
        self.drafting = corpus is not None and corpus.drafts(config.min_gain)
        self.corpus_drafts = 0  # rows' drafts in this call that the corpus made or added nodes to

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> SuffixDrafter:
        options = options_to_config(SuffixConfig, config.options)
        return cls(options, corpus_for(target) if options.max_corpus_tokens else None)

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.lookup.propose(request)
        if not self.drafting:
            return draft
        snapshot = self.corpus.snapshot
        rows = _Rows.of(draft, len(request.row_ids))
        changed = False
        for b, row_id in enumerate(request.row_ids):
            budget = request.max_tokens[b]
            if budget <= 0:
                continue
            tail = self.lookup.rows[row_id].tokens[-MAX_MATCH:]
            match = snapshot.match(tail, self.config.recency_half_life)
            if match is None or match.size < self.config.min_match:
                continue
            if request.tree:
                grown = corpus_tree(match, budget, self.config, self.corpus.odds)
                if grown:
                    own = list(zip(rows.tokens[b], rows.parents[b], rows.odds[b]))
                    rows.tokens[b], rows.parents[b], rows.odds[b] = merge_trees([own, grown], budget)
                    changed = True
                    self.corpus_drafts += 1
                continue
            chain = voted_chain(match, budget, self.config)
            odds = self.corpus.odds.chain(chain)
            if chain.tokens and expected_tokens(odds) > expected_tokens(rows.odds[b]):
                rows.tokens[b], rows.odds[b] = chain.tokens, odds
                changed = True
                self.corpus_drafts += 1
        return rows.draft(request.tokens.device, request.tree) if changed else draft

    def finish(self, sequences: list[torch.Tensor], prompt_lengths: list[int]) -> None:
        if self.corpus is not None:
            self.corpus.add([s.tolist() for s in sequences], prompt_lengths, self.config)


@dataclass
class _Rows:
    """A draft's rows as lists, to be changed row by row: tokens, parents (a tree's), odds."""

    tokens: list[list[int]]
    parents: list[list[int]]
    odds: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, draft: Draft, batch: int) -> _Rows:
        if not max(draft.lengths, default=0):
            return cls([[] for _ in range(batch)], [[] for _ in range(batch)], [[] for _ in range(batch)])
        tokens, odds = draft.tokens.tolist(), draft.confidence.tolist()
        parents = draft.parents.tolist() if draft.parents is not None else [[] for _ in range(batch)]
        return cls(
            [row[:n] for row, n in zip(tokens, draft.lengths)],
            [row[:n] for row, n in zip(parents, draft.lengths)],
            [row[:n] for row, n in zip(odds, draft.lengths)],
        )

    def draft(self, device: torch.device, tree: bool) -> Draft:
        lengths = [len(row) for row in self.tokens]
        width = max(lengths, default=0)
        if width == 0:
            return Draft.empty(len(lengths), device)

        def padded(rows: list[list[Any]], fill: Any) -> list[list[Any]]:
            return [row + [fill] * (width - len(row)) for row in rows]

        parents = None
        if tree:
            parents = torch.tensor(padded(self.parents, 0), dtype=torch.long).to(device)
        return Draft(
            torch.tensor(padded(self.tokens, 0), dtype=torch.long).to(device),
            lengths,
            confidence=torch.tensor(padded(self.odds, 0.0)).to(device),
            parents=parents,
        )


__all__ = ["SuffixConfig", "SuffixCorpus", "SuffixDrafter", "clear_corpora", "corpus_for"]
