"""How many tokens to draft each step: policy, kept apart from the decoding mechanism.

The adaptive policy follows the analysis of Leviathan et al. (2023, §3): with per-position
acceptance α_i (conditional on the earlier draft tokens being accepted), drafting k tokens yields
E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i tokens per target forward and costs k draft steps plus one verify
of k + 1 tokens. It learns α_i, the draft cost per token and the verify cost per width (for the
current batch size) during the call and drafts the k that maximises tokens per second; k = 0 is
plain decoding, chosen whenever no draft length is predicted to beat it. While decoding plainly it
probes again now and then (with exponential back-off) so that it notices when drafting pays again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MAX_DRAFT = 12


class DraftLengthPolicy(Protocol):
    def draft_length(self, batch_size: int) -> int:
        """Tokens to draft in the coming step (0: decode one token plainly)."""
        ...

    def update(
        self,
        batch_size: int,
        drafted: list[int],
        accepted: list[int],
        draft_seconds: float,
        verify_seconds: float,
    ) -> None:
        """Learn from the step just taken: per-row drafted/accepted counts and its two costs."""
        ...


@dataclass
class FixedDraftLength:
    """Always draft `k` tokens."""

    k: int

    def draft_length(self, batch_size: int) -> int:
        return self.k

    def update(self, batch_size, drafted, accepted, draft_seconds, verify_seconds) -> None:
        pass


@dataclass
class _Ema:
    value: float | None = None

    def add(self, x: float, weight: float = 0.3) -> None:
        self.value = x if self.value is None else (1 - weight) * self.value + weight * x


@dataclass
class AdaptiveDraftLength:
    """Cost-aware draft length; its state lives in the object (one per `generate` call by default).

    Args:
        first_k: draft length of the first speculative steps, before anything is measured.
        prior_acceptance, prior_weight: the Beta-style prior on each α_i, worth `prior_weight` drafts.
        probe_every: plain steps before the first re-probe once plain decoding was chosen.
    """

    first_k: int = 4
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 8
    max_k: int = MAX_DRAFT
    drafted: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)
    accepted: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)
    draft_cost: _Ema = field(default_factory=_Ema)  # seconds per drafted position
    verify_cost: dict[tuple[int, int], _Ema] = field(default_factory=dict)  # (batch, width) -> seconds
    plain_run: int = 0
    backoff: int = 1

    def draft_length(self, batch_size: int) -> int:
        plain = self._verify(batch_size, 1)
        if plain is None:
            return 0  # measure a plain step first: it is what generate would have done anyway
        if not any(w > 1 for (b, w) in self.verify_cost if b == batch_size):
            return self.first_k  # nothing measured beyond plain steps at this batch size: explore
        best_k, best_rate = 0, 1.0 / plain
        expected, survive = 1.0, 1.0
        for k in range(1, self.max_k + 1):
            survive *= self.alpha(k - 1)
            expected += survive
            cost = k * (self.draft_cost.value or 0.0) + self._verify(batch_size, k + 1)
            if expected / cost > best_rate * 1.02:  # a 2% margin: noise must not flip us into a loss
                best_k, best_rate = k, expected / cost
        if best_k == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_every * self.backoff:
                self.plain_run = 0
                self.backoff = min(self.backoff * 2, 64)
                return self.first_k
        else:
            self.plain_run, self.backoff = 0, 1
        return best_k

    def alpha(self, position: int) -> float:
        """Estimated acceptance of draft position `position` (0-based), given the earlier ones."""
        d, a = self.drafted[position], self.accepted[position]
        return (a + self.prior_acceptance * self.prior_weight) / (d + self.prior_weight)

    def update(self, batch_size, drafted, accepted, draft_seconds, verify_seconds) -> None:
        width = 1 + max(drafted, default=0)
        self.verify_cost.setdefault((batch_size, width), _Ema()).add(verify_seconds)
        if width > 1:
            self.draft_cost.add(draft_seconds / (width - 1))
        for d, a in zip(drafted, accepted):
            for i in range(min(d, self.max_k)):
                self.drafted[i] += 1
                if i < a:
                    self.accepted[i] += 1

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
        step = 0.03 * known[1]
        return known[edge] + step * (width - edge)
