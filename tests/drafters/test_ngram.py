"""The `ngram` drafter: what it proposes and the confidences it reports with it, and its index."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from hf_specdec.core.draft import DraftRequest
from hf_specdec.core.policy import PRIOR_ACCEPTANCE
from hf_specdec.drafters import ngram
from hf_specdec.drafters.ngram import (
    ALL,
    FIRST_TOKEN_ODDS,
    LATER_TOKEN_ODDS,
    ONE,
    OTHER_MATCH_PRIOR,
    PROMPT_PASS_TOKENS,
    SPLIT,
    NgramConfig,
    NgramDrafter,
    NgramIndex,
)
from tests.helpers.ngram_reference import ReferenceNgramIndex


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


def _text(rng: random.Random, length: int, vocab: int, repetitive: bool) -> list[int]:
    """Random ids, or text that keeps copying runs of itself (as answers quote their prompts)."""
    tokens: list[int] = []
    while len(tokens) < length:
        if repetitive and len(tokens) > 8 and rng.random() < 0.7:
            at = rng.randrange(len(tokens) - 4)
            tokens += tokens[at : at + rng.randint(1, 12)]
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


def _assert_same_answers(index: NgramIndex, reference: ReferenceNgramIndex, rng: random.Random, vocab: int):
    """Extend both by what a decoding would add, and compare every look-up at every step."""
    for _ in range(40):
        for k in (1, 5, 16):
            assert index.lookup(k) == reference.lookup(k)
            assert index.matches(k) == reference.matches(k)
        text = index.tokens
        if rng.random() < 0.6:  # an accepted draft: a run of the text so far, then the bonus token
            at = rng.randrange(len(text)) if text else 0
            new = text[at : at + rng.randint(0, 6)] + [rng.randrange(vocab)]
        else:
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        index.extend(new)
        reference.extend(new)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    ("vocab", "repetitive"), [(49152, False), (49152, True), (3, True), (1 << 40, False)]
)
@pytest.mark.parametrize(
    ("sizes", "keep"), [(range(1, 5), 16), (range(2, 4), 3), (range(3, 7), 1), (range(1, 2), 2)]
)
def test_the_index_answers_every_look_up_as_the_dict_of_every_ngram_did(seed, vocab, repetitive, sizes, keep):
    """The prompt indexed in one pass (`PromptNgrams`), then token by token: every look-up after
    every extend drafts, votes and branches exactly as the index that kept a dict entry per n-gram
    did (tests/helpers/ngram_reference.py), prompts shorter and longer than the pass's threshold."""
    rng = random.Random(seed)
    length = [0, 3, 700, PROMPT_PASS_TOKENS - 1, PROMPT_PASS_TOKENS, 3000][seed]
    prompt = _text(rng, length, vocab, repetitive)
    index, reference = NgramIndex(sizes, keep), ReferenceNgramIndex(sizes, keep)
    index.extend(prompt)
    reference.extend(prompt)
    assert (index.prompt is not None) == (length >= PROMPT_PASS_TOKENS)
    _assert_same_answers(index, reference, rng, vocab)


@pytest.mark.parametrize("seed", range(20))
def test_short_prompts_indexed_in_one_pass_answer_as_the_dict_did(seed, monkeypatch):
    """The pass over prompts of a few tokens (fewer than the largest n-gram, even one), as any
    prompt would be were the threshold lower."""
    monkeypatch.setattr(ngram, "PROMPT_PASS_TOKENS", 1)
    rng = random.Random(seed)
    sizes, keep = range(rng.randint(1, 3), rng.randint(3, 5) + 1), rng.choice([1, 2, 16])
    prompt = _text(rng, rng.randint(1, 12), 4, repetitive=True)
    index, reference = NgramIndex(sizes, keep), ReferenceNgramIndex(sizes, keep)
    index.extend(prompt)
    reference.extend(prompt)
    assert index.prompt is not None
    _assert_same_answers(index, reference, rng, 4)


def test_ngrams_sharing_a_hash_answer_as_the_dict_did(monkeypatch):
    """With a hash that collides at will (the sum of the tokens), a prompt whose n-grams share a
    hash is indexed by the dict, and a suffix sharing a hash with another n-gram of the prompt
    matches nothing of it."""
    monkeypatch.setattr(ngram, "HASH_BASE", 1)
    monkeypatch.setattr(ngram, "PROMPT_PASS_TOKENS", 1)
    colliding = [1, 2, 5, 2, 1, 5]  # "1 2" and "2 1" share a hash (3), and both have continuations
    index, reference = NgramIndex(range(2, 3), 16), ReferenceNgramIndex(range(2, 3), 16)
    index.extend(colliding)
    reference.extend(colliding)
    assert index.prompt is None
    assert index.lookup(4) == reference.lookup(4)

    distinct = [1, 10, 100, 1000, 7]  # no two 2-grams share a sum
    index, reference = NgramIndex(range(1, 3), 16), ReferenceNgramIndex(range(1, 3), 16)
    index.extend(distinct)
    reference.extend(distinct)
    assert index.prompt is not None
    for new in ([10], [1]):  # the suffix "10 1" hashes as "1 10", which went on with 100
        index.extend(new)
        reference.extend(new)
        assert index.lookup(4) == reference.lookup(4) and index.matches(4) == reference.matches(4)
    assert index.lookup(4)[1] == 1  # the single token 1 matched, not the pair


def test_indexing_a_long_prompt_leaves_no_object_per_token_to_the_garbage_collector():
    """A dict entry per n-gram of the prompt cost about a microsecond of Python per token at the
    first draft, and as many lists for the collector to walk on every full collection (a batch of
    8 prompts of 8,000 tokens: 0.3 s before the first draft, collections included)."""
    prompt = _text(random.Random(0), 4000, 49152, repetitive=True)
    gc.collect()
    before = len(gc.get_objects())
    index = NgramIndex(range(1, 5), 16)
    index.extend(prompt)
    assert len(gc.get_objects()) - before < 100
