"""The `suffix` drafter: its corpus under concurrent adds, the draft length and the choice between
prompt lookup and the corpus, what a call adds, and generate with a filled corpus (greedy identity,
trees, auto). The index and the speculation have their own tests (`test_suffix_array.py`,
`test_suffix_speculation.py`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.core.draft import DraftRequest
from hf_specdec.drafters import suffix
from hf_specdec.drafters.suffix import SuffixConfig, SuffixCorpus, SuffixDrafter, corpus_for
from hf_specdec.selection.method import resolve_method

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.suffix import chain, corpus, held


@pytest.fixture(autouse=True)
def _fresh_corpora():
    """Each test starts from empty corpora: they are kept per model, and the session's models are shared."""
    suffix.clear_corpora()
    yield
    suffix.clear_corpora()


# ---------------------------------------------------------------------------------------------
# The corpus: threads
# ---------------------------------------------------------------------------------------------


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
# Drafting from hand-made corpora: how long, and from which source
# ---------------------------------------------------------------------------------------------


def test_a_match_drafts_at_most_factor_times_its_length_plus_the_offset():
    snapshot = corpus(list(range(1, 30)))
    assert chain(snapshot, [1, 2], budget=16, max_spec_factor=1.0, max_spec_offset=0).tokens == [3, 4]
    assert chain(snapshot, [1, 2, 3], budget=16, max_spec_factor=2.0, max_spec_offset=1).tokens == list(
        range(4, 11)
    )
    assert len(chain(snapshot, list(range(1, 17)), budget=5).tokens) == 5  # the step's budget first


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


def test_a_model_whose_vocabulary_was_resized_drafts_from_a_new_corpus():
    """`resize_token_embeddings` past 65533 ids: the corpus keyed tokens in two bytes, and a token
    id that needs three must not reach it (it raised OverflowError); the resized model starts a new
    corpus, and its outputs are plain's."""
    model = tiny_llama(0, vocab_size=65_500, eos_token_id=None)
    spec = SpeculativeConfig(method="suffix", options={"min_gain": 0.0})
    model.generate(torch.tensor([[7, 8, 9, 7, 8]]), max_new_tokens=4, do_sample=False, speculative=spec)
    model.resize_token_embeddings(66_000)
    ids = torch.tensor([[65_900, 65_901, 7, 8, 65_900, 65_901, 7]])
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    for _ in range(2):  # the second call drafts from the first's output
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, speculative=spec), plain)
    assert held(corpus_for(model).snapshot)[0] == plain[0].tolist()


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
    # The drafter reports what its corpus did (`SuffixDrafter.counters`), and the loop timed its add.
    assert first.speculative_stats.drafter_counters == {"corpus_drafting": 0, "corpus_drafts": 0}
    assert first.speculative_stats.finish_seconds > 0
    assert lookup.speculative_stats.drafter_counters == {}  # prompt lookup has no counters of its own
    # History, but no replay yet: still prompt lookup.
    assert not drafter().drafting
    # The same request again: its replay shows the corpus would have drafted the whole output.
    _generate(target_no_eos, *repeated, auto, new=40)
    assert corpus_for(target_no_eos).gain() > 2 and drafter().drafting
    again = _generate(target_no_eos, *repeated, auto, new=40)
    assert again.speculative_stats.target_forwards < lookup.speculative_stats.target_forwards / 2
    counted = again.speculative_stats.drafter_counters
    assert counted["corpus_drafting"] == 1 and 0 < counted["corpus_drafts"] <= again.speculative_stats.steps


def test_a_repeated_request_drafts_from_the_corpus_at_once_whatever_the_replays_say(target_no_eos):
    """A request whose prompt ends with `MAX_MATCH` tokens the corpus holds (here: the same request
    again) drafts from the corpus on its first repeat, though the replays (an unrelated call's: no
    gain) say the corpus does not pay; an unrelated request still drafts as prompt lookup does."""
    auto, ngram = SpeculativeConfig(num_draft_tokens=8), dict(method="ngram", num_draft_tokens=8)
    request, other = random_batch(8, 1, min_len=20, max_len=24), random_batch(9, 1, min_len=20, max_len=24)
    lookup = _generate(target_no_eos, *request, ngram, new=40)
    _generate(target_no_eos, *request, auto, new=40)
    unrelated = _generate(target_no_eos, *other, auto, new=40)
    assert unrelated.speculative_stats.drafter_counters["corpus_drafting"] == 0
    assert torch.equal(unrelated.sequences, _generate(target_no_eos, *other, ngram, new=40).sequences)
    assert not corpus_for(target_no_eos).drafts(SuffixConfig().min_gain)  # the replays say no
    again = _generate(target_no_eos, *request, auto, new=40)
    assert again.speculative_stats.drafter_counters["corpus_drafting"] == 1
    assert torch.equal(again.sequences, lookup.sequences)
    assert again.speculative_stats.target_forwards < lookup.speculative_stats.target_forwards / 2


def test_a_request_that_only_ends_as_an_earlier_one_is_no_repeat(target_no_eos):
    """Prompts sharing their last 20 tokens (a trailing instruction) and their answer's first token,
    but not their beginning: the context's last 16 tokens are in the corpus, yet the corpus stays
    held back by the replays (before, such a match at the end was taken for a repeat)."""
    shared = torch.arange(6, 26)[None]  # 20 tokens every prompt ends with

    def prompt(seed: int, length: int) -> torch.Tensor:
        return torch.cat([random_batch(seed, 1, min_len=length, max_len=length)[0], shared], dim=1)

    def first_token(ids: torch.Tensor) -> int:
        return int(target_no_eos.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])

    first = prompt(10, 5)
    second = next(p for seed in range(11, 400) if first_token(p := prompt(seed, 9)) == first_token(first))
    auto = SpeculativeConfig(num_draft_tokens=8)
    _generate(target_no_eos, first, torch.ones_like(first), auto, new=40)
    out = _generate(target_no_eos, second, torch.ones_like(second), auto, new=40)
    assert out.speculative_stats.drafter_counters["corpus_drafting"] == 0


def test_a_wide_call_replays_only_the_rows_its_record_keeps(monkeypatch):
    """A row's replay costs up to REPLAY_TOKENS look-ups in the corpus: of a 40-row call only the last
    RECORD_ROWS rows with an output are replayed (the record keeps no other), and every row is added."""
    rng = np.random.default_rng(0)
    config = SuffixConfig()
    shared = SuffixCorpus(vocab_size=5000)
    shared.add([rng.integers(0, 5000, 60).tolist()], [10], config)
    replayed: list[list[int]] = []
    replay = SuffixCorpus._replay
    monkeypatch.setattr(
        SuffixCorpus,
        "_replay",
        lambda self, snap, seq, *rest: replayed.append(seq) or replay(self, snap, seq, *rest),
    )
    rows = [rng.integers(0, 5000, 60).tolist() for _ in range(40)]
    prompt_lengths = [10] * 39 + [60]  # the last row has no output: nothing to replay
    shared.add(rows, prompt_lengths, config)
    assert replayed == rows[-1 - suffix.RECORD_ROWS : -1]
    assert len(shared.record) == suffix.RECORD_ROWS and shared.replayed_calls == 1
    assert held(shared.snapshot)[1:] == rows


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
