"""The replay benchmark's oracle (`benchmarks/micro/policy_replay.py`), by table: issue 39's figures
are auto / oracle, so the oracle must pay what the process it stands for would pay."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hf_specdec.bench.regimes import PROFILES

MICRO = Path(__file__).resolve().parents[2] / "benchmarks" / "micro"


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(MICRO))  # the script imports its neighbour `ngram_rules`
    try:
        spec = importlib.util.spec_from_file_location("policy_replay", MICRO / "policy_replay.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["policy_replay"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(MICRO))
    return module


def _run(seconds: float, fed: set, paid: set = frozenset()) -> dict:
    return {"seconds": seconds, "fed": set(fed), "paid": set(paid)}


def _oracle(replay, profile: str, calls: list[dict]) -> list[float]:
    oracle = replay.Oracle(PROFILES[profile])
    for runs in calls:
        oracle.add(runs)
    return oracle.seconds()


PLAIN, W3, W5 = (1, 1), (1, 3), (1, 5)


def _first(oneoff: float) -> dict:
    """A process's first call: each k's row, a process of its own, pays its own shapes' one-offs."""
    return {
        2: _run(1.0 + 2 * oneoff, {PLAIN, W3}, {PLAIN, W3}),
        4: _run(0.9 + 2 * oneoff, {PLAIN, W5}, {PLAIN, W5}),
    }


def test_the_oracle_pays_a_one_off_the_first_time_its_process_feeds_a_shape(replay):
    profile = PROFILES["flat+oneoff"]  # a one-off once a process
    oneoff = profile.step * profile.oneoff
    # k=2 is faster in the later calls, by less than width 3's one-off in all: never worth buying,
    # though each call's fastest row (0.95, 0.97) would take it for free.
    calls = [_first(oneoff), {2: _run(0.95, {PLAIN, W3}), 4: _run(1.0, {PLAIN, W5})}]
    calls.append({2: _run(0.97, {PLAIN, W3}), 4: _run(1.0, {PLAIN, W5})})
    assert _oracle(replay, "flat+oneoff", calls) == pytest.approx([0.9 + 2 * oneoff, 1.0, 1.0])
    # Once it saves more than that, both widths are worth having: each paid where first fed.
    calls.append({2: _run(0.8, {PLAIN, W3}), 4: _run(1.0, {PLAIN, W5})})
    calls.append({2: _run(1.0, {PLAIN, W3}), 4: _run(0.7, {PLAIN, W5})})
    expected = [0.9 + 2 * oneoff, 0.95 + oneoff, 0.97, 0.8, 0.7]
    assert _oracle(replay, "flat+oneoff", calls) == pytest.approx(expected)


@pytest.mark.parametrize("name", ["flat", "flat+oneoff-call"])
def test_the_oracle_is_each_calls_fastest_row_without_one_offs_a_process_keeps(replay, name):
    # Once a call (`flat+oneoff-call`): each row's seconds hold the call's own one-offs.
    runs = [
        {2: _run(1.1, {W3}, {W3}), 4: _run(1.0, {W5}, {W5})},
        {2: _run(0.9, {W3}, {W3}), 4: _run(1.0, {W5}, {W5})},
    ]
    assert _oracle(replay, name, runs * 2) == [1.0, 0.9, 1.0, 0.9]


def _calls() -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) token ids whose answers repeat their prompts in part, as n-gram drafts need;
    a one-token prompt first (its forward is no prefill: it pays a one-off) and a five-token one."""
    text = [5, 6, 7, 8, 9, 10, 11, 12] * 6
    return [([5], text[:40]), (text[:30], text[30:] + [3, 4] + text[:40]), (text[:5], text[5:45] + [2] * 9)]


@pytest.mark.parametrize("name", ["flat+oneoff", "flat+oneoff-call", "flat"])
def test_the_oracle_prices_a_single_k_as_its_own_row_timed_it(replay, name):
    """On `replay`'s own bookkeeping of what each call fed and paid: a set of one k costs what that
    k's row took, call by call, and the oracle no more than any fixed k over the process."""
    profile, ks = PROFILES[name], (2, 4, 8)
    oracle, rows = replay.Oracle(profile), {k: [] for k in ks}
    shapes = {k: set() for k in ks}  # each k's row a process of its own
    for prompt, answer in _calls():
        runs = {
            k: replay.replay([prompt], [answer], replay.fixed_rows(profile)(k), profile, 0.0, shapes[k])
            for k in ks
        }
        oracle.add(runs)
        for k in ks:
            rows[k].append(runs[k]["seconds"])
    for k in ks:
        assert oracle._charged((k,)) == pytest.approx(rows[k])
    assert sum(oracle.seconds()) <= min(sum(seconds) for seconds in rows.values()) + 1e-12
