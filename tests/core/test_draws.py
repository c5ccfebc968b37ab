"""`PlainDraws`: the token plain sampling picks at each position, drawn by position in any order."""

from __future__ import annotations

import pytest
import torch

import hf_specdec.core.draws
from hf_specdec.core.draws import KEPT_POSITIONS, PlainDraws


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
