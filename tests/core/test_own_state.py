"""`StateGuard`: what counts as state a processor or criterion of one's own keeps between calls."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hf_specdec.core.own_state import KeepsState, StateGuard, own_state


class _Holder:
    def __init__(self) -> None:
        self.seen: dict[int, int] = {}
        self.count = 0
        self.mask = torch.zeros(8)
        self.big = torch.zeros(10_000)


def _guard(holder: _Holder) -> StateGuard:
    return StateGuard(holder, holder, "why.")


def test_the_first_call_may_set_up_and_a_dict_may_only_grow() -> None:
    holder = _Holder()
    guard = _guard(holder)
    holder.count = 3  # set up on the first call, as plain's first call would
    guard.check()
    for prefix in range(4):  # a cache keyed by what it was asked: answers unchanged
        holder.seen[prefix] = prefix
        guard.check()


@pytest.mark.parametrize(
    "change",
    [
        lambda h: setattr(h, "count", h.count + 1),
        lambda h: h.seen.update({0: 1}),  # an entry's answer changed, not added
        lambda h: h.mask.add_(1),  # a small tensor, by value
        lambda h: h.big.add_(1),  # a large one, by its in-place version
    ],
    ids=["counter", "dict-entry", "small-tensor", "large-tensor"],
)
def test_state_that_changes_after_the_first_call_is_refused(change) -> None:
    holder = _Holder()
    holder.seen[0] = 0
    guard = _guard(holder)
    guard.check()
    guard.check()  # unchanged: no refusal
    change(holder)
    with pytest.raises(KeepsState, match="_Holder, which keeps state"):
        guard.check()


def test_a_closure_is_watched_and_transformers_own_processors_are_not() -> None:
    calls = [0]

    def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
        calls[0] += 1
        return [0]

    guard = StateGuard(allowed, own_state(allowed), "why.")
    allowed(0, torch.zeros(1))
    guard.check()
    allowed(0, torch.zeros(1))
    with pytest.raises(KeepsState):
        guard.check()
    assert own_state(RepetitionPenaltyLogitsProcessor(1.2)) is None


def test_a_device_noted_at_every_call_is_no_change() -> None:
    """`tensor.device` is a new `torch.device` at every access: one noted at every call (to move a
    bias there once) is the same device, not state that changed."""
    holder = _Holder()
    guard = _guard(holder)
    for _ in range(3):
        holder.device = torch.zeros(1).device
        guard.check()


@pytest.mark.parametrize(
    "generator, draw",
    [
        (torch.Generator().manual_seed(0), lambda g: torch.rand(1, generator=g)),
        (random.Random(0), lambda g: g.random()),
    ],
    ids=["torch", "random"],
)
def test_a_generator_of_its_own_that_draws_is_state_that_changed(generator, draw) -> None:
    """A generator's state is the user's, though torch's objects are held by identity: one drawn
    from at every call answers otherwise at each."""
    holder = _Holder()
    holder.generator = generator
    guard = _guard(holder)
    guard.check()
    draw(generator)
    with pytest.raises(KeepsState):
        guard.check()
