"""The adaptive policy: the acceptance estimates and the cost model put to the decision rule,
before drafting (how long a draft to ask for) and after (where to cut each row's draft)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..draft import Draft, DraftCost
from ..verify_shape import VerifyShape
from .acceptance import MAX_DRAFT, PRIOR_ACCEPTANCE, PRIOR_WEIGHT, AcceptanceEstimate, TreeAcceptance
from .costs import OUT_OF_LINE, CostModel, Feeding
from .decision import (
    PLAIN_MARGIN,
    Gains,
    Remaining,
    drafting_seconds,
    expected_gains,
    fastest_width,
    speedups,
    steps_needed,
)
from .protocol import DraftLengthPolicy

FREE_DRAFT = 0.05  # an ask costing under this share of a plain step is free: ask every step
# One-token looks a call verifies at most where the prior says drafting cannot pay (only a draft
# verified at a width measures it; on a compiled static cache a width's first forward is untimed).
MAX_LOOKS = 2
# Priced at a plain step earlier calls timed, a draft must look this much faster than plain: that
# figure may be off by up to OUT_OF_LINE unseen (a device that sped up), and a plain step times it.
CARRIED_PLAIN_MARGIN = math.exp(OUT_OF_LINE) * PLAIN_MARGIN


@dataclass(frozen=True)
class AdaptiveSettings:
    """What `AdaptiveDraftLength` is tuned by; pass it, or its fields as keywords."""

    first_k: int = 4  # the draft asked for before anything is measured, and by probes
    prior_acceptance: float = PRIOR_ACCEPTANCE  # the prior on each α_i, worth `prior_weight` drafts
    prior_weight: float = PRIOR_WEIGHT
    probe_every: int = 8  # plain steps before a probe
    min_probe_gain: float = 1.1  # probe only while drafts always accepted would beat plain by this
    max_k: int = MAX_DRAFT  # the longest draft
    realized_window: int = 16  # an ask that costs something is held to what this many asks before it gave


def _beats_plain(tokens: float, seconds: float, plain_seconds: float) -> bool:
    return seconds * PLAIN_MARGIN < tokens * plain_seconds


class AdaptiveDraftLength(DraftLengthPolicy):
    """Cost-aware draft length (`AdaptiveSettings` or its fields as keywords; `device_costs`: an
    earlier call's `costs` on the same model and device, to start from). What it learns lives in
    `acceptance`, `trees`, `costs` and `realized`; one per call by default."""

    def __init__(
        self, settings: AdaptiveSettings | None = None, *, device_costs: CostModel | None = None, **kw: Any
    ) -> None:
        if settings is not None and kw:
            raise TypeError("Pass either `settings` or its fields as keywords, not both.")
        self.settings = s = settings if settings is not None else AdaptiveSettings(**kw)
        self.acceptance = AcceptanceEstimate(s.max_k, s.prior_acceptance, s.prior_weight)
        self.trees = TreeAcceptance(s.max_k, s.prior_acceptance, s.prior_weight)
        self.costs = CostModel()
        self.costs.carry(device_costs)
        self.draft_cost = DraftCost.PER_TOKEN  # as the drafter declares it (`begin_call`)
        self.drafting_trees = False  # the last draft verified was a tree
        self.realized: list[tuple[float, float]] = []  # (tokens the critical row advanced, seconds) an ask
        self._first_k, self._plain_run, self._backoff = min(s.first_k, s.max_k), 0, 1
        self._asked, self._probing, self._looking, self._looks, self._critical = 0, False, False, 0, 0
        self._cut_chooses = True  # the step's length is chosen at the cut (`trim`), not before drafting
        # Rows whose chain draft `trim` cut to nothing: (rows, first tokens, their confidences).
        self._unverified: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin_call(self, shape: VerifyShape, draft_cost: DraftCost, context: int) -> None:
        self.draft_cost = draft_cost
        self.costs.begin(shape, context)

    def keeps_batch_shape(self) -> bool:
        return self.costs.new_shapes_are_dear()  # a batch of another size is a new shape at every width

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        if self.costs.draft.value is None:
            self.costs.draft.add(seconds_per_token)

    def draft_length(self, batch_size: int) -> int:
        self._probing = self._looking = False
        self._asked = self._choose(batch_size)
        return self._asked

    def _choose(self, batch: int) -> int:
        s, plain = self.settings, self.costs.verify(batch, 1)
        self._cut_chooses = True
        if plain is None:
            return 0  # none timed, none carried: time a plain step first
        pays = self._perfect_gain(batch, self._drafting) >= s.min_probe_gain
        if not self.costs.measured_wide():
            return self._first_k if pays else 0  # a first look (`trim` keeps a token)
        if not pays:  # a draft this slow never pays; verifies timed this dear, a few times, may be stalls
            dear = self._perfect_gain(batch, lambda k: 0.0) < s.min_probe_gain
            return self._look(probe=dear)
        asked = self.costs.asks.value
        if self.draft_cost is DraftCost.FREE if asked is None else asked < FREE_DRAFT * plain:
            return s.max_k  # free: the draft's own confidences, read by `trim`, say more
        k = s.max_k  # a look-up or a block costs one ask whatever its length: held to what asks gave
        if self.draft_cost is DraftCost.PER_TOKEN:
            feeding = self.costs.feeding(batch, widen=not self.drafting_trees)
            gains = self.trees.gains() if self.drafting_trees else expected_gains(self.acceptance.alphas())
            k = self._fastest(batch, [gains], None, feeding, drafted=False, earns=True)  # its draft: k tokens
            self._cut_chooses = False
        window = self.realized
        realized = len(window) < s.realized_window or _beats_plain(*map(sum, zip(*window)), plain)
        if k == 0 or not realized:  # what asks gave shows what no estimate sees (a batch's slowest row)
            self._probing = self._probe_due()
            return self._first_k if self._probing else 0
        self._plain_run, self._backoff = 0, 1
        return k

    def _probe_due(self) -> bool:
        """After `probe_every` plain steps probe, then wait twice as long after each probe (up to 64x)."""
        self._plain_run += 1
        if self._plain_run < self.settings.probe_every * self._backoff:
            return False
        self._plain_run, self._backoff = 0, min(self._backoff * 2, 64)
        return True

    def _look(self, probe: bool = False) -> int:
        """One token to verify where the costs say no draft pays: before believing a prior, and
        (`probe`) at probe times, lest a few stalled timings end drafting for the call."""
        first = self._looks < MAX_LOOKS and not self.costs.verified_here()
        self._looking = first or probe and self._probe_due()
        return int(self._looking)

    def _drafting(self, k: int) -> float:
        per_ask = self.draft_cost is not DraftCost.PER_TOKEN and self.costs.asks.value is not None
        seconds = (self.costs.asks if per_ask else self.costs.draft).value or 0.0
        levels = self.trees.levels() if self.drafting_trees else None
        return drafting_seconds(self.draft_cost, seconds, k, levels)

    def _perfect_gain(self, batch: int, drafting: Callable[[int], float]) -> float:
        """How much faster than plain decoding drafts always accepted would be."""
        perfect = [list(range(1, self.settings.max_k + 1))]
        return fastest_width(perfect, drafting, lambda w: self.costs.verify(batch, w))[1]

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        if self.costs.verify(batch_size, 1) is None:
            return draft
        if not any(draft.lengths):  # a plain step serves at most each token left
            steps_left = (lambda w: max(remaining)) if remaining else None
            return self._fed(draft, 0, self.costs.feeding(batch_size, steps_left))
        if not self.costs.measured_wide() or self._looking:
            return draft.truncated([min(n, 1) for n in draft.lengths])  # one token tells a width's cost
        gains = self._row_gains(draft)  # a width serves as many steps as the call takes drafting at it
        steps_left = (lambda w: steps_needed(gains, remaining, w - 1)) if remaining else None
        feeding = self.costs.feeding(batch_size, steps_left, widen=draft.parents is None)
        k = self._fastest(batch_size, gains, remaining, feeding, drafted=True, earns=self._cut_chooses)
        if k == 0 and not self.costs.carried_at(batch_size) and self._look():
            k = 1  # priced from what another batch size cost, no draft pays: one token tests it
        if remaining:
            self._critical = max(range(len(remaining)), key=remaining.__getitem__)
        lengths = [min(n, k) for n in draft.lengths]
        self._keep_unverified(draft, lengths)
        draft = draft.truncated(lengths) if lengths != draft.lengths else draft
        return self._fed(draft, k, feeding)

    @staticmethod
    def _fed(draft: Draft, k: int, feeding: Feeding) -> Draft:
        """The draft fed at the width `feeding` prices it at: holes past it where a wider width paid
        for costs less than its own unpaid one's one-off, a plain step's too."""
        fed = feeding(k + 1)[0]
        return draft.widened(fed - 1) if fed > k + 1 else draft

    def _fastest(
        self, batch: int, gains: Gains, remaining: Remaining, feeding: Feeding, drafted: bool, earns: bool
    ) -> int:
        """The fastest width as fed (`feeding`), before drafting or at the cut (`drafted`); where this
        chooses the step's length (`earns`), each width not paid for that would beat it at its steady
        cost earns the seconds it would have saved (`CostModel.regret`)."""
        drafting = (lambda k: 0.0) if drafted else self._drafting
        verify = lambda w: feeding(w)[1]  # noqa: E731
        margin = CARRIED_PLAIN_MARGIN if self.costs.plain_is_carried(batch) else PLAIN_MARGIN
        k, rate = fastest_width(gains, drafting, verify, remaining, margin)
        if earns and self.costs.new_shapes_are_dear():
            seconds = drafting(k) + verify(k + 1) if k else self.costs.verify(batch, 1)
            steady = speedups(gains, drafting, lambda w: self.costs.verify(batch, w), remaining)
            wins = {j + 1: seconds * (1 - rate / r) for j, r in enumerate(steady) if j and r > rate}
            self.costs.add_regret(batch, wins)
        return k

    def _keep_unverified(self, draft: Draft, lengths: list[int]) -> None:
        """Remember the rows whose chain draft the cut leaves none of, their first token to be scored
        against the target's (`observe_target`): else a bucket judged too weak to verify is never
        measured again. A sampled draft is scored by its own odds, a tree by its nodes: not kept."""
        self._unverified = None
        if draft.confidence is None or draft.probs is not None or draft.parents is not None:
            return
        rows = [b for b, (n, cut) in enumerate(zip(draft.lengths, lengths)) if n and not cut]
        if rows:  # compared where the tokens are, read once the target chose (no wait here)
            index = torch.tensor(rows, device=draft.tokens.device)
            confidence = draft.confidence[index.to(draft.confidence.device), 0]
            self._unverified = (index, draft.tokens[index, 0], confidence)

    def observe_target(self, tokens: torch.Tensor) -> None:
        if self._unverified is None:
            return
        index, drafted, confidence = self._unverified
        self._unverified = None
        device = tokens.device
        held = tokens[index.to(device), 0] == drafted.to(device)
        trials = torch.stack([held.to(confidence.dtype), confidence.to(device)], dim=1).tolist()  # one read
        self.acceptance.observe([1] * len(trials), [int(h) for h, _ in trials], [[c] for _, c in trials])

    def _row_gains(self, draft: Draft) -> list[list[float]]:
        """A sampled draft's by position alone (cut by its own tokens it would no longer follow the
        target's distribution); else a chain's by its tokens' odds, a tree's by its nodes' where the
        drafter gives them, and by what trees gained."""
        scored = draft.confidence is not None and draft.probs is None
        if draft.parents is not None and scored:
            rows = zip(draft.confidence.tolist(), draft.parents.tolist(), draft.lengths)
            return [self.trees.gains(odds[:n], parents[:n]) for odds, parents, n in rows]
        if draft.parents is not None and self.trees.observed:
            return [self.trees.gains()[:n] for n in draft.lengths]
        if not scored:  # by position alone, a tree's too before any tree was measured
            return [expected_gains(self.acceptance.alphas())[:n] for n in draft.lengths]
        rows = zip(draft.confidence.tolist(), draft.lengths)
        return [expected_gains([self._token_odds(c, i) for i, c in enumerate(row[:n])]) for row, n in rows]

    def _token_odds(self, confidence: float, position: int) -> float:
        """Its confidence as calibrated; past the first token at least how often its position held
        (a copy that held tends to go on), from the drafter's odds where no draft reached it yet."""
        calibrated = self.acceptance.calibrated(confidence, position)
        return max(calibrated, self.acceptance.alpha(position, prior=confidence)) if position else calibrated

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        width = 1 + draft.tokens.shape[1]  # as fed: holes past the drafts cost what tokens do
        if verify_seconds is not None:
            self.costs.add_verify(batch_size, width, verify_seconds)
        drafted = any(draft.lengths)
        self._looks += self._looking and drafted
        asking = max(draft_seconds - draft.catch_up_seconds, 0.0)  # a catch-up is no cost of asking
        if self._asked:
            self.costs.asks.add(asking)
            self._realize(batch_size, accepted, asking, width)
        if not drafted:
            return
        self.costs.draft.add(asking / max(draft.depths()))  # per forward: a tree's per level
        self.drafting_trees = draft.parents is not None and paths is not None
        if self.drafting_trees:
            self.trees.observe(draft.lengths, paths, draft.parents.tolist())
        else:
            confidence = None if draft.confidence is None else draft.confidence.tolist()
            self.acceptance.observe(draft.depths(), accepted, confidence)

    def _realize(self, batch: int, accepted: list[int], draft_seconds: float, width: int) -> None:
        """What the ask gave, its verify at the cost model's figure (a stall must not end drafting)."""
        plain, verify = self.costs.verify(batch, 1), self.costs.verify(batch, width)
        if not accepted or plain is None or verify is None:
            return
        tokens, seconds = 1 + accepted[min(self._critical, len(accepted) - 1)], draft_seconds + verify
        fresh = self._probing and _beats_plain(tokens, seconds, plain)  # what held asks back may be gone
        window = [] if fresh else self.realized
        self.realized = [*window, (tokens, seconds)][-self.settings.realized_window :]


class DeviceCosts(weakref.WeakKeyDictionary):
    """Per target model (held weakly), its device, dtype and the last `auto` call's costs, which
    the next call's policy starts from; `hf_specdec.clear_cache()` forgets them."""

    def policy(self, model: Any) -> AdaptiveDraftLength:
        where, earlier = self.get(model, (None, None))
        here = (model.device, model.dtype)
        policy = AdaptiveDraftLength(device_costs=earlier if where == here else None)
        self[model] = (here, policy.costs)  # filled in as the call goes
        return policy


DEVICE_COSTS = DeviceCosts()
