"""What the loop asks of a draft-length policy: a base class whose defaults say what a policy that
needs less does, so that the loop calls every method and probes for none."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft import Draft, DraftCost
from ..verify_shape import VerifyShape


class DraftLengthPolicy:
    """How many tokens to draft each step: subclass it; only `draft_length` has no default.
    `batch_size` counts the rows the target's verify forward holds, finished ones fed holes too."""

    def begin_call(self, shape: VerifyShape, draft_cost: DraftCost, context: int) -> None:
        """Told once a call: how the target's cache feeds a verify forward, how the drafter's cost
        grows with a draft's length, and the prompt's length in tokens. Ignored by default."""

    def draft_length(self, batch_size: int) -> int:
        """Tokens to draft in the coming step (0: decode one token plainly)."""
        raise NotImplementedError

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        """A fresh draft cut to the width worth verifying (`remaining[b]`: tokens row b has left)."""
        return draft

    def update(
        self,
        batch_size: int,
        draft: Draft,
        accepted: list[int],
        draft_seconds: float,
        verify_seconds: float | None,
        paths: list[list[int]] | None = None,
    ) -> None:
        """Learn from the step: the draft as verified, each row's accepted tokens, what drafting and
        verifying took (None: the forward compiled a new width), a tree's accepted `paths`."""

    def observe_target(self, tokens: torch.Tensor) -> None:
        """The tokens the target chose in the step just learnt from (`update`), [B, k + 1]: row b
        emitted `tokens[b, : accepted[b] + 1]`. Ignored by default."""

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        """A draft forward's seconds, timed before any drafting (`Drafter.probe_seconds`)."""

    def keeps_batch_shape(self) -> bool:
        """Whether finished rows stay in the target's forward as holes rather than leave it."""
        return False


@dataclass
class FixedDraftLength(DraftLengthPolicy):
    """Always draft `k` tokens and verify all of them."""

    k: int

    def draft_length(self, batch_size: int) -> int:
        return self.k
