"""What else the machine did while something was timed: a ratio measured on a busy machine is partly
the machine's, and a report says so."""

from __future__ import annotations

import os

from hf_specdec.core import timing


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, or None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


class OtherProcesses:
    """The share of the machine's CPU time that other processes took since this was made.

    The load average cannot tell: it counts this process too, and reacts over a minute. Here the
    machine's busy time (all CPUs, /proc/stat) less this process's own CPU time, over the wall time
    times the CPU count. None where there is no /proc/stat (not Linux)."""

    def __init__(self) -> None:
        self._start = self._read()

    def share(self) -> float | None:
        if self._start is None or (now := self._read()) is None:
            return None
        wall, busy, own = (b - a for a, b in zip(self._start, now))
        if wall <= 0:
            return None
        return min(max((busy - own) / (wall * (os.cpu_count() or 1)), 0.0), 1.0)

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        """(wall seconds, the machine's busy CPU seconds, this process's CPU seconds)."""
        try:
            with open("/proc/stat") as stat:
                ticks = [int(x) for x in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
        own = os.times()
        # The wall time of the CPU counters, not of a device's queued work: a CPU clock read.
        return timing.clock("cpu"), (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def busy_note(share: float | None) -> str | None:
    """A line for a report when other processes took a noticeable share of the CPU, else None."""
    if share is None or share < 0.1:
        return None
    return (
        f"Other processes took {share:.0%} of this machine's CPU time while it ran: the timings are "
        "noisy and the ratios may be off; rerun on a quiet machine to compare."
    )
