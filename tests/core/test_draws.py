"""`PlainDraws`: the token plain sampling picks at each position, drawn by position in any order."""

from __future__ import annotations

import torch

from hf_specdec.core.draws import KEPT_POSITIONS, PlainDraws


def _plain_picks(probs: torch.Tensor, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What plain decoding draws from `probs` [T, B, V], step by step, and the generator after."""
    torch.manual_seed(seed)
    picks = [torch.multinomial(p, 1).squeeze(-1) for p in probs]
    return picks, torch.default_generator.get_state()


def test_picks_by_position_in_any_order_are_plains_and_the_generator_ends_where_plains_does():
    steps, batch, vocab = KEPT_POSITIONS + 8, 3, 11
    probs = torch.rand(steps, batch, vocab).pow(4).softmax(-1)
    plain, after = _plain_picks(probs, seed=7)

    def ask(row: int, positions: list[int]) -> list[int]:
        return draws.picks([row], [positions], torch.stack([probs[t, row] for t in positions])[None])[
            0
        ].tolist()

    torch.manual_seed(7)
    draws = PlainDraws(batch, prompt_width=5, default=torch.default_generator)
    # Rows apart (row 2 ahead), positions asked again after a rejection, and more positions in
    # flight than are kept: the far ones drawn in order, the early ones drawn again from their state.
    for row, positions in [(0, [0, 1, 2]), (2, [0, 1, 2, 3]), (0, [2, 3]), (2, [4, 5, 6]), (1, [0, 1])]:
        assert ask(row, positions) == [plain[t][row].item() for t in positions]
    far = list(range(steps - 6, steps))
    assert ask(2, far) == [plain[t][2].item() for t in far]
    assert ask(1, [2, 3]) == [plain[t][1].item() for t in (2, 3)]
    assert len(draws.noise) <= KEPT_POSITIONS
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
