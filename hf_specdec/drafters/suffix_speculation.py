"""The `suffix` drafter's speculation from a corpus match: voted chains, best-first trees, odds.

Given the longest match of the context's last tokens in the corpus (`suffix_array.Match`: its
occurrences and each one's vote, by frequency and recency), the continuation is voted token by
token among the occurrences (`vote`; where they all go on alike, copied at once: `agreed_run`). A
chain (`voted_chain`) follows the winner while the product of its shares of the vote stays at or
above `min_token_prob`, as SuffixDecoding's (Oliaro et al. 2024, arXiv 2411.04975) greedy
speculation; a tree (`corpus_tree`, for `SpeculativeConfig(tree=True)`) grows best-first over the
continuations, as its tree speculation, and is merged with prompt lookup's trie (`merge_trees`).
Each drafted token carries odds of acceptance by the match's size and by how the occurrences agreed,
as `ngram`'s do, learnt across calls from replays of earlier outputs (`CorpusOdds`), so that the
corpus's drafts and prompt lookup's compare on one scale.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.policy.acceptance import PRIOR_WEIGHT, beta_mean
from ..core.tree import kept_parents, node_depths
from .ngram import ALL, ONE, SPLIT, token_odds
from .suffix_array import MAX_MATCH, Match


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


def voted_chain(match: Match, limit: int, min_token_prob: float) -> Chain:
    """Follow the vote token by token while the product of the winners' shares of it stays at or
    above `min_token_prob`, for at most `limit` tokens."""
    snapshot, occurrences, weights = match.snapshot, match.occurrences, match.weights
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
        if probability < min_token_prob:
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
            prior = token_odds(key[0], agreement, first)
            odds = self._odds[key] = beta_mean(self.hits[key], self.trials[key], prior, PRIOR_WEIGHT)
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


Node = tuple[int, int, float]  # a tree node: token, parent (-1: the root's child), odds given its parent


def corpus_tree(
    match: Match, budget: int, depth_limit: int, min_token_prob: float, odds: CorpusOdds
) -> list[Node]:
    """Up to `budget` nodes (token, parent, odds given its parent), likeliest first, grown
    best-first over the continuations of a match (as SuffixDecoding's tree speculation): a node's
    likelihood is the product of its path's odds, the vote's winner at each node taking its
    class's odds and a runner-up those scaled by its weight over the winner's. A node's path is at
    most `depth_limit` deep, and its share of the votes down it at least `min_token_prob`."""
    snapshot, size = match.snapshot, match.size
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
            if child_share < min_token_prob:
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
            else:
                likelihood[node] = max(likelihood[node], own)
            merged.append(node)
            reach.append(own)
    # A node is never likelier than its parent (odds are at most 1), so among equals the shallower
    # first keeps every parent before its children.
    depth = node_depths(parents)
    kept = sorted(range(len(tokens)), key=lambda i: (-likelihood[i], depth[i], i))[:budget]
    out_parents = kept_parents(parents, kept)
    odds = [
        min(1.0, likelihood[i] / likelihood[parents[i]]) if parents[i] >= 0 and likelihood[parents[i]] > 0
        else likelihood[i]
        for i in kept
    ]  # fmt: skip
    return [tokens[i] for i in kept], out_parents, odds
