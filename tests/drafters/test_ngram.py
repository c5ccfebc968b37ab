"""The `ngram` drafter: what it proposes and the confidences it reports with it."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.core.draft import DraftRequest
from hf_specdec.core.policy import PRIOR_ACCEPTANCE
from hf_specdec.drafters.ngram import (
    ALL,
    FIRST_TOKEN_ODDS,
    LATER_TOKEN_ODDS,
    ONE,
    OTHER_MATCH_PRIOR,
    SPLIT,
    NgramConfig,
    NgramDrafter,
)


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
    later ones as a later token's: not a raw score the policy would take for a probability. Here
    the suffix occurred once before."""
    draft = _propose(context, 3)
    assert draft.lengths == [3] and draft.tokens[0].tolist() == [14, 15, 16]
    assert draft.confidence[0].tolist() == pytest.approx(
        [FIRST_TOKEN_ODDS[size][ONE], LATER_TOKEN_ODDS[size][ONE], LATER_TOKEN_ODDS[size][ONE]]
    )


def test_a_match_longer_than_the_table_takes_its_largest_size():
    context = [10, 11, 12, 13, 14, 15, 16, 9, 10, 11, 12, 13]
    draft = _propose(context, 2, max_ngram=6)
    assert draft.confidence[0].tolist() == pytest.approx([FIRST_TOKEN_ODDS[4][ONE], LATER_TOKEN_ODDS[4][ONE]])


def test_a_token_its_occurrences_disagree_on_is_less_likely_than_one_they_agree_on():
    """ "7 8" came three times: twice going on with 9 (then 5, 5), once with 6. The vote drafts 9,
    against a dissenting occurrence (`SPLIT`); after "7 8 9" both occurrences say 5 (`ALL`)."""
    context = [7, 8, 9, 5, 5, 1, 7, 8, 6, 2, 7, 8, 9, 5, 5, 3, 7, 8]
    draft = _propose(context, 3, max_ngram=2)
    assert draft.tokens[0].tolist() == [9, 5, 5]
    assert draft.confidence[0].tolist() == pytest.approx(
        [FIRST_TOKEN_ODDS[2][SPLIT], LATER_TOKEN_ODDS[2][ALL], LATER_TOKEN_ODDS[2][ALL]]
    )
    for table in (FIRST_TOKEN_ODDS, LATER_TOKEN_ODDS):  # as measured: a split vote is the weakest
        assert all(odds[SPLIT] < odds[ONE] <= odds[ALL] for odds in table.values())


def test_a_tries_nodes_carry_their_odds_given_their_parent_held():
    """The voted chain's nodes carry a chain's odds; another match's token where the chain's first
    token may fail, (1 - its odds) times γ; that branch's own continuation α (priors: nothing seen)."""
    context = [10, 11, 12, 7, 10, 11, 13, 8, 10, 11]  # "10 11" went on with 12, then with 13
    draft = _propose(context, 8, tree=True)
    n = draft.lengths[0]
    nodes = list(zip(draft.tokens[0, :n].tolist(), draft.parents[0, :n].tolist()))
    odds = dict(zip(nodes, draft.confidence[0, :n].tolist()))
    voted = FIRST_TOKEN_ODDS[2][SPLIT]  # 13, the most recent of a tied vote
    assert odds[13, -1] == pytest.approx(voted)
    assert odds[8, nodes.index((13, -1))] == pytest.approx(LATER_TOKEN_ODDS[2][ONE])
    assert odds[12, -1] == pytest.approx((1 - voted) * OTHER_MATCH_PRIOR)
    assert odds[7, nodes.index((12, -1))] == pytest.approx(PRIOR_ACCEPTANCE)
