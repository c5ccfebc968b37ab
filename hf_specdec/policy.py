"""How many tokens to draft each step: policy, kept apart from the decoding mechanism.

The adaptive policy follows the analysis of Leviathan et al. (2023, §3): with per-position
acceptance α_i (conditional on the earlier draft tokens being accepted), drafting k tokens yields
E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i tokens per target forward and costs k draft steps plus one verify
of k + 1 tokens. It learns α_i, the draft cost per token and the verify cost per width (for the
current batch size) during the call, and

- before drafting, asks for the k that maximises expected tokens per second; k = 0 is plain
  decoding, chosen whenever no draft length is predicted to beat it (it probes again now and then,
  with exponential back-off, so that it notices when drafting pays again);
- after drafting, cuts each row's draft where the drafter's own per-token confidence says the
  remaining tokens are not worth their verify cost. Confidences are calibrated here: per bucket of
  the drafter's score, the policy counts how often such tokens were actually accepted.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

from .drafters.base import Draft

MAX_DRAFT = 12
_BUCKETS = 10


class DraftLengthPolicy(Protocol):
    def draft_length(self, batch_size: int) -> int:
        """Tokens to draft in the coming step (0: decode one token plainly)."""
        ...

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        """Cut a fresh draft to the width worth verifying; `remaining[b]`: tokens row b has left."""
        ...

    def update(
        self, batch_size: int, draft: Draft, accepted: list[int], draft_seconds: float, verify_seconds: float
    ) -> None:
        """Learn from the step just taken: the verified draft, per-row acceptance and the two costs."""
        ...


@dataclass
class FixedDraftLength:
    """Always draft `k` tokens and verify all of them."""

    k: int

    def draft_length(self, batch_size: int) -> int:
        return self.k

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return draft

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds) -> None:
        pass


@dataclass
class _Recent:
    """The median of the last few timings: one stall (page fault, another process) must not
    make a width look expensive for the rest of the call, as it would in a running mean."""

    samples: list[float] = field(default_factory=list)
    keep: int = 5

    def add(self, x: float) -> None:
        self.samples = [*self.samples[-(self.keep - 1) :], x]

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def _beta_mean(hits: float, trials: float, prior: float, weight: float) -> float:
    return (hits + prior * weight) / (trials + weight)


@dataclass
class AdaptiveDraftLength:
    """Cost-aware draft length; its state lives in the object (one per `generate` call by default).

    Args:
        first_k: draft length of the first speculative steps, before anything is measured.
        prior_acceptance, prior_weight: the prior on each α_i, worth `prior_weight` drafts.
        probe_every: plain steps before the first re-probe once plain decoding was chosen.
        min_probe_gain: re-probe only while drafts that are always accepted would be at least this
            much faster than plain decoding at the measured costs (a probe that finds nothing costs
            about a step).
    """

    first_k: int = 4
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 8
    min_probe_gain: float = 1.1
    max_k: int = MAX_DRAFT
    drafted: list[float] = field(default_factory=list)  # per position, sized to max_k
    accepted: list[float] = field(default_factory=list)
    bucket_drafted: list[float] = field(default_factory=lambda: [0.0] * _BUCKETS)
    bucket_accepted: list[float] = field(default_factory=lambda: [0.0] * _BUCKETS)
    draft_cost: _Recent = field(default_factory=_Recent)  # seconds per drafted position
    verify_cost: dict[tuple[int, int], _Recent] = field(default_factory=dict)  # (batch, width) -> seconds
    plain_run: int = 0
    backoff: int = 1

    def __post_init__(self) -> None:
        for counts in (self.drafted, self.accepted):
            counts.extend([0.0] * (self.max_k - len(counts)))

    def draft_length(self, batch_size: int) -> int:
        plain = self._verify(batch_size, 1)
        if plain is None:
            return 0  # measure a plain step first: it is what generate would have done anyway
        draft_cost = self.draft_cost.value or 0.0
        # Even drafts that are always accepted must gain enough for what drafting and verifying
        # cost here, or probing (a step's cost of its own, plus the draft's catch-up) cannot pay.
        _, perfect = self._best_width(batch_size, [[1.0] * self.max_k], draft_cost)
        if not self._measured_wide():
            # Nothing verified wider than a plain step yet: explore, unless the drafter's up-front
            # timing (`expect_draft_cost`) already says drafting cannot pay.
            return self.first_k if perfect >= self.min_probe_gain else 0
        alphas = [self.alpha(i) for i in range(self.max_k)]
        best_k, _ = self._best_width(batch_size, [alphas], draft_cost)
        if best_k == 0:
            if perfect < self.min_probe_gain:
                return 0
            self.plain_run += 1
            if self.plain_run >= self.probe_every * self.backoff:
                self.plain_run = 0
                self.backoff = min(self.backoff * 2, 64)
                return self.first_k
        else:
            self.plain_run, self.backoff = 0, 1
        return best_k

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        """A first figure for what a draft token costs, timed by the drafter before any drafting
        (`Drafter.probe_seconds`); measured drafts replace it within a few steps. Ignored once
        drafts have been measured (a policy kept across calls)."""
        if self.draft_cost.value is None:
            self.draft_cost.add(seconds_per_token)

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        if self._verify(batch_size, 1) is None or not self._measured_wide():
            return draft
        if draft.probs is not None or draft.confidence is None:
            # A sampled draft must not be cut by its own tokens' confidences: keeping token i only
            # when it looks likely would bias which tokens reach the acceptance test, and the
            # output would no longer follow the target's distribution. Cut by position alone.
            alphas = [self.alpha(i) for i in range(self.max_k)]
            rows = [alphas[:n] for n in draft.lengths]
        else:
            rows = [
                [self.calibrated(c) for c in row[:n]]
                for row, n in zip(draft.confidence.tolist(), draft.lengths)
            ]
        # Rows share one forward, so they share its width: pick the width that pays for the batch.
        width, _ = self._best_width(batch_size, rows, 0.0, remaining)  # drafting is already paid for
        lengths = [min(n, width) for n in draft.lengths]
        return draft.truncated(lengths) if lengths != draft.lengths else draft

    def _best_width(
        self, batch_size: int, rows: list[list[float]], draft_cost: float, remaining: list[int] | None = None
    ) -> tuple[int, float]:
        """The draft width k that finishes the batch soonest (0 means plain decoding), and how
        much sooner than plain decoding (a ratio of times; 1.0 when k is 0).

        `rows` holds each row's α list; row b drafts min(k, len(rows[b])) tokens and has
        `remaining[b]` tokens left to generate. A step advances row b by 1 + g_b(k) expected
        tokens, so the batch needs about max_b remaining_b / (1 + g_b(k)) more steps: drafting
        pays only where it speeds up the rows that have the most left to do. With one row this
        is the tokens-per-second rule of Leviathan et al.
        """
        remaining = remaining or [1] * len(rows)
        gains = []  # gains[b][k-1]: expected tokens row b gains from its first k draft tokens
        for alphas in rows:
            survive, total, row_gains = 1.0, 0.0, []
            for alpha in alphas:
                survive *= alpha
                total += survive
                row_gains.append(total)
            gains.append(row_gains)
        plain_time = max(remaining) * self._verify(batch_size, 1)
        best_k, best_time = 0, plain_time
        for k in range(1, max((len(a) for a in rows), default=0) + 1):
            steps = max(r / (1.0 + (g[min(k, len(g)) - 1] if g else 0.0)) for r, g in zip(remaining, gains))
            time = steps * (k * draft_cost + self._verify(batch_size, k + 1))
            if time * 1.02 < best_time:  # a 2% margin: noise must not flip us into a loss
                best_k, best_time = k, time
        return best_k, plain_time / best_time

    def alpha(self, position: int) -> float:
        """Estimated acceptance of draft position `position` (0-based), given the earlier ones."""
        return _beta_mean(
            self.accepted[position], self.drafted[position], self.prior_acceptance, self.prior_weight
        )

    def calibrated(self, confidence: float) -> float:
        """Acceptance observed for draft tokens whose drafter confidence fell in this bucket."""
        bucket = min(int(confidence * _BUCKETS), _BUCKETS - 1)
        prior = (bucket + 0.5) / _BUCKETS
        return _beta_mean(self.bucket_accepted[bucket], self.bucket_drafted[bucket], prior, self.prior_weight)

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds) -> None:
        width = 1 + max(draft.lengths, default=0)
        self.verify_cost.setdefault((batch_size, width), _Recent()).add(verify_seconds)
        if width > 1:
            self.draft_cost.add(max(draft_seconds - draft.catch_up_seconds, 0.0) / (width - 1))
        scores = draft.confidence.tolist() if draft.confidence is not None else None
        for b, (d, a) in enumerate(zip(draft.lengths, accepted)):
            # Position i was tested only if every earlier draft token was accepted.
            for i in range(min(d, a + 1, self.max_k)):
                self.drafted[i] += 1
                self.accepted[i] += i < a
                if scores is not None:
                    bucket = min(int(scores[b][i] * _BUCKETS), _BUCKETS - 1)
                    self.bucket_drafted[bucket] += 1
                    self.bucket_accepted[bucket] += i < a

    def _measured_wide(self) -> bool:
        """Whether any verify of a draft has been timed (at any batch size: the nearest stands in)."""
        return any(w > 1 for (_, w) in self.verify_cost)

    def _verify(self, batch_size: int, width: int) -> float | None:
        """Predicted verify seconds at this width, from the nearest measured widths."""
        known = {w: e.value for (b, w), e in self.verify_cost.items() if b == batch_size}
        if not known:
            sizes = sorted({b for b, _ in self.verify_cost}, key=lambda b: abs(b - batch_size))
            if not sizes:
                return None
            known = {w: e.value for (b, w), e in self.verify_cost.items() if b == sizes[0]}
        if width in known:
            return known[width]
        if width == 1 or 1 not in known:
            return None
        # Interpolate between measured widths (a plain step included). Guessing low is safe: the
        # width then gets tried and measured; guessing high would keep it from ever being tried.
        below = [w for w in known if w < width]
        above = [w for w in known if w > width]
        if below and above:
            lo, hi = max(below), min(above)
            t = (width - lo) / (hi - lo)
            return known[lo] * (1 - t) + known[hi] * t
        # Beyond what was measured: assume verify cost keeps growing by 3% of a plain step per token.
        edge = max(below)
        return known[edge] + 0.03 * known[1] * (width - edge)


__all__ = ["AdaptiveDraftLength", "DraftLengthPolicy", "FixedDraftLength"]
