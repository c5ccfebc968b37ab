"""The cost model: widths read off the widths timed, padding, stalls, one-offs, and what earlier
calls carried, a prior that timings which keep disagreeing with it replace."""

from __future__ import annotations

import math

import pytest

from hf_specdec.core.policy import CostModel
from hf_specdec.core.policy.costs import context_bucket
from hf_specdec.core.verify_shape import VerifyShape
from tests.helpers.policy import power_law

FLAT = {w: 1.0 + 0.01 * (w - 1) for w in range(1, 18)}
LINEAR = {w: 1.0 + 0.6 * (w - 1) for w in range(1, 18)}
COMPILED = VerifyShape(widths=(1, 2, 4, 8, 16), feeds_holes=False, fixed_batch=True)


def _measured(costs: dict[int, float], times: int = 3, batch: int = 1, shape: VerifyShape | None = None):
    model = CostModel(shape=shape or VerifyShape())
    for _ in range(times):
        for width, seconds in costs.items():
            model.add_verify(batch, width, seconds)
    return model


def _after(*calls: CostModel) -> CostModel:
    """A fresh call's costs, carried from the last of `calls`, each of which carried the one before."""
    last = None
    for measured in calls:
        fresh = CostModel(shape=measured.shape, bucket=measured.bucket)
        fresh.carry(last)
        for (batch, width), timings in measured.times.items():
            for seconds in timings.samples:
                fresh.add_verify(batch, width, seconds)
        last = fresh
    carried = CostModel(shape=last.shape, bucket=last.bucket)
    carried.carry(last)
    return carried


def test_widths_are_interpolated_and_extrapolated_from_those_timed_only():
    costs = CostModel()
    assert costs.verify(1, 1) is None and not costs.measured_wide()
    costs.add_verify(1, 1, 2.0)
    assert costs.verify(1, 5) == 2.0  # only plain steps timed: flat, the low guess
    costs.add_verify(1, 5, 4.0)
    assert costs.measured_wide()
    between = power_law(3, (1, 2.0), (5, 4.0))  # 3.21: along the power law through the two
    assert costs.verify(1, 3) == pytest.approx(between)
    assert costs.verify(1, 25) == pytest.approx(4.0 * 5 ** (math.log(2) / math.log(5)))  # beyond
    assert _measured({1: 2000.0, 5: 4000.0}, 1).verify(1, 25) == pytest.approx(1000 * costs.verify(1, 25))
    # Another batch size borrows the nearest timed one until it has its own.
    assert costs.verify(4, 3) == pytest.approx(between)
    costs.add_verify(4, 1, 5.0)
    # Its own plain step only: the nearest batch size's curve, scaled by the two plain steps (not
    # flat, which let a compute-bound batch verify wide drafts each time rows finished).
    assert costs.verify(4, 3) == pytest.approx(between * 5.0 / 2.0)
    costs.add_verify(4, 3, 6.0)
    assert costs.verify(4, 3) == 6.0  # then its own


def test_between_timed_widths_a_curve_that_bends_down_is_not_guessed_low():
    """fp32 SmolLM2 on an AVX2-only EPYC (`concave`): with plain steps and width 11 timed, width 3
    within 15% of what it costs; a straight chord guessed it at 0.75 of that, and weak drafts
    were verified there at a loss."""
    from hf_specdec.bench.regimes import PROFILES, Forward

    profile = PROFILES["concave"]
    cost = {w: profile.seconds(Forward(1, w, 200)) / profile.step for w in (1, 3, 11)}
    assert _measured({1: cost[1], 11: cost[11]}).verify(1, 3) == pytest.approx(cost[3], rel=0.15)
    assert cost[1] + (cost[11] - cost[1]) * 2 / 10 < 0.8 * cost[3]


def test_extrapolation_is_never_falling_nor_faster_than_linear():
    assert _measured({1: 1.0, 3: 0.9}, 1).verify(1, 9) == 0.9  # the wider step timed faster: noise
    assert _measured({1: 1.0, 2: 3.0}, 2).verify(1, 8) == pytest.approx(12.0)  # in proportion at most


def test_a_width_timed_once_far_above_the_curve_is_a_stall_until_timed_again():
    costs = _measured({1: 1.0, 9: 1.1})
    costs.add_verify(1, 5, 4.0)  # another process held the CPU
    assert costs.verify(1, 5) == pytest.approx(power_law(5, (1, 1.0), (9, 1.1)))
    costs.add_verify(1, 5, 1.05)
    assert costs.verify(1, 5) == 1.05  # of two timings, the smaller


def test_plain_steps_cost_no_more_than_the_narrowest_wider_width_timed():
    costs = _measured({1: 3.0, 2: 1.0, 9: 1.1})  # plain steps timed in a stall, never again
    assert costs.verify(1, 1) == 1.0


def test_draft_costs_are_the_recent_median():
    costs = CostModel()
    assert costs.draft.value is None
    for seconds in (0.1, 0.1, 5.0, 0.1):
        costs.draft.add(seconds)
    assert costs.draft.value == 0.1


def test_padded_widths_are_timed_and_priced_as_the_width_fed():
    """A compiled static cache feeds a 5-token draft (width 6) at width 8: that timing is width 8's,
    and widths 5 to 8 all cost what width 8 costs."""
    costs = _measured({1: 1.0, 6: 2.0}, 1, shape=COMPILED)
    assert set(costs.times) == {(1, 1), (1, 8)}
    assert [costs.verify(1, w) for w in (5, 6, 7, 8)] == [2.0] * 4
    assert costs.verify(1, 3) == costs.verify(1, 4) < 2.0  # interpolated at width 4, not 3


# --- one-offs: a width's first call in a call ---


def _oneoffs(*widths: int, oneoff: float = 6.0) -> CostModel:
    """Flat costs whose first timing at each of `widths` paid `oneoff` more."""
    costs = CostModel()
    for width in widths:
        for seconds in (FLAT[width] + oneoff, FLAT[width], FLAT[width]):
            costs.add_verify(1, width, seconds)
    return costs


def test_a_first_calls_excess_is_learnt_and_spread_over_the_steps_a_width_serves():
    costs = _oneoffs(1, 2, 3)
    assert costs.one_offs[False].confirmed and costs.first_call_seconds(1, 7) == pytest.approx(6.0)
    assert costs.new_shapes_are_dear() and costs.first_call_seconds(1, 3) == 0.0  # paid for
    steady = costs.verify(1, 7)
    assert costs.feeding(1)(7) == (7, pytest.approx(steady + 6.0 / 8))
    assert costs.feeding(1, steps_left=lambda width: 3.5)(7)[1] == pytest.approx(steady + 6.0 / 3)
    assert costs.feeding(1, steps_left=lambda width: 0.5)(7)[1] == pytest.approx(steady + 6.0)
    assert costs.feeding(1, steps_left=lambda width: 0.5)(2) == (2, costs.verify(1, 2))
    never = lambda width: pytest.fail("steps left asked where no one-off is owed")  # noqa: E731
    assert costs.feeding(1, never)(2) == (2, costs.verify(1, 2))  # paid for
    assert _measured(FLAT).feeding(1, never)(7) == (7, _measured(FLAT).verify(1, 7))  # no one-offs
    assert not _measured(FLAT).new_shapes_are_dear()


def test_a_width_with_a_oneoff_is_fed_at_a_wider_width_paid_for_where_holes_are_fed():
    costs = _oneoffs(1, 2, 17)
    assert costs.feeding(1)(7) == (17, costs.verify(1, 17))
    assert costs.feeding(1, widen=False)(7)[0] == 7  # a tree: its nodes past its own are no holes
    costs.begin(VerifyShape(feeds_holes=False), 0)  # a cache that feeds no holes
    assert costs.feeding(1)(7)[0] == 7


def test_one_offs_paid_once_a_process_leave_earlier_calls_widths_paid_for():
    earlier = _oneoffs(1, 2, 9)
    process, call = CostModel(), CostModel()
    process.carry(earlier)
    process.add_verify(1, 1, 1.0)
    assert process.first_call_seconds(1, 9) == 0.0 and process.first_call_seconds(1, 5) == 6.0
    call.carry(earlier)  # in a process whose widths cost the one-off again in every call
    for width in (1, 2, 9):
        for seconds in (FLAT[width] + 6.0, FLAT[width]):
            call.add_verify(1, width, seconds)
    assert call.one_offs[True].confirmed and call.first_call_seconds(1, 17) == 6.0


# --- the prior: what earlier calls measured ---


def test_a_call_starts_from_the_ratios_earlier_calls_measured_at_its_own_plain_step():
    costs = _after(_measured({1: 1.0, 5: 2.0, 9: 2.5}))
    assert costs.measured_wide()  # no first look needed
    assert costs.verify(1, 5) == 2.0  # at the plain step earlier calls timed, until this call times one
    costs.add_verify(1, 1, 3.0)  # this machine runs 3x slower now: the shape is carried, not the level
    assert costs.verify(1, 5) == pytest.approx(6.0)
    assert costs.verify(1, 7) == pytest.approx(power_law(7, (5, 6.0), (9, 7.5)))
    costs.add_verify(1, 5, 5.4)
    assert costs.verify(1, 5) == pytest.approx(5.4)  # its own timing, below the carried ratio, wins


def test_a_timing_above_the_carried_ratio_is_pooled_with_the_carried_timings():
    """On a noisy machine one timing of a width at 1.45x a plain step, where sixteen carried ones
    say 1.1x, priced that width at 1.45x for the rest of the call (the call rarely verified it
    again): drafts were cut short. Above the carried ratio the call's timings join the carried ones,
    one vote each, until the call has a full window of its own (`_Recent.keep`): then its median
    prices the width, so a device slower by less than 1.5x (which no timing flags as out of line)
    is seen within the call. Below the carried ratio the call's figure counts at once."""
    carried = [_measured({1: 1.0, 9: 1.1}, times=5) for _ in range(4)]
    costs = _after(*carried)
    assert costs.prior[(), 0, 1][9].samples == [1.1] * 16
    costs.add_verify(1, 1, 1.0)
    for _ in range(costs.times[1, 1].keep - 1):
        costs.add_verify(1, 9, 1.45)
        assert costs.verify(1, 9) == pytest.approx(1.1) and not costs.streak
    costs.add_verify(1, 9, 1.45)  # a full window: the call's own
    assert costs.verify(1, 9) == pytest.approx(1.45)
    cheaper = _after(*carried)
    cheaper.add_verify(1, 1, 1.0)
    cheaper.add_verify(1, 9, 0.9)
    assert cheaper.verify(1, 9) == pytest.approx(0.9)


def test_a_plain_step_is_carried_at_its_padding_context_bucket_and_batch_size_while_in_line():
    costs = _after(_measured({1: 1.0, 5: 2.0, 9: 2.5}))
    assert costs.verify(1, 1) == 1.0
    assert costs.verify(8, 1) is None  # another batch size: its own plain step first
    costs.begin(VerifyShape(), 5000)
    assert costs.verify(1, 1) is None  # a longer context
    costs.begin(COMPILED, 100)
    assert costs.verify(1, 1) is None  # another padding
    costs.begin(VerifyShape(), 100)
    costs.add_verify(1, 5, 6.0)  # 3x what the carried plain step and curve say: set aside
    assert costs.verify(1, 1) is None and costs.trusts_prior  # a plain step timed next, the curve kept
    costs.add_verify(1, 1, 3.0)
    assert costs.verify(1, 9) == pytest.approx(7.5)
    next_call = CostModel(shape=costs.shape)
    next_call.carry(costs)
    assert next_call.verify(1, 1) == 3.0  # the figure set aside is not carried on


def test_widths_carried_only_at_another_batch_size_scale_this_batchs_plain_step():
    """Earlier calls verified drafts only in a batch of 7 (width 3 at 4.35 plain steps); this call,
    a batch of 8, timed its plain step alone: its wide widths follow the carried curve, not flat
    (which verified 16-token drafts at twenty plain steps' worth under `linear`)."""
    costs = _after(_measured({1: 1.0, 3: 4.35}, batch=7))
    costs.add_verify(8, 1, 2.0)
    assert costs.verify(8, 3) == pytest.approx(2.0 * 4.35)
    assert costs.verify(8, 17) > 2.0 * 4.35 * 5


def test_a_width_carried_from_fewer_than_three_timings_does_not_count():
    """One of two timings may have been a stall; two calls of two timings each are enough."""
    twice = {1: 1.0, 5: 2.0}
    costs = _after(_measured(twice, times=2))
    costs.add_verify(1, 1, 1.0)
    assert not costs.measured_wide() and costs.verify(1, 5) == 1.0
    later = _after(_measured(twice, times=2), _measured(twice, times=2))
    later.add_verify(1, 1, 1.0)
    assert later.measured_wide() and later.verify(1, 5) == pytest.approx(2.0)


def test_carried_curves_are_keyed_by_padding_batch_size_and_context():
    earlier = _measured({1: 1.0, 5: 2.0})
    padded = _after(earlier)
    padded.begin(COMPILED, 100)
    assert not padded.measured_wide()  # timed unpadded: another curve
    long = _measured({1: 1.0, 5: 2.5})  # within what the other bucket's curve lets pass
    long.begin(VerifyShape(), 3000)
    both = _after(earlier, long)
    assert {key[1] for key in both.prior} == {context_bucket(0), context_bucket(3000)}
    for context, ratio in ((100, 2.0), (3000, 2.5), (20000, 2.5)):  # 20000: the nearest bucket's
        both.begin(VerifyShape(), context)
        both.add_verify(1, 1, 1.0)
        assert both.verify(1, 5) == pytest.approx(ratio)
    assert [context_bucket(n) for n in (0, 511, 512, 2047, 2048)] == [0, 0, 1, 1, 2]


# --- a regime change: timings that keep disagreeing with the prior ---


def _timed(costs: CostModel, curve: dict[int, float], widths: list[int]) -> list[bool]:
    """Time `widths` in turn at `curve`'s costs, a plain step first; whether the prior was in
    use for pricing after each."""
    costs.add_verify(1, 1, curve[1])
    used = []
    for width in widths:
        costs.add_verify(1, width, curve[width])
        used.append(costs.trusts_prior and not costs.streak)
    return used


@pytest.mark.parametrize(
    "before, after", [(FLAT, LINEAR), (LINEAR, FLAT)], ids=["flat->linear", "linear->flat"]
)
def test_timings_that_keep_disagreeing_with_the_prior_replace_it(before, after):
    """A curve carried from `before` while the device now costs `after`: the first timing out of
    line sets the prior aside for pricing, the third in a row ends it for the call; the call's own
    timings price every width, and are what it carries on."""
    costs = _after(_measured(before))
    used = _timed(costs, after, [9, 3, 5, 2] * 3)
    assert used == [False] * 12 and not costs.trusts_prior
    assert costs.verify(1, 17) == pytest.approx(after[17], rel=0.3)  # read off its own widths
    assert costs.verify(1, 9) == after[9]
    nxt = CostModel()
    nxt.carry(costs)
    nxt.add_verify(1, 1, 1.0)
    assert nxt.trusts_prior and nxt.verify(1, 5) == pytest.approx(after[5])  # the new curve, carried


def test_a_stall_is_one_timing_out_of_line_not_a_regime_change():
    costs = _after(_measured(FLAT))
    stalled = {**FLAT, 9: 4.0}
    assert _timed(costs, stalled, [9]) == [False]  # set aside while it is unclear
    assert _timed(costs, FLAT, [3, 5, 9]) == [True] * 3  # in line again: the prior stands
    assert costs.trusts_prior and costs.verify(1, 9) == pytest.approx(FLAT[9])


@pytest.mark.parametrize("noise, drift", [(0.2, 0.0), (0.0, 0.25)])
def test_noise_and_drift_leave_the_prior_standing(noise, drift):
    """A machine whose timings jitter (each forward apart, σ 0.2) or wander slowly (σ 0.25):
    seldom three in a row out of line, on one side."""
    from hf_specdec.bench.regimes import Jitter

    jitter = Jitter(0)
    costs = _after(_measured(FLAT))
    for step in range(60):
        width = 1 if step % 4 == 0 else 9 + step % 8
        factor = math.exp(noise * jitter.gauss(0.0, 1.0) + drift * jitter.drift())
        costs.add_verify(1, width, FLAT[width] * factor)
    assert costs.trusts_prior


def test_one_offs_expected_are_not_out_of_line():
    """Where earlier calls learnt that a new width costs six steps more once, new widths timed so
    are what the prior expects: drafts go on at the carried curve."""
    earlier = _oneoffs(1, 2, 3)
    costs = CostModel()
    costs.carry(earlier)
    costs.add_verify(1, 1, 1.0)
    for width in (7, 9, 12, 15):
        costs.add_verify(1, width, FLAT[width] + 6.0)
    assert costs.trusts_prior and not costs.streak


def test_the_costs_of_a_call_still_running_are_carried_as_they_were(monkeypatch):
    """Two calls on one model in two threads: the second carries the first's costs while the first
    still times widths. Timings between two of `carry`'s reads (a thread switch, made deterministic
    here) changed what it was reading: a width new to the call raised RuntimeError (dictionary changed
    size), a width timed again carried a timing the call had not made when it was read."""
    running, quiet = _measured(FLAT), _measured(FLAT)
    predict = CostModel.verify

    def verify(self: CostModel, batch: int, width: int) -> float | None:  # the other thread, mid-read
        running.add_verify(batch, 7, 9.99)  # a width it timed: one more timing
        running.add_verify(batch, 18, 1.17)  # a width new to it: one more key
        return predict(self, batch, width)

    monkeypatch.setattr(CostModel, "verify", verify)
    carried, expected = CostModel(), CostModel()
    carried.carry(running)
    monkeypatch.undo()
    expected.carry(quiet)
    assert carried.prior.keys() == expected.prior.keys()
    for key, curve in expected.prior.items():
        assert {w: r.samples for w, r in carried.prior[key].items()} == {
            w: r.samples for w, r in curve.items()
        }
