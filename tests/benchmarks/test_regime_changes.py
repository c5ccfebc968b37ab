"""The regime-change benchmark's oracle (`benchmarks/micro/regime_changes.py`): each call at its
fastest fixed k, plain decoding among them, so that no call's oracle is slower than plain."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hf_specdec.bench.regimes import PROFILES

MICRO = Path(__file__).resolve().parents[2] / "benchmarks" / "micro"


@pytest.fixture(scope="module")
def regime_changes():
    sys.path.insert(0, str(MICRO))  # the script imports its neighbours
    try:
        spec = importlib.util.spec_from_file_location("regime_changes", MICRO / "regime_changes.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(MICRO))
    return module


def _row(answer: list[int]) -> dict:
    return {"prompt": list(range(100, 140)), "answer": answer, "category": "rag"}


def test_the_oracle_drafts_where_the_answer_copies_and_decodes_plainly_where_nothing_pays(regime_changes):
    copied = _row(list(range(100, 140)) * 2)  # the answer repeats the prompt: long drafts all hold
    fresh = _row(list(range(500, 580)))  # nothing to look up: every draft fails
    flat, linear = PROFILES["flat"], PROFILES["linear"]
    (copies,) = regime_changes.oracle([("rag", [copied])], flat)
    assert copies["auto"] < copies["plain"] / 3
    for profile in (flat, linear):
        (nothing,) = regime_changes.oracle([("rag", [fresh])], profile)
        assert nothing["auto"] == nothing["plain"]
