"""The `ngram` drafter: what it proposes and the confidences it reports with it."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.core.draft import DraftRequest
from hf_specdec.drafters.ngram import FIRST_TOKEN_ODDS, LATER_TOKEN_ODDS, NgramConfig, NgramDrafter


def _propose(context: list[int], k: int, tree: bool = False, **options):
    ids = torch.tensor([context])
    request = DraftRequest(ids, torch.ones_like(ids), [len(context)], [k], False, None, [0], tree=tree)
    return NgramDrafter(NgramConfig(**options)).propose(request)


@pytest.mark.parametrize(
    ("context", "size"),
    [
        ([10, 11, 12, 13, 14, 15, 16, 9, 10, 11, 12, 13], 4),  # the last four tokens came before
        ([10, 11, 12, 13, 14, 15, 16, 9, 20, 21, 13], 1),  # only the last token did
    ],
)
def test_confidences_are_the_measured_odds_of_the_match_size(context, size):
    """A draft's first token is as likely as a first token of such a match was seen to be, and its
    later ones as a later token's: not a raw score the policy would take for a probability."""
    draft = _propose(context, 3)
    assert draft.lengths == [3] and draft.tokens[0].tolist() == [14, 15, 16]
    assert draft.confidence[0].tolist() == pytest.approx(
        [FIRST_TOKEN_ODDS[size], LATER_TOKEN_ODDS[size], LATER_TOKEN_ODDS[size]]
    )


def test_a_match_longer_than_the_table_takes_its_largest_size():
    context = [10, 11, 12, 13, 14, 15, 16, 9, 10, 11, 12, 13]
    draft = _propose(context, 2, max_ngram=6)
    assert draft.confidence[0].tolist() == pytest.approx([FIRST_TOKEN_ODDS[4], LATER_TOKEN_ODDS[4]])


def test_a_tries_first_nodes_carry_first_token_odds_and_deeper_ones_later_odds():
    context = [10, 11, 12, 7, 10, 11, 13, 8, 10, 11]  # "10 11" went on with 12 then with 13
    draft = _propose(context, 8, tree=True)
    parents = draft.parents[0, : draft.lengths[0]].tolist()
    confidence = draft.confidence[0, : draft.lengths[0]].tolist()
    assert parents.count(-1) == 2 and any(p >= 0 for p in parents)  # two branches, and depth
    for parent, odds in zip(parents, confidence):
        table = FIRST_TOKEN_ODDS if parent < 0 else LATER_TOKEN_ODDS
        assert any(odds == pytest.approx(v) for v in table.values())
