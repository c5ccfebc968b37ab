"""The adaptive draft-length policy, driven with measured costs we choose."""

from __future__ import annotations

import torch

from hf_specdec.drafters.base import Draft
from hf_specdec.policy import AdaptiveDraftLength, FixedDraftLength


def _draft(
    lengths: list[int], confidence: float | list[list[float]] | None = None, sampled: bool = False
) -> Draft:
    width = max(lengths)
    conf = None
    if isinstance(confidence, float):
        conf = torch.full((len(lengths), width), confidence)
    elif confidence is not None:
        conf = torch.tensor(confidence)
    probs = torch.full((len(lengths), width, 8), 1 / 8) if sampled else None
    return Draft(torch.zeros(len(lengths), width, dtype=torch.long), lengths, probs, conf)


def _teach(
    policy: AdaptiveDraftLength, *, batch: int, verify: dict[int, float], accepted_of_4: int, steps: int = 30
):
    """Feed the policy plain steps and 4-token drafts with these costs and this acceptance."""
    for _ in range(steps):
        policy.update(batch, _draft([0] * batch), [0] * batch, 0.0, verify[1])
        policy.update(batch, _draft([4] * batch), [accepted_of_4] * batch, 0.0, verify[5])


CPU_COSTS = {1: 1.0, 5: 1.55}  # verify of 5 tokens ~1.55x one token, as measured on SmolLM2 / CPU


def test_first_step_is_plain_then_explores():
    policy = AdaptiveDraftLength(first_k=4)
    assert policy.draft_length(1) == 0  # measures what plain decoding costs
    policy.update(1, _draft([0]), [0], 0.0, 1.0)
    assert policy.draft_length(1) == 4


def test_speculates_when_drafts_are_accepted():
    policy = AdaptiveDraftLength()
    _teach(policy, batch=1, verify=CPU_COSTS, accepted_of_4=4)
    assert policy.draft_length(1) >= 4


def test_decodes_plainly_when_drafts_never_agree():
    policy = AdaptiveDraftLength()
    _teach(policy, batch=1, verify=CPU_COSTS, accepted_of_4=0)
    assert policy.draft_length(1) == 0


def test_probes_again_with_backoff():
    policy = AdaptiveDraftLength(probe_every=3)
    _teach(policy, batch=1, verify=CPU_COSTS, accepted_of_4=0)
    choices = [policy.draft_length(1) for _ in range(3 + 6 + 1)]
    assert choices == [0, 0, policy.first_k, 0, 0, 0, 0, 0, policy.first_k, 0]


def test_large_batches_where_verify_is_expensive_go_plain():
    policy = AdaptiveDraftLength()
    _teach(policy, batch=1, verify=CPU_COSTS, accepted_of_4=2)
    # Compute-bound at batch 32: verifying w tokens costs w plain steps, so no draft can pay.
    _teach(policy, batch=32, verify={1: 1.0, 5: 5.0}, accepted_of_4=2)
    for width in (2, 3):
        policy.update(32, _draft([width - 1] * 32), [width - 1] * 32, 0.0, float(width))
    assert policy.draft_length(1) > 0
    assert policy.draft_length(32) == 0


def test_verify_cost_is_interpolated_from_plain_and_measured_widths():
    policy = AdaptiveDraftLength()
    _teach(policy, batch=1, verify={1: 1.0, 5: 2.0}, accepted_of_4=2, steps=1)
    assert policy._verify(1, 3) == 1.5
    assert policy._verify(1, 7) > 2.0  # beyond the widest measurement: grows, optimistically


def test_trim_cuts_low_confidence_drafts_and_keeps_confident_ones():
    policy = AdaptiveDraftLength()
    _teach(policy, batch=1, verify=CPU_COSTS, accepted_of_4=2)
    # Teach calibration: confidence 0.95 tokens are always accepted, 0.15 tokens never.
    for _ in range(50):
        policy.update(1, _draft([4], 0.95), [4], 0.0, CPU_COSTS[5])
        policy.update(1, _draft([4], 0.15), [0], 0.0, CPU_COSTS[5])
    assert policy.trim(_draft([4], 0.95), 1).lengths == [4]
    assert policy.trim(_draft([4], 0.15), 1).lengths == [0]


def test_trim_picks_one_width_for_the_batch():
    """Rows share a forward and the batch ends with its slowest row: the rows with most left decide."""
    policy = AdaptiveDraftLength()
    for _ in range(30):
        policy.update(8, _draft([0] * 8), [0] * 8, 0.0, 1.0)
        policy.update(8, _draft([4] * 8), [0] * 8, 0.0, 1.6)
    for _ in range(50):
        policy.update(8, _draft([4] * 8, 0.95), [4] * 8, 0.0, 1.6)
        policy.update(8, _draft([4] * 8, 0.15), [0] * 8, 0.0, 1.6)
    one_unsure = [[0.95] * 4] * 7 + [[0.15] * 4]
    # The unsure row has the most left to do: drafting for the others cannot end the batch sooner.
    assert policy.trim(_draft([4] * 8, one_unsure), 8, remaining=[10] * 7 + [30]).lengths == [0] * 8
    # The unsure row is nearly done: the confident rows set the pace and drafting pays.
    assert policy.trim(_draft([4] * 8, one_unsure), 8, remaining=[30] * 7 + [2]).lengths == [4] * 8
    assert policy.trim(_draft([4] * 8, [[0.95] * 4] * 8), 8).lengths == [4] * 8


def test_no_probing_when_even_perfect_drafts_cannot_pay():
    policy = AdaptiveDraftLength(probe_every=2)
    for _ in range(10):
        policy.update(1, _draft([0]), [0], 0.0, 1.0)
        policy.update(1, _draft([4]), [4], 4.0, 1.5)  # drafting costs a whole step per token
    assert [policy.draft_length(1) for _ in range(20)] == [0] * 20


def test_a_long_catch_up_does_not_make_draft_tokens_look_expensive():
    """The first draft of a call also feeds the draft the whole prompt; tokens after that are cheap."""
    policy = AdaptiveDraftLength()
    first = _draft([4])
    first.catch_up_seconds = 19.8  # the drafter's forward over the prompt
    policy.update(1, _draft([0]), [0], 0.0, 1.0)
    policy.update(1, first, [4], 20.0, 1.5)  # 20 s of drafting: almost all of it the catch-up
    assert abs(policy.draft_cost.value - 0.05) < 1e-9
    assert policy.draft_length(1) > 0


def test_no_probing_when_perfect_drafts_would_gain_too_little():
    # Drafts cost 0.9 of a step per token: even if every one were accepted, 12 of them would gain
    # under 4% (13 tokens for 10.8 + ~1.7 steps), less than a failed probe risks.
    policy = AdaptiveDraftLength(probe_every=2)
    for _ in range(10):
        policy.update(1, _draft([0]), [0], 0.0, 1.0)
        policy.update(1, _draft([4]), [0], 3.6, 1.5)
    assert [policy.draft_length(1) for _ in range(20)] == [0] * 20
    eager = AdaptiveDraftLength(probe_every=2, min_probe_gain=1.02)
    for _ in range(10):
        eager.update(1, _draft([0]), [0], 0.0, 1.0)
        eager.update(1, _draft([4]), [0], 3.6, 1.5)
    assert eager.first_k in [eager.draft_length(1) for _ in range(20)]


def test_sampled_drafts_are_not_cut_by_their_own_tokens():
    """Cutting a sampled draft by its tokens' confidences would bias the output distribution."""
    policy = AdaptiveDraftLength()
    _teach(policy, batch=2, verify=CPU_COSTS, accepted_of_4=3)
    for _ in range(50):
        policy.update(2, _draft([4, 4], [[0.95] * 4, [0.15] * 4]), [4, 0], 0.0, CPU_COSTS[5])
    confident = policy.trim(_draft([4, 4], [[0.95] * 4, [0.95] * 4], sampled=True), 2)
    unsure = policy.trim(_draft([4, 4], [[0.15] * 4, [0.15] * 4], sampled=True), 2)
    assert confident.lengths == unsure.lengths


def test_fixed_length_never_trims():
    policy = FixedDraftLength(3)
    draft = _draft([3, 1], 0.01)
    assert policy.draft_length(8) == 3 and policy.trim(draft, 2) is draft


def test_max_k_beyond_the_default_is_learnt_and_chosen():
    """`max_k` above `MAX_DRAFT` sizes what the policy learns per position (it raised IndexError)."""
    policy = AdaptiveDraftLength(max_k=16)
    policy.update(1, _draft([0]), [0], 0.0, 1.0)
    for _ in range(30):
        policy.update(1, _draft([16]), [16], 0.0, 1.1)
    assert policy.alpha(15) > 0.9
    assert policy.draft_length(1) == 16
