"""Acceptance estimates: α per position and per confidence bucket, β per tree node, one prior."""

from __future__ import annotations

import pytest

from hf_specdec.core.policy import (
    PRIOR_ACCEPTANCE,
    PRIOR_WEIGHT,
    AcceptanceEstimate,
    TreeAcceptance,
    beta_mean,
)
from hf_specdec.core.policy.adaptive import AdaptiveSettings


def test_acceptance_starts_at_the_prior_and_counts_only_tested_positions():
    estimate = AcceptanceEstimate(max_k=4, prior_acceptance=0.5, prior_weight=2.0)
    assert estimate.alphas() == [0.5] * 4
    # Row 0: 3 drafted, 1 accepted -> positions 0 (accepted) and 1 (rejected) were tested, 2 was not.
    # Row 1: 2 drafted, both accepted.
    estimate.observe([3, 2], [1, 2])
    assert estimate.drafted == [2, 2, 0, 0] and estimate.accepted == [2, 1, 0, 0]
    assert estimate.alpha(0) == pytest.approx((2 + 1) / (2 + 2))
    assert estimate.alpha(1) == pytest.approx((1 + 1) / (2 + 2))
    assert estimate.alpha(2) == 0.5


def test_acceptance_calibrates_confidence_per_bucket():
    estimate = AcceptanceEstimate(prior_weight=2.0)
    assert estimate.calibrated(0.93) == pytest.approx(0.95)  # the bucket's middle before any data
    for _ in range(8):
        estimate.observe([2], [0], [[0.93, 0.2]])  # confident, yet rejected; position 1 never tested
    assert estimate.calibrated(0.91) == pytest.approx((0 + 0.95 * 2) / (8 + 2))
    assert estimate.calibrated(0.25) == pytest.approx(0.25)
    assert estimate.calibrated(1.0) == estimate.calibrated(0.95)  # 1.0 falls in the top bucket


def test_acceptance_calibrates_first_and_later_draft_tokens_apart():
    # An n-gram match: one score for every token; the first is often wrong, the rest rarely.
    estimate = AcceptanceEstimate(prior_weight=2.0)
    for _ in range(40):
        estimate.observe([4], [0], [[0.5] * 4])  # the repeat did not start
    for _ in range(10):
        estimate.observe([4], [4], [[0.5] * 4])  # it did, and went on
    first, later = estimate.calibrated(0.5, 0), estimate.calibrated(0.5, 1)
    assert first == pytest.approx((10 + 0.55 * 2) / (50 + 2))
    # The three later tokens of a draft held together: one trial each time, not three.
    assert later == pytest.approx((10 + 0.55 * 2) / (10 + 2))


def test_a_drafts_later_tokens_count_as_one_trial_of_their_bucket():
    """Later tokens hold or fail together: one long copy that held must not make every later
    token look near certain (an open answer: one 5-token copy held, then drafts of 16 tokens were
    verified at 0.92 a token and lost), nor one that failed at its second token look hopeless."""
    estimate = AcceptanceEstimate(prior_weight=2.0)
    estimate.observe([16], [16], [[0.9] + [0.75] * 15])
    assert estimate.calibrated(0.75, 1) == pytest.approx((1 + 0.75 * 2) / (1 + 2))  # 0.83, not 0.97
    estimate.observe([16], [1], [[0.9] + [0.75] * 15])  # held once, then failed at its second token
    assert estimate.calibrated(0.75, 1) == pytest.approx((1 + 0.75 * 2) / (2 + 2))
    assert estimate.alpha(1) == pytest.approx((1 + 0.6 * 2) / (2 + 2))  # per position: as before


def test_tree_acceptance_counts_nodes_on_the_accepted_path():
    trees = TreeAcceptance(max_k=4, prior_acceptance=0.6, prior_weight=2.0)
    assert not trees.observed and trees.betas() == pytest.approx([0.6] * 4)
    # Row 0: 3 nodes, path 0-2; row 1: 2 nodes, nothing accepted.
    trees.observe([3, 2], [[0, 2], []])
    assert trees.drafted == [2, 2, 1, 0] and trees.on_path == [1, 0, 1, 0]
    b0 = (1 + 0.6 * 2) / (2 + 2)
    b1 = (0 + b0 * 2) / (2 + 2)  # each prior is the node before's estimate
    b2 = (1 + b1 * 2) / (1 + 2)
    assert trees.betas() == pytest.approx([b0, b1, b2, b2])  # node 3, never drafted: as node 2
    assert trees.gains() == pytest.approx([b0, b0 + b1, b0 + b1 + b2, b0 + b1 + 2 * b2])


def test_tree_nodes_a_drafter_gives_odds_for_start_from_their_odds_down_the_path():
    trees = TreeAcceptance(max_k=4, prior_acceptance=0.6, prior_weight=2.0)
    trees.observe([1], [[0]])  # one node drafted and accepted
    odds, parents = [0.5, 0.8, 0.5, 0.9], [-1, 0, -1, 1]  # 0 - 1 - 3 | 2
    on_path = [0.5, 0.5 * 0.8, 0.5, 0.5 * 0.8 * 0.9]
    b0 = (1 + on_path[0] * 2) / (1 + 2)
    assert trees.betas(odds, parents) == pytest.approx([b0, *on_path[1:]])  # not each as likely as node 0
    assert trees.gains(odds[:2], parents[:2]) == pytest.approx([b0, b0 + on_path[1]])


def test_tree_levels_count_the_depth_of_each_prefix():
    trees = TreeAcceptance(max_k=6)
    four_roots = [-1, -1, -1, -1, 0, 1]
    trees.observe([6, 3], [[0, 4], []], [four_roots, four_roots])
    # Prefixes of 1-4 nodes are one level deep, 5-6 two; sizes never drafted: as the largest.
    assert trees.levels() == pytest.approx([1, 1, 1, 1, 2, 2])
    chain = TreeAcceptance(max_k=4)
    chain.observe([2], [[0]])  # no parents: a chain, one level per node
    assert chain.levels() == pytest.approx([1, 2, 2, 2])


def test_every_estimate_of_acceptance_starts_from_the_one_prior():
    from hf_specdec.drafters.ngram import _TrieOdds

    assert (PRIOR_ACCEPTANCE, PRIOR_WEIGHT) == (0.6, 2.0)
    for owner in (AdaptiveSettings(), AcceptanceEstimate(), TreeAcceptance()):
        assert (owner.prior_acceptance, owner.prior_weight) == (PRIOR_ACCEPTANCE, PRIOR_WEIGHT)
    assert (
        AcceptanceEstimate().alpha(0) == TreeAcceptance().betas()[0] == _TrieOdds().alpha == PRIOR_ACCEPTANCE
    )
    assert beta_mean(1, 2) == (1 + 0.6 * 2) / (2 + 2)
