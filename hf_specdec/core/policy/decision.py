"""The decision rule, pure functions: expected tokens per second for each draft width, from what
each draft position (or tree node) adds and what drafting and verifying that width cost
(Leviathan et al. 2023, §3: a step yields 1 + Σ_{j≤k} Π_{i≤j} α_i tokens)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

from ..draft import DraftCost

# A width must look this much faster than plain decoding to be chosen: noise in the figures must
# not flip a step into a loss. Between draft widths the faster one is taken as it is.
PLAIN_MARGIN = 1.02
Gains, Seconds = list[list[float]], Callable[[int], float]  # per row, gains by width; seconds by width
Remaining = list[int] | None  # per row, the tokens it has left to generate


def expected_gains(alphas: list[float]) -> list[float]:
    """gains[k - 1]: tokens the first k draft tokens add in expectation, Σ_{j≤k} Π_{i≤j} α_i."""
    return list(itertools.accumulate(itertools.accumulate(alphas, operator.mul)))


def drafting_seconds(cost: DraftCost, seconds: float, k: int, levels: list[float] | None = None) -> float:
    """Drafting k tokens (nodes): nothing for a look-up, `seconds` for a block of any length, and a
    chain's `seconds` a forward a token, a tree's a forward a level (`levels[k - 1]`)."""
    if k == 0 or cost is DraftCost.FREE:
        return 0.0
    if cost is DraftCost.PER_BLOCK:
        return seconds
    return seconds * (levels[min(k, len(levels)) - 1] if levels else k)


def speedups(gains: Gains, drafting: Seconds, verify: Seconds, remaining: Remaining = None) -> list[float]:
    """speedups[k]: how much sooner the batch ends drafting k tokens a step than decoding plainly.
    Row b's step adds 1 + gains[b][k - 1] tokens (a row with fewer on offer drafts them all) and costs
    `drafting(k)` plus `verify(k + 1)`, a forward of k + 1 tokens a row; the batch ends with its row
    that needs the most steps for its `remaining` tokens, so only speeding that row up pays."""
    remaining = remaining or [1] * len(gains)
    plain = max(remaining) * verify(1)
    out = [1.0]
    for k in range(1, max((len(g) for g in gains), default=0) + 1):
        out.append(plain / (steps_needed(gains, remaining, k) * (drafting(k) + verify(k + 1))))
    return out


def steps_needed(gains: Gains, remaining: list[int], k: int) -> float:
    """Steps the batch takes for its `remaining` tokens drafting k a step: its slowest row's."""
    return max(r / (1.0 + (g[min(k, len(g)) - 1] if g and k else 0.0)) for r, g in zip(remaining, gains))


def fastest_width(
    gains: Gains,
    drafting: Seconds,
    verify: Seconds,
    remaining: Remaining = None,
    margin: float = PLAIN_MARGIN,
) -> tuple[int, float]:
    """(k, speedup) of the fastest width; (0, 1.0) unless it beats plain decoding by `margin`."""
    rates = speedups(gains, drafting, verify, remaining)
    k = max(range(len(rates)), key=rates.__getitem__)
    return (k, rates[k]) if k and rates[k] > margin else (0, 1.0)
