"""`PlainDraws`: the token plain sampling picks at each position, drawn by position in any order."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.initialization import guard_torch_init_functions

import hf_specdec.core.draws
from hf_specdec import SpeculativeConfig
from hf_specdec.core.draws import KEPT_POSITIONS, PlainDraws, PrivateDraws

from ..conftest import random_batch, tiny_llama


def _plain_picks(probs: torch.Tensor, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What plain decoding draws from `probs` [T, B, V], step by step, and the generator after."""
    torch.manual_seed(seed)
    picks = [torch.multinomial(p, 1).squeeze(-1) for p in probs]
    return picks, torch.default_generator.get_state()


@pytest.mark.parametrize("kept_bytes", [None, 2 * 3 * 11 * 4])
def test_picks_by_position_in_any_order_are_plains_and_the_generator_ends_where_plains_does(
    kept_bytes, monkeypatch
):
    """As the loop asks them, and with room for only two positions' draws (a large batch x vocab)."""
    steps, batch, vocab = KEPT_POSITIONS + 8, 3, 11
    if kept_bytes is not None:
        monkeypatch.setattr(hf_specdec.core.draws, "KEPT_BYTES", kept_bytes)
    probs = torch.rand(steps, batch, vocab).pow(4).softmax(-1)
    plain, after = _plain_picks(probs, seed=7)

    def ask(positions: list[list[int]]) -> list[list[int]]:
        """One step's picks of every row, as the loop asks them: row b at `positions[b]`."""
        asked = torch.stack([torch.stack([probs[t, row] for t in ts]) for row, ts in enumerate(positions)])
        return draws.picks([0, 1, 2], positions, asked).tolist()

    def plains(positions: list[list[int]]) -> list[list[int]]:
        return [[plain[t][row].item() for t in ts] for row, ts in enumerate(positions)]

    torch.manual_seed(7)
    draws = PlainDraws(batch, prompt_width=5, default=torch.default_generator)
    # Rows apart (row 2 ahead), positions asked again after a rejection, and row 1 fallen further
    # behind than the positions kept: the far ones drawn in order, the early ones again from their state.
    for positions in ([[0, 1, 2], [0, 1, 2], [0, 1, 2]], [[2, 3, 4], [1, 2, 3], [3, 4, 5]]):
        assert ask(positions) == plains(positions)
    far = [[3, 4, 5], [2, 3, 4], list(range(steps - 3, steps))]
    assert ask(far) == plains(far)
    assert draws.states[1] is None and draws.states[2] is not None  # no row needs position 1 again
    assert len(draws.noise) <= (KEPT_POSITIONS if kept_bytes is None else 2)
    draws.finish(steps)
    assert torch.equal(torch.default_generator.get_state(), after)


class _CountingList(list):
    """A list that counts the items written into it by slice assignment."""

    written = 0

    def __setitem__(self, index, value):
        if isinstance(index, slice):
            value = list(value)
            self.written += len(value)
        super().__setitem__(index, value)


def test_a_step_lets_go_of_the_states_of_the_positions_passed_since_the_last_only():
    """Each step lets go of the generator states no row needs again: those of the positions passed
    since the step before, not of every position from the first again (work growing with every token
    generated, quadratic in a long call)."""
    steps, vocab = 300, 5
    draws = PlainDraws(1, 0, torch.Generator())
    draws.states = _CountingList()
    probs = torch.rand(1, 1, vocab).softmax(-1)
    for t in range(steps):
        draws.picks([0], [[t]], probs)
    assert draws.states[: steps - 1] == [None] * (steps - 1)  # still let go of
    assert draws.states.written <= steps


def test_a_draft_sampled_meanwhile_does_not_use_the_same_numbers():
    """The default generator is moved to another stream for the call (a sampling draft model draws
    from it), and set back to plain's end at `finish`."""
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    draws = PlainDraws(1, prompt_width=0, default=torch.default_generator)
    assert not torch.equal(torch.rand(4), expected)
    draws.picks([0], [[0]], torch.full((1, 1, 4), 0.25))
    draws.finish(0)
    assert torch.equal(torch.rand(4), expected)  # no position generated: plain drew nothing


class _Interrupted(Exception):
    pass


class _RaisesAt(StoppingCriteria):
    """Raises once a sequence reaches `length` tokens, as a user's criterion or a Ctrl-C might."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] >= self.length:
            raise _Interrupted
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _InterruptsAt(LogitsProcessor):
    """A KeyboardInterrupt while the scores after `length` tokens are processed."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.length:
            raise KeyboardInterrupt
        return scores


def _rand_after(target, raising, speculative=None, seed=11, batch=3, **kwargs) -> torch.Tensor:
    """The next numbers of torch's default generator after a seeded sampled call raised."""
    input_ids, attention_mask = random_batch(4, batch, min_len=3, max_len=8)
    torch.manual_seed(seed)
    with pytest.raises(raising):
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=30,
            do_sample=True,
            speculative=speculative,
            **kwargs,
        )
    return torch.rand(8)


def _speculative(method: str, draft) -> SpeculativeConfig:
    if method == "ngram":  # one-token matches: drafts on random prompts too
        return SpeculativeConfig(method="ngram", num_draft_tokens=3, options=dict(min_ngram=1))
    return SpeculativeConfig(method="draft_model", draft=draft, num_draft_tokens=3)


def _raising_at(generated: int, batch: int) -> dict:
    width = random_batch(4, batch, min_len=3, max_len=8)[0].shape[1]
    return dict(stopping_criteria=StoppingCriteriaList([_RaisesAt(width + generated)]), eos_token_id=None)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_call_raising_in_a_criterion_leaves_the_generator_where_plain_does(
    target, weak_draft, batch, method
):
    """A criterion that raises at a token: plain leaves the generator after that token's draw, and so
    does speculation, whatever its drafts took meanwhile (a draft model samples from the default
    generator, moved to another stream for the call)."""
    plain = _rand_after(target, _Interrupted, batch=batch, **_raising_at(9, batch))
    ours = _rand_after(
        target, _Interrupted, _speculative(method, weak_draft), batch=batch, **_raising_at(9, batch)
    )
    assert torch.equal(ours, plain)


def test_a_keyboard_interrupt_in_a_processor_leaves_the_generator_where_plain_would_have_been(
    target, weak_draft
):
    """Interrupted while scoring the 9th token's position, plain has drawn 8 tokens; speculation,
    which scores a step's draft positions before it keeps any, leaves the generator after the
    tokens its longest row got, 8 or fewer: where plain's would be after as many, not elsewhere."""
    width = random_batch(4, 3, min_len=3, max_len=8)[0].shape[1]
    torch.manual_seed(11)
    plains = [torch.rand(8)]  # after no token
    plains += [_rand_after(target, _Interrupted, **_raising_at(m, 3)) for m in range(1, 9)]
    interrupt = dict(logits_processor=LogitsProcessorList([_InterruptsAt(width + 8)]), eos_token_id=None)
    assert torch.equal(_rand_after(target, KeyboardInterrupt, **interrupt), plains[8])
    for method in ("ngram", "draft_model"):
        ours = _rand_after(target, KeyboardInterrupt, _speculative(method, weak_draft), **interrupt)
        assert any(torch.equal(ours, plain) for plain in plains), method


def test_draws_made_privately_are_the_default_generators_next_and_leave_it_where_it_was():
    """What building a drafter draws (a module's initialisation, through `torch.nn.init`): the same
    numbers as from the default generator, which another thread may be sampling from meanwhile."""

    def draws() -> list[torch.Tensor]:
        return [torch.nn.Linear(4, 4).weight, torch.nn.init.normal_(torch.empty(3)), torch.randint(9, (3,))]

    torch.manual_seed(0)
    expected = draws()
    torch.manual_seed(0)
    before = torch.default_generator.get_state()
    with PrivateDraws():
        got = draws()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(torch.default_generator.get_state(), before)


def _moves_the_default_generator(build) -> bool:
    torch.manual_seed(0)
    before = torch.default_generator.get_state()
    with PrivateDraws():
        build()
    return not torch.equal(torch.default_generator.get_state(), before)


def test_draws_while_transformers_initialises_a_model_are_private():
    """transformers initialises a model's weights (built from its config, or missing from its
    checkpoint) with torch.nn.init's functions swapped for its guarded copies, which torch's then
    dispatch to the mode as: those draws went unseen, from the default generator."""
    config = tiny_llama(0).config
    assert not _moves_the_default_generator(lambda: type(tiny_llama(0))(config))
    with guard_torch_init_functions():
        assert not _moves_the_default_generator(lambda: torch.nn.Linear(4, 4))


def test_a_tensor_initialised_by_torch_nn_init_is_drawn_for_on_its_own_device():
    """torch.nn.init hands the mode its tensor by name (`tensor=`): the draw was taken to be on the
    default device, a CUDA weight's given a CPU generator (or, as here with the default device
    elsewhere, none at all, drawn from the default generator)."""

    def initialise() -> None:
        torch.set_default_device("meta")
        try:
            torch.nn.init.normal_(torch.empty(3, device="cpu"))
        finally:
            torch.set_default_device(None)

    assert not _moves_the_default_generator(initialise)
