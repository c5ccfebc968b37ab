"""The decision rule as a table of cases: expected gains, what drafting k tokens costs as the
drafter's cost grows, and the width that finishes the batch soonest."""

from __future__ import annotations

import pytest

from hf_specdec.core.draft import DraftCost
from hf_specdec.core.policy import expected_gains, fastest_width, speedups
from hf_specdec.core.policy.decision import drafting_seconds, steps_needed

FLAT = {w: 1.0 for w in range(1, 40)}.__getitem__
LINEAR = float  # verify(w) = w plain steps: compute-bound
NEARLY_FLAT = {w: 1.0 + 0.01 * (w - 1) for w in range(1, 40)}.__getitem__


@pytest.mark.parametrize(
    "alphas, gains",
    [([], []), ([0.5, 0.5, 0.5], [0.5, 0.75, 0.875]), ([1.0, 0.0, 1.0], [1.0, 1.0, 1.0])],
)
def test_expected_gains_are_the_leviathan_sum(alphas, gains):
    assert expected_gains(alphas) == pytest.approx(gains)


@pytest.mark.parametrize(
    "cost, seconds, k, levels, expected",
    [
        (DraftCost.FREE, 0.3, 16, None, 0.0),  # a look-up: nothing, whatever its length
        (DraftCost.PER_TOKEN, 0.3, 4, None, 1.2),  # a chain: a forward a token
        (DraftCost.PER_TOKEN, 0.3, 6, [1, 1, 1, 1, 2, 2], 0.6),  # a tree: a forward a level
        (DraftCost.PER_TOKEN, 0.3, 9, [1, 2], 0.6),  # sizes past those seen: as deep as the largest
        (DraftCost.PER_BLOCK, 0.3, 1, None, 0.3),  # a block: one forward, whatever its length
        (DraftCost.PER_BLOCK, 0.3, 16, None, 0.3),
        (DraftCost.PER_TOKEN, 0.3, 0, None, 0.0),  # no draft: no forward
        (DraftCost.PER_BLOCK, 0.3, 0, None, 0.0),
    ],
)
def test_drafting_seconds_grow_as_the_drafter_declares(cost, seconds, k, levels, expected):
    assert drafting_seconds(cost, seconds, k, levels) == pytest.approx(expected)


def _per(cost: DraftCost, seconds: float, levels: list[float] | None = None):
    return lambda k: drafting_seconds(cost, seconds, k, levels)


G = expected_gains
FREE, TOKEN, BLOCK = DraftCost.FREE, DraftCost.PER_TOKEN, DraftCost.PER_BLOCK
TREE_GAINS = [0.5, 0.8, 1.1, 1.3, 1.5, 1.7, 1.8, 1.9]
CASES = {
    # name: (rows' gains, drafting, verify, remaining, the width chosen)
    "free drafts, flat verify: the longest": ([G([0.9] * 8)], _per(FREE, 0), FLAT, None, 8),
    "nothing is ever accepted: plain": ([G([0.0] * 8)], _per(FREE, 0), FLAT, None, 0),
    "compute-bound: drafting never pays": ([G([0.9] * 8)], _per(FREE, 0), LINEAR, None, 0),
    "dear tokens: only the likely first": ([G([0.9, 0.3, 0.3])], _per(TOKEN, 0.5), FLAT, None, 1),
    # A block of 16 at 0.85 a token, half a step in one forward: the whole block pays. Priced as
    # 16 forwards of half a step, two tokens would.
    "a long block is one forward": ([G([0.85] * 16)], _per(BLOCK, 0.5), NEARLY_FLAT, None, 16),
    "the same draft priced per token": ([G([0.85] * 16)], _per(TOKEN, 0.5), NEARLY_FLAT, None, 2),
    "a block too dear for its gain: plain": ([G([0.2] * 16)], _per(BLOCK, 0.5), NEARLY_FLAT, None, 0),
    # Rows share a forward and the batch ends with its slowest row: the row with most left decides.
    "the unsure row has most left": ([G([0.95] * 4), G([0.05] * 4)], _per(TOKEN, 0.2), FLAT, [10, 30], 0),
    "the sure row has most left": ([G([0.95] * 4), G([0.05] * 4)], _per(TOKEN, 0.2), FLAT, [30, 2], 4),
    # A tree's gains grow with every node, a chain's flatten out: at 0.1 a node only the tree grows.
    "tree gains": ([[0.5, 0.8, 1.1, 1.4]], _per(TOKEN, 0.1), FLAT, None, 4),
    "chain gains": ([G([0.5] * 4)], _per(TOKEN, 0.1), FLAT, None, 2),
    # Trees two guesses wide, grown a forward a level: eight nodes cost four forwards, not eight.
    "a tree by its depth": ([TREE_GAINS], _per(TOKEN, 0.3, [1, 1, 2, 2, 3, 3, 4, 4]), NEARLY_FLAT, None, 4),
    "the same tree priced by its nodes": ([TREE_GAINS], _per(TOKEN, 0.3), NEARLY_FLAT, None, 1),
}


@pytest.mark.parametrize("name", CASES)
def test_fastest_width(name):
    gains, drafting, verify, remaining, width = CASES[name]
    k, speedup = fastest_width(gains, drafting, verify, remaining)
    assert k == width
    rates = speedups(gains, drafting, verify, remaining)
    assert speedup == (rates[k] if k else 1.0) and (k == 0 or rates[k] == max(rates))


def test_plain_decoding_unless_a_width_beats_it_by_the_margin():
    # One token at 0.02 of a step, accepted 3% of the time: 1.03 tokens for 1.02 steps, 1.01x.
    gains, drafting = [[0.03]], _per(DraftCost.PER_TOKEN, 0.0)
    verify = {1: 1.0, 2: 1.02}.__getitem__
    assert speedups(gains, drafting, verify)[1] == pytest.approx(1.03 / 1.02)
    assert fastest_width(gains, drafting, verify) == (0, 1.0)


@pytest.mark.parametrize(
    "gains, remaining, k, steps",
    [
        ([[1.0, 2.0]], [30], 0, 30.0),  # plain: a token a step
        ([[]], [30], 2, 30.0),  # a row with nothing drafted
        ([[1.0, 2.0]], [30], 5, 10.0),  # a row with fewer tokens than k: its whole draft
        ([[1.0, 3.0], [0.0, 0.0]], [64, 40], 2, 40.0),  # the slowest row, not the one with most left
    ],
)
def test_steps_needed_is_the_slowest_rows(gains, remaining, k, steps):
    assert steps_needed(gains, remaining, k) == pytest.approx(steps)
