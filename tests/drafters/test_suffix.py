"""The `suffix` drafter: its corpus (bound, eviction, threads), matching and scoring on hand-made
corpora, what a call adds, and generate with a filled corpus (greedy identity, trees, auto)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.core.draft import DraftRequest
from hf_specdec.drafters import suffix
from hf_specdec.drafters.ngram import ALL, FIRST_TOKEN_ODDS, LATER_TOKEN_ODDS, ONE, SPLIT
from hf_specdec.drafters.suffix import (
    MAX_MATCH,
    Chain,
    CorpusOdds,
    Snapshot,
    SuffixConfig,
    SuffixCorpus,
    SuffixDrafter,
    bytes_per_token,
    corpus_for,
    corpus_tree,
    merge_trees,
    unit_bytes,
    voted_chain,
)
from hf_specdec.selection.method import resolve_method

from ..conftest import assert_greedy_match, random_batch, tiny_llama


@pytest.fixture(autouse=True)
def _fresh_corpora():
    """Each test starts from empty corpora: they are kept per model, and the session's models are shared."""
    suffix.clear_corpora()
    yield
    suffix.clear_corpora()


def corpus(*sequences: list[int], bound: int = 1000) -> Snapshot:
    return Snapshot.empty(2).added([list(s) for s in sequences], bound)


def held(snapshot: Snapshot) -> list[list[int]]:
    """The sequences a snapshot holds, oldest first."""
    rows = np.split(snapshot.tokens, np.flatnonzero(snapshot.tokens < 0) + 1)
    return [row[:-1].tolist() for row in rows if len(row)]


def chain(snapshot: Snapshot, tail: list[int], budget: int = 8, half_life=None, **options) -> Chain:
    return voted_chain(snapshot.match(tail, half_life), budget, SuffixConfig(**options))


# ---------------------------------------------------------------------------------------------
# The corpus: bound, eviction, memory, threads
# ---------------------------------------------------------------------------------------------


def test_the_bound_in_tokens_holds_and_the_oldest_sequences_go_first():
    snapshot = Snapshot.empty(2)
    for n in range(10):
        snapshot = snapshot.added([[n] * 7], bound=20)
        assert snapshot.num_tokens <= 20
    assert held(snapshot) == [[8] * 7, [9] * 7]  # 21 tokens would not fit: the oldest went
    assert snapshot.numbers.tolist() == [8, 9]
    assert snapshot.occurrences([7])[1] == 0  # an evicted sequence matches nothing
    assert snapshot.occurrences([8])[1] == 1
    # Every key still points at the token it precedes.
    for key, where in zip(snapshot.keys, snapshot.where):
        assert key[:2] == bytes([0, int(snapshot.tokens[where - 1]) + 1])


def test_a_sequence_longer_than_the_bound_keeps_its_last_tokens():
    snapshot = corpus([1, 2, 3], list(range(10, 40)), bound=8)
    assert held(snapshot) == [list(range(32, 40))]


def test_memory_is_a_fixed_size_per_token():
    snapshot = corpus(*[[n, n + 1, n + 2] for n in range(6, 30)], bound=40)
    sequences = len(snapshot.starts)
    # A token's key, its key's position and the token; per sequence its separator, start and number.
    assert snapshot.nbytes == snapshot.num_tokens * bytes_per_token(1000) + sequences * (4 + 8 + 8)
    assert snapshot.num_tokens <= 40
    assert bytes_per_token(49152) == MAX_MATCH * 2 + 8 and bytes_per_token(262144) == MAX_MATCH * 3 + 8


def test_token_ids_take_two_bytes_or_three_and_larger_vocabularies_are_refused():
    assert unit_bytes(49152) == 2 and unit_bytes(65533) == 2 and unit_bytes(65534) == 3
    assert unit_bytes(262144) == 3
    with pytest.raises(ValueError, match="method='ngram'"):
        unit_bytes(1 << 24)
    wide = Snapshot.empty(3).added([[70000, 5, 70000, 6]], 100)  # ids past two bytes match as well
    assert wide.occurrences([9, 70000])[1] == 1 and wide.tokens[wide.occurrences([70000])[0]].tolist() == [
        5,
        6,
    ]


def test_concurrent_adds_lose_nothing_and_readers_never_see_half_an_add():
    shared = SuffixCorpus(vocab_size=1000)
    config = SuffixConfig(max_corpus_tokens=10_000)
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(20):
                shared.add([[w, 500 + i, w, 600 + i]], [1], config)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    def reader() -> None:
        try:
            for _ in range(200):
                snapshot = shared.snapshot
                assert len(snapshot.keys) == len(snapshot.where) == snapshot.num_tokens
                occurrences, size = snapshot.occurrences([3])
                assert all(snapshot.tokens[o - 1] == 3 for o in occurrences.tolist())
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(1, 5)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert shared.num_tokens == 4 * 20 * 4 and len(shared.snapshot.starts) == 80
    assert sorted(shared.snapshot.numbers.tolist()) == list(range(80))


# ---------------------------------------------------------------------------------------------
# Matching and scoring on hand-made corpora
# ---------------------------------------------------------------------------------------------


def test_the_longest_match_is_found_with_its_occurrences():
    snapshot = corpus([5, 6, 7, 8, 9], [1, 5, 6, 7, 3], [6, 7, 4])
    occurrences, size = snapshot.occurrences([0, 5, 6, 7])
    assert size == 3 and snapshot.tokens[occurrences].tolist() == [8, 3]  # "5 6 7" twice; "0" never
    occurrences, size = snapshot.occurrences([2, 6, 7])
    assert size == 2 and sorted(snapshot.tokens[occurrences].tolist()) == [3, 4, 8]
    assert snapshot.occurrences([42])[1] == 0
    long = list(range(100, 130))  # a match longer than the keys: MAX_MATCH tokens of it count
    assert corpus(long + [1]).occurrences(long)[1] == MAX_MATCH


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


def test_a_chain_says_how_its_occurrences_agreed_and_stops_where_their_vote_thins():
    snapshot = corpus([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7])
    drafted = chain(snapshot, [1, 2], max_spec_offset=8, min_token_prob=0.1)
    # 3 (all three agree), 4 (two of three; the third goes on with 7), then 5 or 6 (a tie: the newer).
    assert drafted.tokens == [3, 4, 6] and drafted.agreement == [ALL, SPLIT, SPLIT]
    # The product of the winners' shares: 1, 2/3, then 1/3 — under 0.4 the third token is not drafted.
    assert chain(snapshot, [1, 2], max_spec_offset=8, min_token_prob=0.4).tokens == [3, 4]
    one = corpus([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert chain(one, [1, 2], max_spec_offset=8).agreement == [ONE] * 7  # a copy, to the sequence's end


def test_a_match_drafts_at_most_factor_times_its_length_plus_the_offset():
    snapshot = corpus(list(range(1, 30)))
    assert chain(snapshot, [1, 2], budget=16, max_spec_factor=1.0, max_spec_offset=0).tokens == [3, 4]
    assert chain(snapshot, [1, 2, 3], budget=16, max_spec_factor=2.0, max_spec_offset=1).tokens == list(
        range(4, 11)
    )
    assert len(chain(snapshot, list(range(1, 17)), budget=5).tokens) == 5  # the step's budget first


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
    nodes = corpus_tree(snapshot.match([1, 2], None), 6, SuffixConfig(max_spec_offset=8), CorpusOdds())
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


def test_prompt_lookup_and_the_corpus_draft_by_their_expected_tokens():
    """Per row, the draft with more expected tokens: the corpus where the context has no match."""
    corpus_for_target = SuffixCorpus(vocab_size=64)
    config = SuffixConfig(min_gain=0.0, max_spec_offset=8)
    corpus_for_target.add([[10, 11, 12, 13, 14, 15, 16]], [0], config)
    drafter = SuffixDrafter(config, corpus_for_target)
    ids = torch.tensor([[20, 21, 10, 11, 12]])
    request = DraftRequest(ids, torch.ones_like(ids), [5], [4], False, None, [0])
    draft = drafter.propose(request)
    assert draft.tokens[0].tolist() == [13, 14, 15, 16]
    # A longer match in the context, going on otherwise, wins instead.
    ids = torch.tensor([[9, 10, 11, 12, 30, 31, 32, 33, 9, 10, 11, 12]])
    request = DraftRequest(ids, torch.ones_like(ids), [12], [4], False, None, [0])
    assert SuffixDrafter(config, corpus_for_target).propose(request).tokens[0].tolist() == [30, 31, 32, 33]


# ---------------------------------------------------------------------------------------------
# generate with a corpus
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_no_eos():
    return tiny_llama(0, eos_token_id=None)


def _generate(model, input_ids, attention_mask, spec, new=24, **kwargs):
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new,
        do_sample=False,
        speculative=spec,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_a_call_adds_each_rows_unpadded_prompt_and_output(target_no_eos):
    input_ids, attention_mask = random_batch(3, 2)
    out = _generate(target_no_eos, input_ids, attention_mask, "suffix", new=6)
    width = input_ids.shape[1]
    expected = [
        input_ids[b][attention_mask[b].bool()].tolist() + out.sequences[b, width:].tolist() for b in range(2)
    ]
    assert held(corpus_for(target_no_eos).snapshot) == expected


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_is_identical_to_plain_with_a_filled_corpus(target_no_eos, tree):
    """Batch 1 and a left-padded batch of 2, the corpus filled by earlier calls on the same prompts:
    their outputs are drafted whole, and the output is plain's."""
    spec = SpeculativeConfig(method="suffix", options={"min_gain": 0.0}, num_draft_tokens=8, tree=tree)
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=8, tree=tree)
    for batch, seed in ((1, 4), (2, 5)):
        input_ids, attention_mask = random_batch(seed, batch)
        plain = target_no_eos.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False
        )
        _generate(target_no_eos, input_ids, attention_mask, spec)  # fills the corpus
        out = _generate(target_no_eos, input_ids, attention_mask, spec)
        assert_greedy_match(target_no_eos, plain, out.sequences, attention_mask)
        lookup = _generate(target_no_eos, input_ids, attention_mask, ngram)
        assert out.speculative_stats.target_forwards < lookup.speculative_stats.target_forwards / 2


def test_concurrent_generate_calls_each_match_plain_and_all_reach_the_corpus(target_no_eos):
    batches = [random_batch(seed, 1) for seed in range(10, 14)]
    plain = [
        target_no_eos.generate(input_ids=i, attention_mask=m, max_new_tokens=12, do_sample=False)
        for i, m in batches
    ]
    spec = SpeculativeConfig(method="suffix", options={"min_gain": 0.0}, num_draft_tokens=4)
    outputs: dict[int, torch.Tensor] = {}

    def call(n: int) -> None:
        for _ in range(2):  # the second call drafts from the others' outputs and its own
            outputs[n] = _generate(target_no_eos, *batches[n], spec, new=12).sequences

    threads = [threading.Thread(target=call, args=(n,)) for n in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, (_, mask) in enumerate(batches):
        assert_greedy_match(target_no_eos, plain[n], outputs[n], mask)
    assert len(corpus_for(target_no_eos).snapshot.starts) == 2 * len(batches)


def test_no_corpus_makes_it_prompt_lookup(target_no_eos):
    input_ids, attention_mask = random_batch(6, 2)
    spec = dict(method="suffix", options={"max_corpus_tokens": 0}, num_draft_tokens=4)
    for _ in range(2):
        out = _generate(target_no_eos, input_ids, attention_mask, spec)
    lookup = _generate(target_no_eos, input_ids, attention_mask, dict(method="ngram", num_draft_tokens=4))
    assert torch.equal(out.sequences, lookup.sequences)
    assert out.speculative_stats.target_forwards == lookup.speculative_stats.target_forwards
    assert corpus_for(target_no_eos).num_tokens == 0


def test_clear_cache_empties_the_corpus(target_no_eos):
    input_ids, attention_mask = random_batch(7, 1)
    _generate(target_no_eos, input_ids, attention_mask, "suffix", new=4)
    assert corpus_for(target_no_eos).num_tokens > 0
    hf_specdec.clear_cache()
    assert corpus_for(target_no_eos).num_tokens == 0


# ---------------------------------------------------------------------------------------------
# method="auto": the corpus drafts once it beats prompt lookup, and steps aside otherwise
# ---------------------------------------------------------------------------------------------


def test_auto_without_a_draft_model_resolves_to_suffix(target_no_eos):
    assert resolve_method(SpeculativeConfig(), target_no_eos)[0].method == "suffix"


def test_auto_drafts_from_the_corpus_only_once_its_replays_beat_prompt_lookup(target_no_eos):
    auto = SpeculativeConfig(num_draft_tokens=8)

    def drafter() -> SuffixDrafter:
        return SuffixDrafter.from_config(resolve_method(auto, target_no_eos)[0], target_no_eos, None)

    repeated = random_batch(8, 1)
    # An empty corpus: prompt lookup's drafts exactly (output and forwards as method="ngram").
    assert not drafter().drafting
    first = _generate(target_no_eos, *repeated, auto, new=40)
    lookup = _generate(target_no_eos, *repeated, dict(method="ngram", num_draft_tokens=8), new=40)
    assert torch.equal(first.sequences, lookup.sequences)
    assert first.speculative_stats.target_forwards == lookup.speculative_stats.target_forwards
    assert first.speculative_stats.method == "suffix"
    # History, but no replay yet: still prompt lookup.
    assert not drafter().drafting
    # The same request again: its replay shows the corpus would have drafted the whole output.
    _generate(target_no_eos, *repeated, auto, new=40)
    assert corpus_for(target_no_eos).gain() > 2 and drafter().drafting
    again = _generate(target_no_eos, *repeated, auto, new=40)
    assert again.speculative_stats.target_forwards < lookup.speculative_stats.target_forwards / 2


def test_the_corpus_steps_aside_once_its_replays_stop_beating_prompt_lookup():
    rng = np.random.default_rng(0)
    config = SuffixConfig()
    shared = SuffixCorpus(vocab_size=5000)
    repeated = rng.integers(0, 5000, 60).tolist()
    shared.add([repeated], [10], config)
    shared.add([repeated], [10], config)
    assert shared.drafts(config.min_gain)
    # Unrelated outputs: replayed, the corpus would have drafted nothing of them.
    for _ in range(suffix.RECORD_ROWS):
        shared.add([rng.integers(0, 5000, 60).tolist()], [10], config)
        shared._until_replay = 0  # replayed every call here, to fill the record
    assert shared.gain() == pytest.approx(1.0) and not shared.drafts(config.min_gain)
    assert shared.drafts(0.0)  # min_gain=0 drafts from it whenever it has a better draft
    # Once a whole record says the corpus does not pay, replays grow rarer (4 calls apart), every
    # call's output still joining the corpus.
    assert len(shared.record) == suffix.RECORD_ROWS
    replayed = shared.replayed_calls
    for _ in range(20):
        shared.add([rng.integers(0, 5000, 60).tolist()], [10], config)
    assert shared.replayed_calls - replayed == 5 and shared.replay_every == suffix.MAX_REPLAY_EVERY
    assert len(shared.snapshot.starts) == 2 + suffix.RECORD_ROWS + 20
    # Once a replay pays again (the repeated output again), every call is replayed again.
    for _ in range(suffix.MAX_REPLAY_EVERY):
        shared.add([repeated], [10], config)
    assert shared.replay_every == 1 and shared.drafts(config.min_gain)
