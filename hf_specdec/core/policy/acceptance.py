"""Acceptance estimates, each the mean of a Beta posterior from one prior: α per draft position
and per bucket of a drafter's confidence (chains), β per node (trees)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..tree import node_depths

MAX_DRAFT = 16
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 2.0  # the prior's mean, and what it weighs in drafts
_BUCKETS = 10


def beta_mean(
    hits: float, trials: float, prior: float = PRIOR_ACCEPTANCE, weight: float = PRIOR_WEIGHT
) -> float:
    """The one estimate of an acceptance rate, here and in the drafters."""
    return (hits + prior * weight) / (trials + weight)


@dataclass(eq=False)
class _Estimate:
    """Estimates for the first `max_k` draft positions (tree nodes), each rate from this prior."""

    max_k: int = MAX_DRAFT
    prior_acceptance: float = PRIOR_ACCEPTANCE
    prior_weight: float = PRIOR_WEIGHT


@dataclass(eq=False)
class AcceptanceEstimate(_Estimate):
    """α_i per draft position (given the ones before held) and, per bucket of the drafter's
    confidence, how often such tokens held, a draft's first token apart from its later ones."""

    def __post_init__(self) -> None:
        self.drafted, self.accepted = [0.0] * self.max_k, [0.0] * self.max_k  # per position
        self.bucket_drafted, self.bucket_accepted = [0.0] * 2 * _BUCKETS, [0.0] * 2 * _BUCKETS  # `_bucket`

    def alpha(self, position: int, prior: float | None = None) -> float:
        """α at a 0-based position; `prior`: what it is before that position was seen."""
        prior = self.prior_acceptance if prior is None else prior
        return beta_mean(self.accepted[position], self.drafted[position], prior, self.prior_weight)

    def alphas(self) -> list[float]:
        return [self.alpha(i) for i in range(self.max_k)]

    def calibrated(self, confidence: float, position: int = 0) -> float:
        bucket = _bucket(confidence, position)
        prior = (bucket % _BUCKETS + 0.5) / _BUCKETS
        return beta_mean(self.bucket_accepted[bucket], self.bucket_drafted[bucket], prior, self.prior_weight)

    def observe(
        self, lengths: list[int], accepted: list[int], confidence: list[list[float]] | None = None
    ) -> None:
        """Row b drafted `lengths[b]` tokens (a tree: its depth) and had `accepted[b]` accepted."""
        for b, (d, a) in enumerate(zip(lengths, accepted)):
            tested = min(d, a + 1, self.max_k)  # position i is tested only if those before held
            for i in range(tested):
                self.drafted[i] += 1
                self.accepted[i] += i < a
                if confidence is not None:  # later tokens hold or fail together: one trial, not many
                    weight, bucket = 1.0 if i == 0 else 1.0 / (tested - 1), _bucket(confidence[b][i], i)
                    self.bucket_drafted[bucket] += weight
                    self.bucket_accepted[bucket] += weight * (i < a)


def _bucket(confidence: float, position: int) -> int:
    return min(int(confidence * _BUCKETS), _BUCKETS - 1) + (_BUCKETS if position > 0 else 0)


@dataclass(eq=False)
class TreeAcceptance(_Estimate):
    """β_i: how often node i (best first) lies on the accepted path; a tree's first n nodes add
    Σ_{i<n} β_i tokens (`gains`) and reach `levels()[n - 1]` levels deep."""

    def __post_init__(self) -> None:
        self.drafted, self.on_path = [0.0] * self.max_k, [0.0] * self.max_k  # per node index
        self.depth_sums = [0.0] * self.max_k  # per n - 1: summed depth of the first n nodes

    @property
    def observed(self) -> bool:
        return self.drafted[0] > 0

    def betas(self, odds: list[float] | None = None, parents: list[int] | None = None) -> list[float]:
        """β per node as trees so far measured it at its place, from a prior: where the drafter
        gives each node's `odds` given its parent held, its odds of lying on the accepted path (its
        own times its parent's, down the tree's `parents`; as many nodes as it gives), else as
        likely as the node before it (optimistic: a tree grows to find out)."""
        if odds is not None and parents is not None:
            path: list[float] = []
            for p, parent in zip(odds, parents):
                path.append(p * (path[parent] if parent >= 0 else 1.0))
            return [
                beta_mean(h, n, p, self.prior_weight) for h, n, p in zip(self.on_path, self.drafted, path)
            ]
        prior = self.prior_acceptance
        return [
            prior := beta_mean(hits, n, prior, self.prior_weight)
            for hits, n in zip(self.on_path, self.drafted)
        ]

    def gains(self, odds: list[float] | None = None, parents: list[int] | None = None) -> list[float]:
        return list(itertools.accumulate(self.betas(odds, parents)))

    def levels(self) -> list[float]:
        """levels[n - 1]: the first n nodes' depth; a size never drafted as deep as the largest drafted."""
        last = 1.0
        return [
            last := depth / trials if trials else last for depth, trials in zip(self.depth_sums, self.drafted)
        ]

    def observe(
        self, lengths: list[int], paths: list[list[int]], parents: list[list[int]] | None = None
    ) -> None:
        """Row b verified `lengths[b]` nodes (parents -1 at the root; None: a chain), accepted `paths[b]`."""
        for b, (n, path) in enumerate(zip(lengths, paths)):
            counted = min(n, self.max_k)
            row = parents[b][:counted] if parents is not None else list(range(-1, counted - 1))
            for i, depth in enumerate(itertools.accumulate(node_depths(row), max)):  # of the first i + 1
                self.drafted[i] += 1
                self.depth_sums[i] += depth
                self.on_path[i] += i in path
