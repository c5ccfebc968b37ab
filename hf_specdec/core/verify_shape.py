"""How the target's cache feeds a verify forward, declared once at the start of a call
(`RaggedKV.verify_shape`, `StaticKV.verify_shape`): what a draft-length policy prices widths by.
Plain data; imports nothing of ours at runtime, so the policy never loads the caches."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .draft import Draft


def padded_width(widths: tuple[int, ...], width: int) -> int:
    """The first of the sorted `widths` at or above `width`, or `width` itself past them (or
    without any). A policy asks it for every width it prices, every step: a bisection."""
    i = bisect.bisect_left(widths, width)
    return widths[i] if i < len(widths) else width


@dataclass(frozen=True)
class VerifyShape:
    """What one verify forward of `width` tokens a row really feeds the target."""

    # Each forward is padded up to the next of these sorted widths (a compiled static cache: one
    # graph each), so every width up to a padded one costs what it costs; () where none is.
    widths: tuple[int, ...] = ()
    # Whether columns past a row's draft may be fed as masked holes (`Draft.widened`), which a
    # policy does to verify at a width the device already paid a one-off for.
    feeds_holes: bool = True
    # Whether finished rows stay in every forward (the cache cannot drop them): the batch a
    # forward feeds never shrinks, whatever the policy prefers.
    fixed_batch: bool = False

    def padded(self, width: int) -> int:
        return padded_width(self.widths, width) if self.widths else width

    def check(self, draft: Draft, policy: str) -> None:
        """Refuse a draft fed wider than its rows' tokens where this cache feeds no holes."""
        if not self.feeds_holes and draft.tokens.shape[1] > max(draft.lengths, default=0):
            raise ValueError(
                f"The draft-length policy {policy} widened a draft with holes past its tokens "
                "(Draft.widened), which this cache does not feed (VerifyShape.feeds_holes is False: a "
                "static cache pads widths its own way); return drafts no wider than their longest row."
            )
