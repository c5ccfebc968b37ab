"""`hf_specdec.bench.machine`: what other processes took of the CPU while something was timed."""

from __future__ import annotations

import os
import sys

import pytest

from hf_specdec.bench.machine import OtherProcesses, busy_note, load_average


def test_the_share_is_the_machines_busy_time_less_this_processs_own(monkeypatch):
    """10 s of wall time on every CPU; the machine busy for 6 CPU-seconds per CPU, 2 of them ours."""
    cpus = os.cpu_count() or 1
    readings = iter([(100.0, 50.0, 3.0), (110.0, 50.0 + 6.0 * cpus, 5.0)])
    monkeypatch.setattr(OtherProcesses, "_read", staticmethod(lambda: next(readings)))
    assert OtherProcesses().share() == pytest.approx((6.0 * cpus - 2.0) / (10.0 * cpus))


def test_the_share_is_a_fraction_or_none_where_the_system_cannot_tell(monkeypatch):
    share = OtherProcesses().share()
    if sys.platform.startswith("linux"):
        assert share is not None and 0.0 <= share <= 1.0
    monkeypatch.setattr(OtherProcesses, "_read", staticmethod(lambda: None))
    assert OtherProcesses().share() is None and busy_note(None) is None


def test_a_busy_machine_gets_a_note_and_a_quiet_one_none():
    assert busy_note(0.05) is None
    assert "Other processes took 35% of this machine's CPU time" in busy_note(0.35)


def test_load_average_is_three_figures():
    values = load_average()
    assert values is None or len(values) == 3
