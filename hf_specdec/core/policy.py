"""How many tokens to draft each step: policy, kept apart from the decoding mechanism.

The adaptive policy follows the analysis of Leviathan et al. (2023, §3): with per-position
acceptance α_i (conditional on the earlier draft tokens being accepted), drafting k tokens yields
E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i tokens per target forward and costs k draft steps plus one verify
of k + 1 tokens. It learns α_i, the draft cost per token and the verify cost per width (for the
current batch size) during the call, and

- before drafting, asks for the k that maximises expected tokens per second; k = 0 is plain
  decoding, chosen whenever no draft length is predicted to beat it (it probes again now and then,
  with exponential back-off, so that it notices when drafting pays again);
- after drafting, cuts each row's draft where the drafter's own per-token confidence says the
  remaining tokens are not worth their verify cost. Confidences are calibrated here: per bucket of
  the drafter's score, the policy counts how often such tokens were actually accepted.

Trees (`SpeculativeConfig(tree=...)`) are sized by the same rule, with the gain of a tree of n
nodes in place of E(k): a tree verifies n nodes in a forward of width n + 1, as a chain of n tokens
does, but accepts more of them, since a rejected node leaves its siblings on offer. Drafters put a
tree's nodes best first (parents before children), so a tree's first n nodes are its best tree of n
nodes, and the step accepts the nodes of its accepted path among them; hence the expected gain of n
nodes is Σ_{i<n} β_i, β_i being how often node i lies on the accepted path (`TreeAcceptance`, learnt
from tree steps alone). With cheap verification bigger trees pay; where each fed token costs about
as much as a step (fp32 on a CPU) the chosen trees shrink to a node or two, or to plain decoding.

Its parts, each usable and tested alone: `AdaptiveSettings` (frozen settings), `AcceptanceEstimate`
(α_i and calibrated confidences), `TreeAcceptance` (β_i of tree nodes), `CostModel` (measured draft
and verify costs, and no figure about any device), `ProbeSchedule` (when to try drafting again),
`best_width` and `fastest_width` (the decision).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .draft import Draft
from .static_kv import padded_width

MAX_DRAFT = 16
# Drafting must look this much faster than plain decoding to be chosen: noise in the figures must
# not flip a step into a loss. Between draft lengths the faster one is taken as it is.
PLAIN_MARGIN = 1.02
# Earlier calls' figures a call starts from (`CostModel.carry`): each width's ratio to a plain step,
# the median of its last this many timings in the calls that verified it.
CARRIED_TIMINGS = 16
CARRIED_MIN = 3  # timings a carried width needs to count: one of two may be a stall
# One-token looks a call verifies at most where carried costs say drafting cannot pay
# (`AdaptiveDraftLength._recheck`): a compiled width's first forward is its compile, the next is timed.
MAX_LOOKS = 2
FREE_DRAFT = 0.05  # asking for a draft costs less than this share of a plain step: ask every step
_BUCKETS = 10
# The prior on an acceptance rate before anything is measured (`beta_mean`): its mean, and what it
# weighs, in drafts. The policy's settings and the drafters that learn their own odds start from it.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0


class DraftLengthPolicy(Protocol):
    def draft_length(self, batch_size: int) -> int:
        """Tokens to draft in the coming step (0: decode one token plainly)."""
        ...

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        """Cut a fresh draft to the width worth verifying; `remaining[b]`: tokens row b has left."""
        ...

    def update(
        self,
        batch_size: int,
        draft: Draft,
        accepted: list[int],
        draft_seconds: float,
        verify_seconds: float | None,
        paths: list[list[int]] | None = None,
    ) -> None:
        """Learn from the step just taken: the verified draft, per-row acceptance and the two costs.
        Tree steps (only they) also pass `paths`: each row's accepted nodes, root first.
        `verify_seconds` is None when the forward's time is no verify cost (a compiled width's
        first call, which compiled it)."""
        ...

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        """A first figure for what a draft token costs, timed by the drafter before any drafting
        (`Drafter.probe_seconds`). Policies that do not weigh draft costs ignore it (the default)."""

    def pad_widths(self, widths: tuple[int, ...]) -> None:
        """The target feeds each verify forward padded up to the next of these widths (a compiled
        static cache: one graph per width), so a width costs what its padded width costs. Told at
        the start of each call, `()` where nothing is padded. Optional (the loop calls it where a
        policy has it); policies that do not price widths ignore it (the default)."""

    def keeps_batch_shape(self) -> bool:
        """Whether rows that finished should stay in the target's forward as holes rather than
        leave it (which the cache does once half the batch finished, to spare their compute): a
        batch of another size is a new shape for every width, and a device may pay a one-off for
        each. Optional; without it (or False, the default) finished rows leave."""
        return False


@dataclass
class FixedDraftLength:
    """Always draft `k` tokens and verify all of them."""

    k: int

    def draft_length(self, batch_size: int) -> int:
        return self.k

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return draft

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        pass

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        pass


@dataclass
class _Recent:
    """The median of the last few timings, or the smaller of the first two: one stall (page fault,
    another process, a GPU's first call at a new shape) must not make a width look expensive for
    the rest of the call, as it would in a running mean. Such noise only ever adds time, so of two
    timings the smaller is the better guess (their mean would keep half a stall)."""

    samples: list[float] = field(default_factory=list)
    keep: int = 5
    value: float | None = None  # kept current: the policy reads it many times a step

    def add(self, x: float) -> None:
        self.samples = [*self.samples[-(self.keep - 1) :], x]
        ordered, middle = sorted(self.samples), len(self.samples) // 2  # statistics.median, inlined
        if len(ordered) <= 2:
            self.value = ordered[0]
        else:
            self.value = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    @property
    def confirmed(self) -> bool:
        """Timed more than once: a single timing may have been a stall."""
        return len(self.samples) > 1


def _learnt_excess(excess: _Recent) -> float:
    """A first call's excess over steady costs as learnt (`CostModel.first_calls`): its median once
    two widths were timed twice, else 0 (a width is tried rather than guessed dear)."""
    return (excess.value or 0.0) if excess.confirmed else 0.0


def _copy(recent: _Recent) -> _Recent:
    return dataclasses.replace(recent, samples=list(recent.samples))


def beta_mean(
    hits: float, trials: float, prior: float = PRIOR_ACCEPTANCE, weight: float = PRIOR_WEIGHT
) -> float:
    """The mean of the Beta posterior of a rate after `hits` in `trials`, from a prior of mean
    `prior` worth `weight` trials: the one estimate of an acceptance rate, here and in the drafters."""
    return (hits + prior * weight) / (trials + weight)


@dataclass(frozen=True)
class AdaptiveSettings:
    """Settings of `AdaptiveDraftLength`; what it learns lives apart, in its parts.

    Args:
        first_k: draft length of the first speculative steps, before anything is measured (and of
            the probes after plain steps); at most `max_k`, whatever is given.
        prior_acceptance, prior_weight: the prior on each α_i, worth `prior_weight` drafts
            (where `trim` cuts a greedy chain by its tokens' confidences, a token's own confidence
            stands in for `prior_acceptance`).
        probe_every: plain steps before the first re-probe once plain decoding was chosen.
        min_probe_gain: re-probe only while drafts that are always accepted would be at least this
            much faster than plain decoding at the measured costs (a probe that finds nothing costs
            about a step).
        max_k: the longest draft ever chosen.
        realized_window: asks for a draft that cost something (not `FREE_DRAFT`) are held to what
            the last this many actually gave: see `RealizedAsks`.
    """

    first_k: int = 4
    prior_acceptance: float = PRIOR_ACCEPTANCE
    prior_weight: float = PRIOR_WEIGHT
    probe_every: int = 8
    min_probe_gain: float = 1.1
    max_k: int = MAX_DRAFT
    realized_window: int = 16


@dataclass
class AcceptanceEstimate:
    """Learnt acceptance: α_i per draft position (conditional on the earlier positions being
    accepted) and, per bucket of the drafter's own confidence, how often such tokens were
    accepted. Each is the mean of a Beta posterior, so it starts at the prior.

    A draft's first token and the tokens after it are calibrated apart: a score can mean very
    different things there. An n-gram match's score is the same for all of its tokens, but its
    first token is a guess that the text repeats (often wrong) and the others a guess that a
    repeat, once started, goes on (often right); mixed, the second would look as unlikely as the
    first and long copies would be cut after one token."""

    max_k: int = MAX_DRAFT
    prior_acceptance: float = PRIOR_ACCEPTANCE
    prior_weight: float = PRIOR_WEIGHT
    drafted: list[float] = field(default_factory=list)  # per position, sized to max_k
    accepted: list[float] = field(default_factory=list)
    # Per confidence bucket, first tokens then later ones (`_bucket`).
    bucket_drafted: list[float] = field(default_factory=lambda: [0.0] * 2 * _BUCKETS)
    bucket_accepted: list[float] = field(default_factory=lambda: [0.0] * 2 * _BUCKETS)

    def __post_init__(self) -> None:
        for counts in (self.drafted, self.accepted):
            counts.extend([0.0] * (self.max_k - len(counts)))

    def alpha(self, position: int, prior: float | None = None) -> float:
        """Estimated acceptance of draft position `position` (0-based), given the earlier ones;
        `prior`: what it is taken to be before that position was seen (default `prior_acceptance`)."""
        prior = self.prior_acceptance if prior is None else prior
        return beta_mean(self.accepted[position], self.drafted[position], prior, self.prior_weight)

    def alphas(self) -> list[float]:
        """α_i for every position up to `max_k`."""
        return [self.alpha(i) for i in range(self.max_k)]

    def calibrated(self, confidence: float, position: int = 0) -> float:
        """Acceptance observed for draft tokens at `position` (the first, or a later one) whose
        drafter confidence fell in this bucket."""
        bucket = _bucket(confidence, position)
        prior = (bucket % _BUCKETS + 0.5) / _BUCKETS
        return beta_mean(self.bucket_accepted[bucket], self.bucket_drafted[bucket], prior, self.prior_weight)

    def observe(
        self, lengths: list[int], accepted: list[int], confidence: list[list[float]] | None = None
    ) -> None:
        """Row b drafted `lengths[b]` tokens (with these confidences) and had `accepted[b]` accepted.
        For a tree, `lengths[b]` is its depth: the positions a path through it could reach."""
        for b, (d, a) in enumerate(zip(lengths, accepted)):
            # Position i was tested only if every earlier draft token was accepted.
            tested = min(d, a + 1, self.max_k)
            for i in range(tested):
                self.drafted[i] += 1
                self.accepted[i] += i < a
                if confidence is not None:
                    # A draft's later tokens hold or fail together (a copy goes on, or the text
                    # moves on), so together they count as one trial of their buckets, not as
                    # many: one 4-token copy that held made later tokens look 92% likely for
                    # the rest of an open answer, where they held 70% of the time.
                    weight = 1.0 if i == 0 else 1.0 / (tested - 1)
                    bucket = _bucket(confidence[b][i], i)
                    self.bucket_drafted[bucket] += weight
                    self.bucket_accepted[bucket] += weight * (i < a)


def _bucket(confidence: float, position: int) -> int:
    """The calibration bucket of a confidence: first draft tokens in 0.._BUCKETS - 1, later ones after."""
    return min(int(confidence * _BUCKETS), _BUCKETS - 1) + (_BUCKETS if position > 0 else 0)


@dataclass
class TreeAcceptance:
    """Learnt acceptance of tree drafts, kept apart from chains': β_i, how often node i (in the
    drafter's best-first order) lies on the accepted path, among tree steps whose row had a node i.

    A tree's first n nodes are a tree, and the walk down it accepts exactly the accepted path's
    nodes below n (a path's nodes come in increasing order); so n nodes are expected to add
    Σ_{i<n} β_i tokens (`gains`), whatever tree sizes the β_i were measured with. Each β_i is the
    mean of a Beta posterior whose prior is β_{i-1} (β_0's: `prior_acceptance`): a node never
    drafted is guessed as likely as the one before it. Nodes come best first, so this guesses
    high, and a size never tried gets tried and measured (as `CostModel` guesses costs low).

    It also learns how deep a tree's first n nodes reach (`levels`): a drafter grows a tree one
    draft forward per level, whatever the level's width, so n nodes cost that many forwards, not n.
    """

    max_k: int = MAX_DRAFT
    prior_acceptance: float = PRIOR_ACCEPTANCE
    prior_weight: float = PRIOR_WEIGHT
    drafted: list[float] = field(default_factory=list)  # per node index, sized to max_k
    on_path: list[float] = field(default_factory=list)
    depth_sums: list[float] = field(default_factory=list)  # per n - 1: summed depth of the first n nodes

    def __post_init__(self) -> None:
        for counts in (self.drafted, self.on_path, self.depth_sums):
            counts.extend([0.0] * (self.max_k - len(counts)))

    @property
    def observed(self) -> bool:
        """Whether any tree step was observed."""
        return self.drafted[0] > 0

    def betas(self) -> list[float]:
        """β_i for every node index up to `max_k`."""
        betas, prior = [], self.prior_acceptance
        for hits, trials in zip(self.on_path, self.drafted):
            prior = beta_mean(hits, trials, prior, self.prior_weight)
            betas.append(prior)
        return betas

    def gains(self) -> list[float]:
        """gains[n - 1]: tokens a tree's first n nodes add in expectation, Σ_{i<n} β_i."""
        return list(itertools.accumulate(self.betas()))

    def levels(self) -> list[float]:
        """levels[n - 1]: draft forwards (tree depth) a tree's first n nodes take, on average; a size
        never drafted is guessed as deep as the largest one drafted (guessing cheap, so it gets tried)."""
        out, last = [], 1.0
        for depth, trials in zip(self.depth_sums, self.drafted):
            last = depth / trials if trials else last
            out.append(last)
        return out

    def observe(
        self, lengths: list[int], paths: list[list[int]], parents: list[list[int]] | None = None
    ) -> None:
        """Row b verified a tree of `lengths[b]` nodes and accepted the nodes `paths[b]`;
        `parents[b]` (each node's parent, -1 at the root) tells the depth of each prefix."""
        for b, (n, path) in enumerate(zip(lengths, paths)):
            depth, deepest = [], 0
            for i in range(min(n, self.max_k)):
                self.drafted[i] += 1
                parent = parents[b][i] if parents is not None else i - 1  # no parents: a chain
                depth.append(1 if parent < 0 else depth[parent] + 1)
                deepest = max(deepest, depth[-1])
                self.depth_sums[i] += deepest
            for node in path:
                if node < self.max_k:
                    self.on_path[node] += 1


@dataclass
class CostModel:
    """Measured costs: seconds per draft token, and verify seconds per (batch size, width), where a
    width is the tokens one row feeds the target (a plain step is width 1, a k-token draft k + 1).
    Widths never measured are estimated from measured ones alone: no figure about any device.

    A width timed only once more dearly than steady costs can be (see `_predict`) is taken for a
    stall or a GPU's first call at a new shape (several steps' worth): its figure is what the
    widths timed more than once predict, so it gets tried again rather than written off for the
    call, and a second timing says what it costs (of two, the smaller counts). Widths never
    measured are predicted from every measured width as it stands.

    What verifying costs belongs to the model and its device, not to a prompt, so a call starts
    from what earlier calls measured (`carry`): per batch size and width, the ratio of a verify to
    a plain step, which this call's own plain step turns into seconds (a machine's speed drifts
    from one call to the next; the shape of its curve much less) until the call times that width
    itself. Without it every call would pay again for its first look at wider widths, and decide
    from a sample or two where earlier calls had many.
    """

    draft: _Recent = field(
        default_factory=_Recent
    )  # seconds per draft forward (a chain's token, a tree's level)
    asks: _Recent = field(default_factory=_Recent)  # seconds per request for a draft, whatever came back
    verify_times: dict[tuple[int, int], _Recent] = field(default_factory=dict)  # (batch, width) -> seconds
    # The widths each verify forward is padded up to (`DraftLengthPolicy.pad_widths`; () for none):
    # a width is timed and priced as its padded width, so the tokens up to it cost nothing more.
    padded_widths: tuple[int, ...] = ()
    # Seconds a width's first call in a call cost above its second, where that was over twice the
    # second (0.0 where it was not): at shapes no earlier call had verified (`first_calls`: a
    # device paying once a process for a new shape, as kernel selection or graph capture do), and
    # at shapes earlier calls had verified (`repeat_first_calls`: a cost paid again in every call).
    first_calls: _Recent = field(default_factory=lambda: _Recent(keep=8))
    repeat_first_calls: _Recent = field(default_factory=lambda: _Recent(keep=8))
    # From earlier calls (`carry`): (padded widths, batch size, width) -> verify / plain seconds at
    # that batch size, one figure per call that verified the width.
    carried: dict[tuple[tuple[int, ...], int, int], _Recent] = field(default_factory=dict)
    _predicted: dict[tuple[int, int], float | None] = field(default_factory=dict, repr=False, compare=False)
    _known: dict[int, dict[int, float]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def draft_per_token(self) -> float | None:
        return self.draft.value

    def add_draft(self, seconds_per_token: float) -> None:
        self.draft.add(seconds_per_token)

    def pad_widths(self, widths: tuple[int, ...]) -> None:
        """From now on each verify forward is padded up to the next of `widths` (() for none)."""
        self.padded_widths = tuple(sorted(widths))
        self._predicted.clear()

    def padded(self, width: int) -> int:
        """The width a forward of `width` tokens per row is fed at."""
        return padded_width(self.padded_widths, width)

    def add_verify(self, batch_size: int, width: int, seconds: float) -> None:
        width = self.padded(width)
        timings = self.verify_times.setdefault((batch_size, width), _Recent())
        if len(timings.samples) == 1 and width > 1:
            first = timings.samples[0]
            seen = (batch_size, width) in self._verified_before()
            excess = self.repeat_first_calls if seen else self.first_calls
            excess.add(first - seconds if first > 2 * seconds else 0.0)
        timings.add(seconds)
        self._predicted.clear()
        self._known.clear()

    def carry(self, earlier: CostModel | None) -> None:
        """Start from what the calls before measured on the same model and device (`earlier`: the
        last one's costs, holding what the ones before it carried): per width, its ratio to the plain
        step over its last `CARRIED_TIMINGS` timings in the calls before, and what a first call at a new
        width cost. Draft costs belong to the drafter and are not carried."""
        if earlier is None:
            return
        self.carried = {key: _copy(ratios) for key, ratios in list(earlier.carried.items())}
        for (batch, width), timings in list(earlier.verify_times.items()):
            plain = earlier.verify(batch, 1)
            if width > 1 and plain:
                # Each timing as it was (not the call's estimate, which takes the smaller of two:
                # a median of such minima would carry a low guess), so the median is of many.
                ratios = self.carried.setdefault(
                    (earlier.padded_widths, batch, width), _Recent(keep=CARRIED_TIMINGS)
                )
                for seconds in timings.samples:
                    ratios.add(seconds / plain)
        self.first_calls = _copy(earlier.first_calls)
        self.repeat_first_calls = _copy(earlier.repeat_first_calls)
        self._predicted.clear()
        self._known.clear()

    def _verified_before(self) -> set[tuple[int, int]]:
        """(batch size, width) shapes the calls this one carries verified, at this call's padding."""
        return {(b, w) for (pads, b, w) in self.carried if pads == self.padded_widths}

    def first_call_seconds(self, batch_size: int, width: int) -> float:
        """What verifying at this width in this call is expected to cost once, on top of its steady
        cost: nothing once this call verified it; else the median first-call excess measured at
        shapes like it (new to the process, or verified by an earlier call), once two widths were
        timed twice (else 0: a width is tried rather than guessed dear)."""
        key = (batch_size, self.padded(width))
        if key in self.verify_times:
            return 0.0
        return _learnt_excess(self.repeat_first_calls if key in self._verified_before() else self.first_calls)

    def pricing(
        self, batch_size: int, uses: int = 8, tokens_left: int | None = None, widen: bool = True
    ) -> Callable[[int], float | None]:
        """Verify seconds per width for choosing a width: what feeding it costs at `feeding`'s
        choice of the width to feed it at."""
        feed = self.feeding(batch_size, uses, tokens_left, widen)
        return lambda width: feed(width)[1]

    def feeding(
        self, batch_size: int, uses: int = 8, tokens_left: int | None = None, widen: bool = True
    ) -> Callable[[int], tuple[int, float | None]]:
        """Per width, the width to feed a forward of that many tokens a row at and what it costs:
        `verify`, plus its expected first-call cost in this call (`first_call_seconds`) spread over
        the steps it can serve (a new width is worth a one-off only if it will serve a while):
        `uses`, and where the call has `tokens_left` to generate, no more than the steps those
        take at that width if every draft holds. Near a call's end, or in a short call, a new
        width serves a step or two: spread over eight, its one-off looked cheap, and a call of
        twenty-odd steps paid six steps' worth for a width it verified once or twice (a 6-token
        draft with 7 tokens to go). Where a device pays for a shape once a process, the widths
        earlier calls verified come at their steady cost and the others with the one-off, so calls
        keep to the widths already paid for; where it pays in every call, all widths not yet
        verified in this one carry it.

        A width that would pay a one-off is fed instead at the next wider width already paid for,
        its columns past the draft holes, where that costs less: a draft that found fewer tokens
        than the widths paid for was otherwise cut to a paid width below it, down to plain steps
        (replay, flat+oneoff: mt_bench 0.89 of the figure without one-offs). Each width is fed
        as it is until first calls were timed at two widths, and where it cannot be widened
        (`widen` False: a tree, whose nodes past its own are not holes). Once they were, and no
        one-off was learnt, a width is still fed at a wider one already timed where that was
        timed cheaper (noisy timings of a flat curve: feeding more tokens never costs less)."""
        if not self.first_calls.confirmed and not self.repeat_first_calls.confirmed:
            return lambda width: (width, self.verify(batch_size, width))  # no one-off seen

        # The widths that cost no one-off now: verified in this call, or by the calls it carries
        # where what those cost again in a call was learnt to be nothing (as `first_call_seconds`).
        paid = {w for b, w in self.verify_times if b == batch_size}
        if not _learnt_excess(self.repeat_first_calls):
            paid |= {w for b, w in self._verified_before() if b == batch_size}
        widths = tuple(sorted(paid))

        def feed(width: int) -> tuple[int, float | None]:
            seconds = self.verify(batch_size, width)
            if seconds is None:
                return width, None
            serves = uses if tokens_left is None else max(1, min(uses, tokens_left // width))
            seconds += self.first_call_seconds(batch_size, width) / serves
            wider = padded_width(widths, width) if widen else width
            if wider > width and (padded := self.verify(batch_size, wider)) is not None and padded < seconds:
                return wider, padded
            return width, seconds

        return feed

    def measured_wide(self) -> bool:
        """Whether any verify of a draft has been timed (at any batch size: the nearest stands in),
        in this call or, at the widths this call pads to, in the calls it carries."""
        return self.verified_here() or any(
            pads == self.padded_widths and len(ratios.samples) >= CARRIED_MIN
            for (pads, _, _), ratios in self.carried.items()
        )

    def new_shapes_are_dear(self) -> bool:
        """Whether first calls at new widths were seen to cost a one-off (`first_calls`, or
        `repeat_first_calls` for widths earlier calls verified): a new shape is likely to, too."""
        return any(_learnt_excess(excess) > 0.0 for excess in (self.first_calls, self.repeat_first_calls))

    def verified_here(self) -> bool:
        """Whether this call verified a draft (at any width above a plain step)."""
        return any(w > 1 for (_, w) in self.verify_times)

    def verify(self, batch_size: int, width: int) -> float | None:
        """Predicted verify seconds at this width, from the nearest measured widths; None until a
        plain step was measured (at this batch size, or the nearest one measured)."""
        # The policy asks for every width several times a step; predictions change only with a
        # new measurement.
        key = (batch_size, self.padded(width))
        if key not in self._predicted:
            self._predicted[key] = self._predict(*key)
        return self._predicted[key]

    def _measured(self, batch_size: int) -> dict[int, _Recent]:
        """Width -> its timings at this batch size, or at the nearest one measured."""
        if batch_size not in self._known:
            sizes = sorted({b for b, _ in self.verify_times}, key=lambda b: abs(b - batch_size))
            self._known[batch_size] = (
                {w: e for (b, w), e in self.verify_times.items() if b == sizes[0]} if sizes else {}
            )
        return self._known[batch_size]

    def _predict(self, batch_size: int, width: int) -> float | None:
        measured = self._measured(batch_size)
        known = {w: e.value for w, e in measured.items()}
        if 1 in known and (wider := [w for w in known if w > 1]):
            # A forward feeding one token a row costs no more than one feeding more: where the
            # narrowest wider one was timed cheaper, the plain steps were timed in a stall, and are
            # not timed again while drafting goes on. Held at their figure on a loaded CPU, a draft
            # that never held looked cheaper than a plain step for the rest of the call (0 of 40
            # accepted). The narrowest only: the least of many noisy widths would guess low.
            known[1] = min(known[1], known[min(wider)])
        carried = self._carried(batch_size, known.get(1))
        if width > 1 and 1 in known and all(w == 1 for w in known) and not carried:
            return self._scaled_from_other_batch(batch_size, width, known[1])
        known = carried | known  # this call's own timings first
        if width not in measured or width == 1 or measured[width].confirmed:
            return _from_widths(known, width)
        # Timed once: trusted unless it is further above the curve of the widths timed more
        # than once (or carried) than steady costs can be (more than `width` plain steps, the most
        # feeding `width` tokens costs where every token is computed in full; or, once a wider
        # draft was confirmed, over twice that curve): then a stall, to be timed again.
        trusted = {w: known[w] for w in known if w not in measured or measured[w].confirmed or w == 1}
        guess = _from_widths(trusted, width)
        if guess is None:
            return known[width]
        ceiling = 2 * guess if len(trusted) > 1 else width * known[1]
        return guess if known[width] > ceiling else known[width]

    def _carried(self, batch_size: int, plain: float | None) -> dict[int, float]:
        """Width -> seconds at this batch size from the carried ratios, at this call's plain step."""
        if not plain:
            return {}
        return {
            w: ratios.value * plain
            for (pads, b, w), ratios in self.carried.items()
            if b == batch_size and pads == self.padded_widths and len(ratios.samples) >= CARRIED_MIN
        }

    def _scaled_from_other_batch(self, batch_size: int, width: int, plain: float) -> float:
        """A width at a batch size whose plain step alone was measured (rows finished, the batch
        shrank): the curve of the nearest batch size where drafts were verified, scaled by the two
        plain steps' ratio; else the ratios earlier calls carried at the nearest batch size; the
        plain step itself (flat) where there are none. Taking unmeasured widths as flat there made a
        compute-bound batch verify wide drafts each time its size changed, and, where only another
        batch size's ratios were carried, a batch of 8 verify 16-token drafts under `linear` costs
        (replay, linear+noise: twenty plain steps' worth for one forward)."""
        sizes = sorted(
            {b for b, w in self.verify_times if w > 1 and (b, 1) in self.verify_times},
            key=lambda b: abs(b - batch_size),
        )
        if sizes:
            other = {w: e.value for (b, w), e in self.verify_times.items() if b == sizes[0]}
            return (_from_widths(other, width) or other[1]) * plain / other[1]
        carried = {
            (b, w): ratios.value
            for (pads, b, w), ratios in self.carried.items()
            if pads == self.padded_widths and len(ratios.samples) >= CARRIED_MIN
        }
        if not carried:
            return plain
        nearest = min({b for b, _ in carried}, key=lambda b: abs(b - batch_size))
        ratios = {1: 1.0} | {w: ratio for (b, w), ratio in carried.items() if b == nearest}
        return (_from_widths(ratios, width) or 1.0) * plain


def _from_widths(known: dict[int, float], width: int) -> float | None:
    """Verify seconds at `width` from measured seconds per width (`known`), None without a plain step."""
    if not known:
        return None
    if width in known:
        return known[width]
    if width == 1 or 1 not in known:
        return None
    # Between measured widths (a plain step included): along the power law through the two
    # nearest, as beyond them. Verify cost bends down where a few rows run less efficiently than
    # one (a CPU's small matrix products: the second token costs half a step, the tenth a tenth),
    # and there a straight chord guessed low: weak drafts were verified at widths that cost
    # twice a step, each rejection a step lost. Where cost bends up (flat, then linear: a GPU)
    # the power law guesses a little high, on a curve so flat that it changes little.
    below = [w for w in known if w < width]
    above = [w for w in known if w > width]
    if below and above:
        lo, hi = max(below), min(above)
        if known[lo] <= 0 or known[hi] <= 0:
            return known[lo] + (known[hi] - known[lo]) * (width - lo) / (hi - lo)
        return known[lo] * (width / lo) ** (math.log(known[hi] / known[lo]) / math.log(hi / lo))
    # Beyond what was measured: follow the power law width^p through the plain step and the
    # widest measurement, with 0 <= p <= 1 (flat when only plain steps were measured; at most
    # in proportion to the tokens fed, as on a compute-bound device). Verify cost is flat and
    # then grows about linearly, so the curve bends upwards and this guesses low, not high.
    edge = max(below)
    plain, widest = known[1], known[edge]
    if edge == 1 or plain <= 0 or widest <= plain:
        return widest
    power = min(math.log(widest / plain) / math.log(edge), 1.0)
    return widest * (width / edge) ** power


def expected_gains(alphas: list[float]) -> list[float]:
    """gains[k - 1]: tokens the first k draft tokens add in expectation, Σ_{j≤k} Π_{i≤j} α_i."""
    survive, total, gains = 1.0, 0.0, []
    for alpha in alphas:
        survive *= alpha
        total += survive
        gains.append(total)
    return gains


def best_width(
    rows: list[list[float]],
    draft_cost: float,
    verify: Callable[[int], float],
    remaining: list[int] | None = None,
) -> tuple[int, float]:
    """The draft width k that finishes the batch soonest (0 means plain decoding), and how much
    sooner than plain decoding (a ratio of times; 1.0 when k is 0).

    `rows` holds each row's α list; row b drafts min(k, len(rows[b])) tokens and has
    `remaining[b]` tokens left to generate. `draft_cost` is seconds per draft token and
    `verify(width)` the seconds of one target forward that feeds each row `width` tokens. A step
    advances row b by 1 + g_b(k) expected tokens, so the batch needs about
    max_b remaining_b / (1 + g_b(k)) more steps: drafting pays only where it speeds up the rows
    that have the most left to do. With one row this is the tokens-per-second rule of Leviathan et al.
    """
    return fastest_width([expected_gains(alphas) for alphas in rows], draft_cost, verify, remaining)


def fastest_width(
    gains: list[list[float]],
    draft_cost: float,
    verify: Callable[[int], float],
    remaining: list[int] | None = None,
    levels: list[float] | None = None,
) -> tuple[int, float]:
    """`best_width` from each row's expected gains, gains[b][k - 1] the tokens k draft tokens (or
    tree nodes: `TreeAcceptance.gains`) add to row b's step, rather than from its α list.
    `draft_cost` is seconds per draft forward; k tokens take k forwards, or `levels[k - 1]` for a
    tree (`TreeAcceptance.levels`)."""
    remaining = remaining or [1] * len(gains)
    plain_time = max(remaining) * verify(1)
    best_k, best_time = 0, plain_time / PLAIN_MARGIN
    for k in range(1, max((len(g) for g in gains), default=0) + 1):
        steps = max(r / (1.0 + (g[min(k, len(g)) - 1] if g else 0.0)) for r, g in zip(remaining, gains))
        forwards = levels[min(k, len(levels)) - 1] if levels else k
        time = steps * (forwards * draft_cost + verify(k + 1))
        if time < best_time:
            best_k, best_time = k, time
    return best_k, plain_time / best_time if best_k else 1.0


@dataclass
class ProbeSchedule:
    """When to try drafting again once plain decoding was chosen: after `every` plain steps, then
    twice as many after each probe that found nothing better (exponential back-off, up to 64x)."""

    every: int = 8
    plain_run: int = 0
    backoff: int = 1

    def plain_step_probes(self) -> bool:
        """Count a plain step; whether it is time to probe instead."""
        self.plain_run += 1
        if self.plain_run < self.every * self.backoff:
            return False
        self.plain_run = 0
        self.backoff = min(self.backoff * 2, 64)
        return True

    def reset(self) -> None:
        """Drafting pays again: the next plain run starts from the shortest wait."""
        self.plain_run, self.backoff = 0, 1


@dataclass
class RealizedAsks:
    """What the last few asks for a draft actually gave: the tokens the batch's critical row (the
    one with the most left to generate, which sets when the batch is done) advanced and the seconds
    the step took, drafting included, whether or not anything was left to verify after the cut.

    The prediction behind an ask can be wrong in ways no estimate here sees: in a batch, α is
    learnt over all rows while the batch waits for its slowest one, so most drafts get cut away
    after they were paid for; a drafter's cost per request can be most of a step. Held against
    plain decoding's rate, the realized one says whether asking pays, whatever the cause."""

    window: int = 16
    steps: list[tuple[float, float]] = field(default_factory=list)  # (tokens, seconds) per ask

    def add(self, tokens: float, seconds: float) -> None:
        self.steps = [*self.steps[-(self.window - 1) :], (tokens, seconds)]

    def pays(self, plain_seconds: float) -> bool:
        """Whether the last `window` asks advanced faster than plain steps would have (by
        `PLAIN_MARGIN`); True until that many were seen."""
        if len(self.steps) < self.window:
            return True
        tokens, seconds = map(sum, zip(*self.steps))
        return _beats_plain(tokens, seconds, plain_seconds)


def _beats_plain(tokens: float, seconds: float, plain_seconds: float) -> bool:
    """Whether `tokens` in `seconds` is faster than plain steps of `plain_seconds` by `PLAIN_MARGIN`."""
    return seconds * PLAIN_MARGIN < tokens * plain_seconds


class AdaptiveDraftLength:
    """Cost-aware draft length; its state lives in the object (one per `generate` call by default).

    Settings are an `AdaptiveSettings` (or its fields as keywords: `AdaptiveDraftLength(first_k=4)`);
    what the policy learns lives in parts that are tested alone: `acceptance`
    (`AcceptanceEstimate`, from chains), `trees` (`TreeAcceptance`, from trees), `costs`
    (`CostModel`) and `probes` (`ProbeSchedule`). The decision itself is `best_width` /
    `fastest_width`, a function of what those parts estimate. Whether the coming draft is a chain or
    a tree it learns from the drafts it is shown: the kind of the last one verified.
    """

    def __init__(
        self,
        settings: AdaptiveSettings | None = None,
        *,
        device_costs: CostModel | None = None,
        **fields: Any,
    ) -> None:
        """`device_costs`: what an earlier call's policy measured of the same model on the same
        device (its `costs`), to start from (`CostModel.carry`); what is accepted is never carried."""
        if settings is not None and fields:
            raise TypeError("Pass either `settings` or its fields as keywords, not both.")
        self.settings = settings if settings is not None else AdaptiveSettings(**fields)
        s = self.settings
        self.acceptance = AcceptanceEstimate(s.max_k, s.prior_acceptance, s.prior_weight)
        self.trees = TreeAcceptance(s.max_k, s.prior_acceptance, s.prior_weight)
        self.costs = CostModel()
        self.costs.carry(device_costs)
        self.probes = ProbeSchedule(s.probe_every)
        self.realized = RealizedAsks(s.realized_window)
        # Every estimate is sized to max_k: a longer first draft (AdaptiveDraftLength(max_k=3) keeps
        # the default first_k of 4) would be judged at positions nothing is known of.
        self._first_k = min(s.first_k, s.max_k)
        self.drafting_trees = False  # the last verified draft was a tree: size trees, not chains
        self._asked = 0  # the draft length last asked for (0: no draft was asked for)
        self._probing = False  # that ask was a probe after plain steps
        self._looking = False  # that ask was a one-token look at carried costs (`_recheck`)
        self._looks = 0  # such looks verified in this call (a draft was left to verify)
        self._critical = 0  # the row with the most left to generate, as the last cut saw it
        self._perfect: dict[tuple[int, int, bool], tuple[int, float]] = {}  # see `_perfect_gain`
        # Whether the loop feeds drafts widened by `trim` (`Draft.widened`): a static cache feeds
        # each draft without its holes, and a width is then priced as what it is fed at.
        self._widens = True
        self._widened_to = 0  # the width the last cut widened its draft to (0: not widened)

    def __repr__(self) -> str:
        return f"AdaptiveDraftLength({self.settings!r})"

    def draft_length(self, batch_size: int) -> int:
        self._probing = self._looking = False
        self._asked = self._draft_length(batch_size)
        return self._asked

    def _draft_length(self, batch_size: int) -> int:
        s = self.settings
        verify = functools.partial(self.costs.verify, batch_size)
        if verify(1) is None:
            return 0  # measure a plain step first: it is what generate would have done anyway
        draft_cost = self.costs.draft_per_token or 0.0
        if not self.costs.measured_wide():
            # Nothing verified wider than a plain step yet: explore, unless the drafter's up-front
            # timing (`expect_draft_cost`) already says drafting cannot pay.
            return (
                self._first_k if self._perfect_gain(batch_size, draft_cost, verify) >= s.min_probe_gain else 0
            )
        if self._drafts_are_free(verify):
            # Asking costs next to nothing (prompt lookup): take the longest draft on offer and let
            # `trim` judge it by its own confidence, which says more than any prediction here.
            if self._perfect_gain(batch_size, draft_cost, verify) < s.min_probe_gain:
                return self._recheck()
            return s.max_k
        levels = self.trees.levels() if self.drafting_trees else None
        pricing = self.costs.pricing(batch_size, widen=self._widens and not self.drafting_trees)
        best_k, _ = fastest_width([self._gains()], draft_cost, pricing, levels=levels)
        if best_k == 0 or not self.realized.pays(verify(1)):
            if self._perfect_gain(batch_size, draft_cost, verify) < s.min_probe_gain:
                return self._recheck()
            self._probing = self.probes.plain_step_probes()
            return self._first_k if self._probing else 0
        self.probes.reset()
        return best_k

    def _recheck(self) -> int:
        """Drafting cannot pay at the verify costs carried from earlier calls: look in this call,
        one token (`trim` keeps it), before believing them. Only a draft verified at a width
        measures it, so a first call's few noisy timings (two tokens timed at twice a plain step
        where they cost 1.4) otherwise ended drafting for every later call of the process. Asked
        until a look is timed: one that drew no draft measured nothing, and on a compiled static
        cache the first forward at a width is its compile, not timed (so up to `MAX_LOOKS`)."""
        if self._looks >= MAX_LOOKS or self.costs.verified_here():
            return 0
        self._looking = True
        return 1

    def _drafts_are_free(self, verify: Callable[[int], float]) -> bool:
        """Whether asking for a draft has cost under `FREE_DRAFT` of a plain step (prompt lookup's
        dictionary probes, not a draft model's forwards)."""
        asked = self.costs.asks.value
        return asked is not None and asked < FREE_DRAFT * verify(1)

    def _perfect_gain(self, batch_size: int, draft_cost: float, verify: Callable[[int], float]) -> float:
        """How much faster than plain decoding drafts that are always accepted would be: even they
        must gain enough for what drafting and verifying cost here, or probing (a step's cost of
        its own, plus the draft's catch-up) cannot pay. A coarse gate with a margin, so it is
        worked out again only every 16 asks or when a new width or batch size gets measured, not
        on every step (where it would be a good part of the loop's own cost on a fast device)."""
        key = (batch_size, len(self.costs.verify_times), self.costs.draft_per_token is None)
        asked, gain = self._perfect.get(key, (16, 0.0))
        if asked >= 16:
            asked, gain = 0, best_width([[1.0] * self.settings.max_k], draft_cost, verify)[1]
        self._perfect[key] = (asked + 1, gain)
        return gain

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        """A first figure for what a draft token costs, timed by the drafter before any drafting
        (`Drafter.probe_seconds`); measured drafts replace it within a few steps. Ignored once
        drafts have been measured (a policy kept across calls)."""
        if self.costs.draft_per_token is None:
            self.costs.add_draft(seconds_per_token)

    def pad_widths(self, widths: tuple[int, ...]) -> None:
        """Price each width as the padded width it is fed at (see `CostModel.padded_widths`)."""
        self.costs.pad_widths(widths)

    def keeps_batch_shape(self) -> bool:
        """Where first calls at new shapes cost a one-off, finished rows stay in the forward: each
        new batch size would be a new shape at every width, a plain step's included, while plain
        batched decoding never changes shape (replay, flat+oneoff, batches of 8: the batch went
        8 -> 5 -> 4 -> 3 -> 2 -> 1 rows, 0.86x plain)."""
        return self.costs.new_shapes_are_dear()

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        self._widened_to = 0
        verify = functools.partial(self.costs.verify, batch_size)
        if verify(1) is None:
            return draft
        if not self.costs.measured_wide() or self._looking:
            # The first draft verified is the first look at what a wider forward costs: one token
            # tells it (the rest of the curve is extrapolated from it) for at most one token's
            # cost where each fed token costs about a step.
            return draft.truncated([min(n, 1) for n in draft.lengths])
        if draft.parents is not None and self.trees.observed:
            # A tree is cut to its first nodes, its best tree of that size, by what trees gained.
            gains = self.trees.gains()
            rows = [gains[:n] for n in draft.lengths]
        elif draft.probs is not None or draft.confidence is None or draft.parents is not None:
            # A sampled draft must not be cut by its own tokens' confidences: keeping token i only
            # when it looks likely would bias which tokens reach the acceptance test, and the
            # output would no longer follow the target's distribution. Cut by position alone.
            gains = expected_gains(self.acceptance.alphas())
            rows = [gains[:n] for n in draft.lengths]
        else:
            # At each bucket's posterior mean: E[α^k] over the posterior (more credit to long
            # drafts while few were seen) lost on a cost-linear device and gained nothing on a flat one.
            rows = [
                expected_gains([self._token_odds(c, i) for i, c in enumerate(row[:n])])
                for row, n in zip(draft.confidence.tolist(), draft.lengths)
            ]
        # Rows share one forward, so they share its width: pick the width that pays for the batch.
        # Drafting is already paid for.
        widen = self._widens and draft.parents is None
        feeding = self.costs.feeding(
            batch_size, tokens_left=max(remaining) if remaining else None, widen=widen
        )
        k, _ = fastest_width(rows, 0.0, lambda width: feeding(width)[1], remaining)
        lengths = [min(n, k) for n in draft.lengths]
        if remaining:
            self._critical = max(range(len(remaining)), key=remaining.__getitem__)
        draft = draft.truncated(lengths) if lengths != draft.lengths else draft
        fed = feeding(k + 1)[0] if k else 0
        self._widened_to = fed if fed > k + 1 else 0
        return draft.widened(fed - 1) if self._widened_to else draft

    def _token_odds(self, confidence: float, position: int) -> float:
        """A draft token's odds of acceptance, given the tokens before it were accepted: its
        confidence as calibrated, and, past the first, at least how often tokens at its position
        were accepted. The calibration pools every later position, while a copy that has held for
        a while tends to go on (α_i is conditional on the earlier positions); without the second
        figure long copies were cut after a few tokens (replay, flat: mt_bench 0.91 -> 0.95 of the
        oracle fixed k). Before the call has seen a position, its α is what the drafter says of
        the token (the confidence is its estimate of just that), not the flat prior: drafts cut at
        nine tokens never showed that the tenth usually holds, and a copy of a repeated passage
        kept being cut there (replay, flat, prompt 134: 3.92x plain against 4.73x for a fixed 16)."""
        calibrated = self.acceptance.calibrated(confidence, position)
        if position == 0:
            return calibrated
        return max(calibrated, self.acceptance.alpha(position, prior=confidence))

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        width = 1 + draft.tokens.shape[1]  # as fed: holes past the drafts cost what tokens do
        if self._widened_to and width < self._widened_to:
            self._widens = False  # the loop fed the draft without the holes the cut added
        if verify_seconds is not None:  # None: a compile, not a verify cost
            self.costs.add_verify(batch_size, width, verify_seconds)
        drafted = any(draft.lengths)
        if self._looking and drafted:
            self._looks += 1
        if self._asked:
            asking = max(draft_seconds - draft.catch_up_seconds, 0.0)  # a catch-up is no cost of asking
            self.costs.asks.add(asking)
            self._realize(accepted, asking, width)
        if not drafted:
            return  # a plain step says nothing about drafts
        # Per draft forward: a tree's level costs one forward whatever its width (a Medusa tree,
        # one pass of its heads, is still priced by its depth: that errs towards small trees).
        forwards = max(draft.depths(), default=1)
        self.costs.add_draft(max(draft_seconds - draft.catch_up_seconds, 0.0) / max(forwards, 1))
        if draft.parents is not None and paths is not None:
            self.drafting_trees = True
            self.trees.observe(draft.lengths, paths, draft.parents.tolist())
            return
        self.drafting_trees = False
        confidence = draft.confidence.tolist() if draft.confidence is not None else None
        self.acceptance.observe(draft.depths(), accepted, confidence)

    def _realize(self, accepted: list[int], draft_seconds: float, width: int) -> None:
        """Hold the ask just verified to what it gave (`RealizedAsks`): its tokens as counted, its
        verify at the cost model's figure for the width (one stall or a device's first call at a
        new shape must not end drafting; `CostModel` already tells those apart). A probe that beat
        plain decoding starts the record afresh: what held asks back may have changed."""
        batch = len(accepted)
        plain, verify = self.costs.verify(batch, 1), self.costs.verify(batch, width)
        if not accepted or plain is None or verify is None:
            return
        tokens, seconds = 1 + accepted[min(self._critical, batch - 1)], draft_seconds + verify
        if self._probing and _beats_plain(tokens, seconds, plain):
            self.realized.steps.clear()
        self.realized.add(tokens, seconds)

    def _gains(self) -> list[float]:
        """Expected gains of the coming draft's first k tokens (or nodes) for k up to `max_k`."""
        if self.drafting_trees:
            return self.trees.gains()
        return expected_gains(self.acceptance.alphas())


class DeviceCosts:
    """What verifying cost on each target model in this process's earlier `auto` calls, for the
    next call's policy to start from (`CostModel.carry`): a call then needs no first look at wider
    widths, and decides from many timings where it has a few of its own. Keyed by the model
    object, held weakly (a model deleted takes its figures with it), and by its device and dtype;
    what is accepted is never carried. `hf_specdec.clear_cache()` forgets it all."""

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary[Any, tuple[Any, Any, CostModel]] = (
            weakref.WeakKeyDictionary()
        )

    def policy(self, model: Any) -> AdaptiveDraftLength:
        """A fresh `AdaptiveDraftLength` for a call on `model`, starting from the costs the last one
        measured (on the same device, in the same dtype); what it measures is kept for the next."""
        device, dtype, earlier = self._by_model.get(model, (None, None, None))
        here = (model.device, model.dtype)
        policy = AdaptiveDraftLength(device_costs=earlier if (device, dtype) == here else None)
        self._by_model[model] = (*here, policy.costs)  # filled in as the call goes
        return policy

    def clear(self) -> None:
        self._by_model.clear()


DEVICE_COSTS = DeviceCosts()

__all__ = [
    "AcceptanceEstimate",
    "AdaptiveDraftLength",
    "AdaptiveSettings",
    "CostModel",
    "DEVICE_COSTS",
    "DeviceCosts",
    "DraftLengthPolicy",
    "FixedDraftLength",
    "PRIOR_ACCEPTANCE",
    "PRIOR_WEIGHT",
    "ProbeSchedule",
    "RealizedAsks",
    "TreeAcceptance",
    "best_width",
    "beta_mean",
    "expected_gains",
    "fastest_width",
]
