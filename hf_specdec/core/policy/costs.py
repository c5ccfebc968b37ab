"""The cost model: what drafting and verifying cost, as this call times them over a prior carried
from earlier calls on the same model and device, and what a width's first call costs once. It
holds no figure about any device: a width never timed is read off those that were."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from ..verify_shape import VerifyShape, padded_width

CARRIED_TIMINGS, CARRIED_MIN = 16, 3  # a carried width: the median of its last 16 timings, once 3
# A timing this far from what the prior expects (a log ratio: 1.5x) is out of line: one is a stall,
# REGIME_TIMINGS in a row on one side a regime change (another job on the device, a grown batch).
OUT_OF_LINE, REGIME_TIMINGS = math.log(1.5), 3
ONE_OFF_USES = 8  # the most steps a width's one-off is spread over (fewer where the call has fewer)
Curve = dict[int, float]  # width -> verify seconds over a plain step's
Pricing = tuple[float | None, Curve, Curve]  # a plain step's seconds (None: unpriced), steady and once curves
Key = tuple[tuple[int, ...], int, int]  # what a carried figure is kept under: padding, context bucket, batch
Feeding = Callable[[int], tuple[int, float | None]]  # width -> (the width to feed it at, its seconds)


@dataclass
class _Recent:
    """The median of the last `keep` timings (how many: docs/policy.md), or the smaller of the first
    two: a stall only adds."""

    samples: list[float] = field(default_factory=list)
    keep: int = 13
    value: float | None = None

    def add(self, x: float) -> None:
        self.samples = [*self.samples[-(self.keep - 1) :], x]
        self.value = min(self.samples) if len(self.samples) <= 2 else statistics.median(self.samples)

    @property
    def confirmed(self) -> bool:
        return len(self.samples) > 1


def context_bucket(tokens: int) -> int:
    """Contexts within one power of four (from 512 tokens) share a carried curve."""
    return max(0, (tokens.bit_length() - 8) // 2)


def _from_widths(known: Curve, width: int) -> float:
    """Cost at `width` along the power law through the two nearest widths of `known` (a chord
    guesses low where cost bends down, as a CPU's small matrix products do), or beyond the widest
    through it and the plain step, the exponent from 0 (flat) to 1 (in proportion to tokens fed)."""
    if width in known:
        return known[width]
    below, above = [w for w in known if w < width], [w for w in known if w > width]
    if above:
        lo, hi = max(below), min(above)
        if known[lo] <= 0 or known[hi] <= 0:
            return known[lo] + (known[hi] - known[lo]) * (width - lo) / (hi - lo)
        return known[lo] * (width / lo) ** (math.log(known[hi] / known[lo]) / math.log(hi / lo))
    edge = max(below)
    plain, widest = known[1], known[edge]
    if edge == 1 or plain <= 0 or widest <= plain:
        return widest
    return widest * (width / edge) ** min(math.log(widest / plain) / math.log(edge), 1.0)


@dataclass
class CostModel:
    """What this call timed, over the prior earlier calls carried (`carry`), each under a `Key`. How
    timings out of line with the prior are read: `OUT_OF_LINE` and docs/policy.md."""

    draft: _Recent = field(default_factory=_Recent)  # seconds per draft forward (a token, a tree level)
    asks: _Recent = field(default_factory=_Recent)  # seconds per ask for a draft, whatever came back
    times: dict[tuple[int, int], _Recent] = field(default_factory=dict)  # (batch, width fed) -> seconds
    # What a width's first call in a call cost above its second, where over twice it (else 0), at
    # shapes new to the process (False) and at shapes earlier calls verified (True: paid every call).
    one_offs: dict[bool, _Recent] = field(default_factory=lambda: {s: _Recent(keep=8) for s in (False, True)})
    # Per (batch, width) not yet paid for: the seconds it would have saved so far at its steady cost
    # (ski rental: a width whose one-off it has earned back is bought, whatever the horizon left).
    regret: dict[tuple[int, int], float] = field(default_factory=dict)
    prior: dict[Key, dict[int, _Recent]] = field(default_factory=dict)  # width -> its ratio to a plain step
    plains: dict[Key, _Recent] = field(default_factory=dict)  # the plain step's seconds in those calls
    shape: VerifyShape = field(default_factory=VerifyShape)
    bucket: int = 0  # `context_bucket` of the call's prompt
    trusts_prior: bool = True
    streak: list[float] = field(default_factory=list)  # log ratios out of line with the prior, in a row
    # Read every step, so kept: predictions and curves until the next timing; the prior as read at
    # this padding and context (`_read_prior`: per batch size its widths, and those verified).
    _cache: dict[tuple[int, int], float | None] = field(default_factory=dict, init=False, repr=False)
    _curves: dict[int, Pricing] = field(default_factory=dict, init=False, repr=False)
    _here: dict[int, dict[int, _Recent]] = field(default_factory=dict, init=False, repr=False)
    _before: set[tuple[int, int]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self._read_prior()

    def begin(self, shape: VerifyShape, context: int) -> None:
        self.shape, self.bucket = shape, context_bucket(context)
        self._read_prior()

    def _read_prior(self) -> None:
        """Per batch size, each width as carried at this padding in this context bucket, else in the
        nearest bucket that carried it from `CARRIED_MIN` timings; and every (batch, width) carried."""
        here = [key for key in self.prior if key[0] == self.shape.widths]
        self._before = {(key[2], width) for key in here for width in self.prior[key]}
        self._before |= {(key[2], 1) for key in self.plains if key[0] == self.shape.widths}
        enough = {k: {w: r for w, r in self.prior[k].items() if len(r.samples) >= CARRIED_MIN} for k in here}
        self._here = {key[2]: {} for key in here if enough[key]}  # in the order first carried
        for key in sorted(here, key=lambda k: -abs(k[1] - self.bucket)):
            if enough[key]:
                self._here[key[2]] |= enough[key]
        self._cache.clear()
        self._curves.clear()

    def add_verify(self, batch: int, width: int, seconds: float) -> None:
        width = self.shape.padded(width)
        timings = self.times.get((batch, width), _Recent())
        if width > 1:
            if not timings.samples and width not in self.paid(batch):
                self.regret.clear()  # earned against the widths paid for until now
            self._judge(batch, width, seconds, timings)
            if len(timings.samples) == 1:
                first, seen = timings.samples[0], (batch, width) in self._before
                self.one_offs[seen].add(first - seconds if first > 2 * seconds else 0.0)
        self.times[batch, width] = timings
        timings.add(seconds)
        self._cache.clear()
        self._curves.clear()

    def _judge(self, batch: int, width: int, seconds: float, timings: _Recent) -> None:
        """Count the timings in a row out of line with the prior (one-offs expected) on one side."""
        prior, plain, dear = self._prior_near(batch), self._plain(batch), self.new_shapes_are_dear()
        if not self.trusts_prior or not prior or not plain or seconds <= 0:
            return
        expected = plain * _from_widths({1: 1.0} | prior, width) + self.first_call_seconds(batch, width)
        seen, error = (batch, width) in self._before, math.log(seconds / expected)
        known = self.one_offs[seen].confirmed or not dear and any(r.confirmed for r in self.one_offs.values())
        carried = self.plain_is_carried(batch)
        if dear and not carried and not self.times.get((batch, 1), _Recent()).confirmed:
            return  # the plain step it is held to may have paid a one-off
        if error > 0 and not timings.samples and not known:
            return  # a first call dear: a one-off, or the curve? Nothing, until one-offs are known
        if carried and abs(error) >= OUT_OF_LINE:  # the device or the context moved: time a plain step
            self.plains.pop((self.shape.widths, self.bucket, self._timed_batch(batch)), None)
            return
        same_side = self.streak and (error > 0) == (self.streak[-1] > 0)
        self.streak = ([*self.streak, error] if same_side else [error]) if abs(error) >= OUT_OF_LINE else []
        if len(self.streak) >= REGIME_TIMINGS:
            self.trusts_prior, self.streak = False, []

    def verify(self, batch: int, width: int) -> float | None:
        """Predicted seconds; None until a plain step was timed (at the nearest batch size) or carried."""
        key = (batch, self.shape.padded(width))
        if key not in self._cache:
            self._cache[key] = self._predict(*key)
        return self._cache[key]

    def _predict(self, batch: int, width: int) -> float | None:
        if batch not in self._curves:
            plain = self._plain(batch)
            self._curves[batch] = (plain, *self._curve(batch, plain)) if plain is not None else (None, {}, {})
        plain, steady, once = self._curves[batch]
        if plain is None:
            return None
        if width not in once:
            return plain * (_from_widths(steady | once, width) or 1.0)
        guess = _from_widths(steady, width) or 1.0  # timed once far above the curve: a stall
        return plain * (guess if once[width] > (2 * guess if len(steady) > 1 else width) else once[width])

    def _timed_batch(self, batch: int) -> int:
        """The batch size nearest `batch` that this call timed (`batch` where it timed none)."""
        return min({b for b, _ in self.times}, key=lambda b: abs(b - batch), default=batch)

    def _plain(self, batch: int) -> float | None:
        """As timed here, else as carried while the prior at this batch size is in use; no more than
        the narrowest wider width timed: plain steps are not timed while drafting goes on, and ones
        timed in a stall made drafts that never held look cheap."""
        at = self._timed_batch(batch)
        in_use = self.trusts_prior and self.carried_at(at)
        timed = self.times.get((at, 1)) or in_use and self.plains.get((self.shape.widths, self.bucket, at))
        if not timed:
            return None
        wider = [w for b, w in self.times if b == at and w > 1]
        return min(timed.value, self.times[at, min(wider)].value) if wider else timed.value

    def plain_is_carried(self, batch: int) -> bool:
        """Whether a plain step at `batch` is priced as earlier calls timed it: none timed here."""
        return (self._timed_batch(batch), 1) not in self.times

    def _curve(self, batch: int, plain: float) -> tuple[Curve, Curve]:
        """(steady, timed once) ratios: the prior's while in use, under this call's (a width timed
        above its carried ratio, short of a full window, pooled with the carried timings); where this
        batch size verified nothing, the nearest one's that did, else the prior's at the nearest."""
        in_use = self.trusts_prior and not self.streak  # a timing out of line sets it aside
        own = {w: t for (b, w), t in self.times.items() if b == batch and w > 1}
        carried = self._here.get(batch, {}) if in_use else {}
        steady = {1: 1.0} | {w: r.value for w, r in carried.items()}
        for w in [w for w in own.keys() & carried.keys() if len(own[w].samples) < own[w].keep]:
            # Noise, weighed by count: one noisy timing of a width the call rarely verifies must not
            # price it all call long. Below the carried ratio, or a full window of its own: the call's.
            timings = own.pop(w)
            pooled = statistics.median([*carried[w].samples, *(s / plain for s in timings.samples)])
            steady[w] = min(timings.value / plain, pooled)
        steady |= {w: t.value / plain for w, t in own.items() if t.confirmed}
        once = {w: t.value / plain for w, t in own.items() if not t.confirmed}
        if len(steady) > 1 or once:
            return steady, once
        others = [b for b, w in self.times if w > 1 and (b, 1) in self.times]
        if not others:
            return {1: 1.0} | (self._prior_near(batch) if in_use else {}), {}
        nearest = min(others, key=lambda b: abs(b - batch))
        steady, once = self._curve(nearest, self._plain(nearest))
        return steady | once, {}

    def _prior_near(self, batch: int) -> Curve:
        """The prior at `batch`, or at the nearest batch size earlier calls verified drafts at."""
        near = min(self._here, key=lambda b: abs(b - batch), default=None)
        return {w: r.value for w, r in self._here.get(near, {}).items()}

    def carried_at(self, batch: int) -> bool:
        """Whether earlier calls verified drafts at this batch size (else the prior is another's)."""
        return batch in self._here

    def first_call_seconds(self, batch: int, width: int) -> float:
        """The one-off a width not yet verified in this call is expected to cost, once learnt."""
        key = (batch, self.shape.padded(width))
        excess = self.one_offs[key in self._before]
        return (excess.value or 0.0) if key not in self.times and excess.confirmed else 0.0

    def feeding(
        self, batch: int, steps_left: Callable[[int], float] | None = None, widen: bool = True
    ) -> Feeding:
        """Per width, the width to feed it at and its cost: `verify` plus its unearned one-off spread
        over the steps it can serve (`ONE_OFF_USES`, fewer where `steps_left` says so; a plain step's
        over every step left), or the next wider width paid for, if cheaper, where the cache feeds
        holes and one-offs were timed."""
        widths = tuple(sorted(self.paid(batch)))
        widen = widen and self.shape.feeds_holes and any(r.confirmed for r in self.one_offs.values())

        def feed(width: int) -> tuple[int, float | None]:
            seconds = self.verify(batch, width)
            if seconds is None:
                return width, None
            earned = self.regret.get((batch, self.shape.padded(width)), 0.0)
            owed = self.first_call_seconds(batch, width) - earned
            if owed > 0:
                left = ONE_OFF_USES if steps_left is None else int(steps_left(width))
                seconds += owed / max(1, left if width == 1 else min(ONE_OFF_USES, left))
            wider = padded_width(widths, width) if widen else width
            if wider > width and (fed := self.verify(batch, wider)) is not None and fed < seconds:
                return wider, fed
            return width, seconds

        return feed

    def paid(self, batch: int) -> set[int]:
        """The widths at `batch` whose one-off is paid: in this call, or in the process where one-offs
        are paid once a process."""
        paid = {w for b, w in self.times if b == batch}
        if not self.per_call_one_offs():
            paid |= {w for b, w in self._before if b == batch}
        return paid

    def add_regret(self, batch: int, wins: dict[int, float]) -> None:
        """Per width, the seconds it would have saved in a step at its steady cost: earned where unpaid."""
        earned, paid = {}, self.paid(batch)
        for width, seconds in wins.items():  # widths fed at one padded width: the most it saves
            padded = self.shape.padded(width)
            earned[padded] = max(seconds, earned.get(padded, 0.0))
        for width in earned.keys() - paid:
            self.regret[batch, width] = self.regret.get((batch, width), 0.0) + earned[width]

    def per_call_one_offs(self) -> bool:
        return bool(self.one_offs[True].confirmed and self.one_offs[True].value)

    def measured_wide(self) -> bool:
        """Whether a wide verify was timed here, or enough of them by earlier calls at this padding."""
        return self.verified_here() or bool(self._here)

    def verified_here(self) -> bool:
        return any(w > 1 for _, w in self.times)

    def new_shapes_are_dear(self) -> bool:
        return any(r.confirmed and r.value for r in self.one_offs.values())

    def carry(self, earlier: CostModel | None) -> None:
        """Start from `earlier` (the last call's costs, holding what it carried): its timings as ratios
        to its plain step, and its one-offs; where it found its prior wrong, its own replace it."""
        if earlier is None:
            return
        copy = lambda r: dataclasses.replace(r, samples=list(r.samples))  # noqa: E731
        # Read a copy: that call may still be running in another thread, timing widths as we read.
        times, plains = (
            {key: copy(r) for key, r in list(d.items())} for d in (earlier.times, earlier.plains)
        )
        earlier = dataclasses.replace(earlier, times=times, plains=plains, regret=dict(earlier.regret))
        pads = earlier.shape.widths
        keep = lambda key: earlier.trusts_prior or key[0] != pads  # noqa: E731
        self.prior = {
            key: {w: copy(r) for w, r in curve.items()} for key, curve in earlier.prior.items() if keep(key)
        }
        self.plains = {key: copy(r) for key, r in earlier.plains.items() if keep(key)}
        first = int(earlier.new_shapes_are_dear())  # a width's first call then paid a one-off: not carried
        for (batch, width), timings in earlier.times.items():
            key, plain = (pads, earlier.bucket, batch), earlier.verify(batch, 1)
            if width == 1:  # as its ratios were: capped by wider widths
                self.plains.setdefault(key, _Recent()).add(plain)
            elif plain and timings.samples[first:]:
                ratios = self.prior.setdefault(key, {}).setdefault(width, _Recent(keep=CARRIED_TIMINGS))
                for seconds in timings.samples[first:]:  # each as timed: a median of minima would guess low
                    ratios.add(seconds / plain)
        self.one_offs = {seen: copy(r) for seen, r in earlier.one_offs.items()}
        if not self.per_call_one_offs():  # bought once a process: what it earned holds
            self.regret = {key: s for key, s in earlier.regret.items() if key[1] not in earlier.paid(key[0])}
        self._read_prior()
