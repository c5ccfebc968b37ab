"""Emulated device regimes: what each profile charges, and a clock that follows it."""

from __future__ import annotations

import inspect
import math
import statistics
import time

import pytest
import torch

from hf_specdec.bench.regimes import PROFILES, REAL, Forward, Jitter, emulate, priced

from ..conftest import tiny_llama

STEP = PROFILES["flat"].step


@pytest.mark.parametrize(
    ("profile", "forward", "steps"),
    [
        ("flat", Forward(1, 1, 10), 1.0),
        ("flat", Forward(1, 11, 10), 1.1),  # +1% per extra token
        ("linear", Forward(1, 11, 10), 7.0),  # 1 + 0.6 * 10
        ("gpu-batch", Forward(8, 16, 10), 1 + 0.004 * 127),  # 128 tokens: at the knee
        ("gpu-batch", Forward(16, 16, 10), (1 + 0.004 * 127) * 2),  # past it: in proportion
        ("flat", Forward(1, 257, 0), 2.0),  # a prefill: 1/256 of a step per prompt token
        ("concave", Forward(1, 3, 10), 1.73),  # a point of its measured curve
        ("concave", Forward(1, 6, 10), 2.05 + (2.4 - 2.05) / 3),  # between points
        ("concave", Forward(1, 40, 10), 3.8 + (3.8 - 3.3) / 8 * 8),  # past the last: its last slope
    ],
)
def test_each_profile_prices_a_forward_by_its_rule(profile, forward, steps):
    assert PROFILES[profile].seconds(forward) == pytest.approx(steps * STEP)


def test_the_bf16_cpu_profile_prices_by_its_own_step_and_measured_curve():
    profile = PROFILES["bf16-cpu"]
    assert profile.step == 0.065  # its machine's plain step, not the emulated GPU's 20 ms
    assert profile.seconds(Forward(1, 1, 10)) == pytest.approx(0.065)
    assert profile.seconds(Forward(1, 16, 10)) == pytest.approx(1.33 * 0.065)  # a measured point
    assert profile.seconds(Forward(1, 41, 0)) == pytest.approx((1 + 0.016 * 40) * 0.065)  # a prefill


def test_one_off_costs_come_once_per_shape_and_never_for_a_prefill():
    profile = PROFILES["flat+oneoff"]
    step = Forward(1, 5, 10)
    assert profile.seconds(step, first_of_shape=True) == pytest.approx((1.04 + 6) * STEP)
    assert profile.seconds(Forward(1, 40, 0), first_of_shape=True) == profile.seconds(Forward(1, 40, 0))
    once = priced(0.0, 0.0, [step, step, step], profile)
    assert once == pytest.approx((3 * 1.04 + 6) * STEP)
    per_call = priced(0.0, 0.0, [step], PROFILES["flat+oneoff-call"], shapes={(1, 5)})
    assert per_call == pytest.approx((1.04 + 6) * STEP)  # a per-call profile forgets the shapes paid


def test_drift_moves_the_cost_slowly_where_noise_moves_each_forward_apart():
    """A drifting machine (another process coming and going) prices neighbouring forwards alike
    and distant ones apart; a jittery one prices each forward on its own."""

    def log_costs(name: str) -> list[float]:
        profile, jitter = PROFILES[name], Jitter(0)
        return [math.log(profile.seconds(Forward(1, 1, 10), rng=jitter) / STEP) for _ in range(5000)]

    def neighbours(logs: list[float]) -> float:
        return statistics.correlation(logs[:-1], logs[1:])

    drift, noise = log_costs("flat+drift"), log_costs("flat+noise")
    assert statistics.pstdev(drift) == pytest.approx(0.3, rel=0.25)  # the level's deviation, scaled
    assert statistics.pstdev(noise) == pytest.approx(0.3, rel=0.1)
    assert neighbours(drift) > 0.9 and abs(neighbours(noise)) < 0.1
    assert abs(statistics.correlation(drift[:-200], drift[200:])) < 0.3  # 200 forwards apart: forgotten
    assert PROFILES["flat+drift"].seconds(Forward(1, 1, 10)) == STEP  # no generator, no drift


def test_the_emulated_clock_moves_by_the_profile_not_the_forward():
    _wall = time.perf_counter
    model = tiny_llama(0)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with emulate(model, PROFILES["linear"]) as device:
        assert "input_ids" in inspect.signature(model.forward).parameters  # functools.wraps
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            start = time.perf_counter()
            model(input_ids=ids[:, :3], cache=out.past_key_values, use_cache=True)
            elapsed = time.perf_counter() - start
    assert [(f.batch, f.width, f.past) for f in device.forwards] == [(1, 5, 0), (1, 3, 5)]
    charged = PROFILES["linear"].seconds(Forward(1, 3, 5))  # 2.2 steps: 44 ms
    assert charged <= elapsed < charged + 0.5 * STEP  # plus the host's own work, a few ms at most
    assert time.perf_counter is _wall and "forward" not in vars(model)  # both put back


def test_the_real_profile_only_records():
    model = tiny_llama(0)
    clock = time.perf_counter
    with emulate(model, REAL) as device, torch.no_grad():
        assert time.perf_counter is clock
        model(input_ids=torch.tensor([[3, 4]]))
    assert len(device.forwards) == 1 and device.forwards[0].wall_seconds > 0
    assert priced(1.5, 0.2, device.forwards, REAL) == 1.5
