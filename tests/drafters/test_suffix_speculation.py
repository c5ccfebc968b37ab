"""The `suffix` drafter's speculation (`suffix_speculation.py`) on hand-made corpora: the vote by
frequency and recency, chains and their agreement, learnt odds, and trees merged with prompt
lookup's."""

from __future__ import annotations

import pytest

from hf_specdec.drafters.ngram import ALL, FIRST_TOKEN_ODDS, LATER_TOKEN_ODDS, ONE, SPLIT
from hf_specdec.drafters.suffix import SuffixConfig, draft_limit
from hf_specdec.drafters.suffix_speculation import Chain, CorpusOdds, corpus_tree, merge_trees

from ..helpers.suffix import chain, corpus


def test_the_vote_goes_by_frequency_then_by_recency():
    # "1 2" went on with 3 twice, then with 4 once (most recently): frequency wins.
    snapshot = corpus([1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7])
    assert chain(snapshot, [1, 2], max_spec_offset=1).tokens[0] == 3
    # Equal counts: the most recent.
    snapshot = corpus([1, 2, 3, 9], [1, 2, 4, 7])
    assert chain(snapshot, [1, 2], max_spec_offset=1).tokens[0] == 4
    # Recency weighs in: two old occurrences of 3 against a newer one of 4, with 3 sequences between.
    snapshot = corpus([1, 2, 3], [1, 2, 3], [0], [0], [0], [1, 2, 4])
    assert chain(snapshot, [1, 2], half_life=None, max_spec_offset=1).tokens[0] == 3
    assert chain(snapshot, [1, 2], half_life=1.0, max_spec_offset=1).tokens[0] == 4


def test_occurrences_older_than_a_thousand_half_lives_still_vote():
    """2^(-age / half_life) underflows to 0 past ~1075 half-lives: a match found only in such old
    sequences must still vote, by recency among them, in a chain and in a tree."""
    snapshot = corpus([1, 2, 5, 6], [1, 2, 3, 4], [1, 2, 3, 4], *[[0]] * 1100, bound=2000)
    assert chain(snapshot, [1, 2], half_life=1.0, max_spec_offset=8).tokens == [3, 4]
    match = snapshot.match([1, 2], 1.0)
    nodes = corpus_tree(match, 4, 4, 0.0, CorpusOdds())  # min_token_prob 0: the runner-up grows too
    assert [t for t, _, _ in nodes][:2] == [3, 4] and 5 in [t for t, _, _ in nodes]


def test_a_chain_says_how_its_occurrences_agreed_and_stops_where_their_vote_thins():
    snapshot = corpus([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7])
    drafted = chain(snapshot, [1, 2], max_spec_offset=8, min_token_prob=0.1)
    # 3 (all three agree), 4 (two of three; the third goes on with 7), then 5 or 6 (a tie: the newer).
    assert drafted.tokens == [3, 4, 6] and drafted.agreement == [ALL, SPLIT, SPLIT]
    # The product of the winners' shares: 1, 2/3, then 1/3 — under 0.4 the third token is not drafted.
    assert chain(snapshot, [1, 2], max_spec_offset=8, min_token_prob=0.4).tokens == [3, 4]
    one = corpus([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert chain(one, [1, 2], max_spec_offset=8).agreement == [ONE] * 7  # a copy, to the sequence's end


def test_corpus_odds_start_from_prompt_lookups_and_learn_from_replays():
    odds = CorpusOdds()
    drafted = Chain([3, 4, 5], [ONE, ONE, ALL], size=6)
    before = odds.chain(drafted)
    assert before == pytest.approx(
        [FIRST_TOKEN_ODDS[4][ONE], LATER_TOKEN_ODDS[4][ONE], LATER_TOKEN_ODDS[4][ALL]]
    )
    for _ in range(20):
        odds.observe(drafted, [3, 9, 9])  # the first token holds, the second never
    after = odds.chain(drafted)
    assert after[0] > before[0] and after[1] < before[1]
    assert after[2] == before[2]  # never tested: a token after a miss tells nothing
    assert odds.odds(7, ONE, True) == after[0]  # 6 and 7 tokens share a size class
    assert odds.odds(8, ONE, True) == before[0]  # 8 does not


def test_a_corpus_tree_grows_best_first_and_merges_with_prompt_lookups():
    snapshot = corpus([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 7, 8])
    match, config = snapshot.match([1, 2], None), SuffixConfig(max_spec_offset=8)
    nodes = corpus_tree(match, 6, draft_limit(match.size, 6, config), config.min_token_prob, CorpusOdds())
    tokens = [t for t, _, _ in nodes]
    assert tokens[:2] == [3, 4] and set(tokens) == {3, 4, 5, 6, 7, 8}
    for i, (_, parent, odds) in enumerate(nodes):
        assert parent < i and 0 < odds <= 1  # parents first
    # Prompt lookup's trie shares the path 3 -> 4 and adds 9: one trie, likeliest nodes first.
    own = [(3, -1, 0.9), (4, 0, 0.9), (9, 1, 0.5)]
    merged_tokens, merged_parents, merged_odds = merge_trees([own, nodes], 5)
    assert merged_tokens[:2] == [3, 4] and merged_parents[:2] == [-1, 0]
    assert len(merged_tokens) == 5 and len(set(zip(merged_tokens, merged_parents))) == 5  # no duplicates
    assert all(p < i for i, p in enumerate(merged_parents))
    assert merged_odds[:2] == pytest.approx([0.9, 0.9])  # the likelier source's odds for a shared path
