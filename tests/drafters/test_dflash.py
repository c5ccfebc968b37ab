"""Drafting with block drafts (`method="dflash"` / `"dspark"`): greedy output equals plain decoding for
every published layout, at batch 1 and in left-padded batches whose rows accept different numbers of
drafts, as chains and as trees; a MuseGlimmer assistant proposes exactly what transformers' own
DFlash generator proposes, step by step; DSpark's confidence head sizes the drafts."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.core.draft import DraftCost
from hf_specdec.drafters import DRAFTERS
from hf_specdec.drafters.dflash import DFlashDrafter

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.block_drafts import random_block_draft, write_dspark, write_muse_glimmer, write_zlab
from ..helpers.sampling import ALPHA, SETTINGS, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, sample_trees

LAYOUTS = {
    "zlab": lambda folder, target: write_zlab(folder, target),
    "zlab-sliding": lambda folder, target: write_zlab(
        folder, target, layer_types=["sliding_attention"] * 2, sliding_window=4
    ),
    "dspark": lambda folder, target: write_dspark(folder, target),
    "dspark-gated": lambda folder, target: write_dspark(folder, target, markov="gated", confidence=False),
    "deepspec-dflash": lambda folder, target: write_dspark(folder, target, markov=None, confidence=False),
    "muse_glimmer": lambda folder, target: write_muse_glimmer(folder, target, window=3) and folder,
}


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, eos_token_id=None)


@pytest.fixture(scope="module")
def small_vocab():
    """A vocabulary of 8: a random draft agrees with the target often enough for rows of a batch to
    accept different numbers of drafts."""
    return tiny_llama(5, vocab_size=8, eos_token_id=None)


def _generate(target, input_ids, attention_mask, speculative=None, **kwargs):
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "max_new_tokens": 16,
        "do_sample": False,
        **kwargs,
    }
    if speculative is None:
        return target.generate(**kwargs)
    return target.generate(**kwargs, speculative=speculative, return_dict_in_generate=True)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_plain_for_every_layout(tmp_path, target, layout, batch, tree):
    folder = LAYOUTS[layout](tmp_path / layout, target)
    input_ids, attention_mask = random_batch(seed=7, batch=batch, min_len=4, max_len=11)
    plain = _generate(target, input_ids, attention_mask)
    method = "dspark" if layout.startswith("dspark") else "dflash"
    spec = _generate(
        target,
        input_ids,
        attention_mask,
        dict(method=method, draft=str(folder), num_draft_tokens=3, tree=tree),
    )
    assert_greedy_match(target, plain, spec.sequences, attention_mask)
    stats = spec.speculative_stats
    assert stats.drafted > 0 and stats.method == method


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_rows_of_a_batch_accept_different_numbers_of_drafts(small_vocab, tree):
    head = random_block_draft(small_vocab, block_size=6)
    input_ids, attention_mask = random_batch(seed=8, batch=4, vocab=8, min_len=3, max_len=9)
    input_ids = torch.where(attention_mask.bool(), input_ids % 6 + 2, 0)
    plain = _generate(small_vocab, input_ids, attention_mask, max_new_tokens=24)
    spec = _generate(
        small_vocab,
        input_ids,
        attention_mask,
        dict(method="dflash", draft=head, num_draft_tokens=5, tree=tree),
        max_new_tokens=24,
    )
    assert_greedy_match(small_vocab, plain, spec.sequences, attention_mask)
    stats = spec.speculative_stats
    assert 0 < stats.accepted < stats.drafted
    if not tree:  # a chain drafts at most the block's 5 positions
        assert 0 < len(stats.position_drafted) <= 5


def test_a_block_is_drafted_in_one_forward_and_never_past_its_positions(target, monkeypatch):
    head = random_block_draft(target, (0, 1), block_size=4)
    forwards = []
    real = type(head).run_block

    def counted(self, *args, **kwargs):
        forwards.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(head), "run_block", counted)
    input_ids, attention_mask = random_batch(seed=9, batch=2, min_len=4, max_len=8)
    spec = _generate(target, input_ids, attention_mask, dict(method="dflash", draft=head, num_draft_tokens=8))
    stats = spec.speculative_stats
    # One draft forward per verify forward (the first target forward is the prompt's), whatever the
    # draft's length; a block of 4 drafts at most 3 tokens a row.
    assert len(forwards) == stats.target_forwards - 1
    assert stats.drafted <= 3 * stats.speculative_steps and len(stats.position_drafted) == 3
    assert DRAFTERS["dflash"].draft_cost is DraftCost.PER_BLOCK


def test_muse_glimmer_drafts_what_transformers_drafts(tmp_path, target, monkeypatch):
    """transformers' DFlashTokenCandidateGenerator and ours, on the same assistant and target (batch 1,
    greedy): the same block of candidates at every step, and the same output."""
    from transformers.generation import candidate_generator

    assistant = write_muse_glimmer(tmp_path / "mg", target, window=3)
    theirs, ours = [], []
    real_candidates = candidate_generator.DFlashTokenCandidateGenerator.get_candidates
    real_propose = DFlashDrafter.propose

    def their_spy(self, input_ids, *args, **kwargs):
        ids, logits = real_candidates(self, input_ids, *args, **kwargs)
        if logits is not None:
            theirs.append(ids[0, input_ids.shape[1] :].tolist())
        return ids, logits

    def our_spy(self, request):
        draft = real_propose(self, request)
        ours.append(draft.tokens[0, : draft.lengths[0]].tolist())
        return draft

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", their_spy)
    monkeypatch.setattr(DFlashDrafter, "propose", our_spy)
    input_ids = torch.tensor([[1, 17, 42, 9, 33, 17, 42]])
    kwargs = dict(input_ids=input_ids, do_sample=False, max_new_tokens=20)
    reference = target.generate(**kwargs, assistant_model=assistant, speculation_type="dflash")
    spec = target.generate(
        **kwargs, speculative=dict(method="dflash", draft=str(tmp_path / "mg"), num_draft_tokens=3)
    )
    assert torch.equal(spec, reference) and torch.equal(spec, target.generate(**kwargs))
    assert len(theirs) >= 5 and len({tuple(t) for t in theirs}) > 1  # the drafts depend on the context
    # Near the end a draft is cut to the tokens left to generate (transformers drafts the whole block,
    # and none at all for the last token, where we still draft the one).
    assert len(ours) - len(theirs) in (0, 1) and all(o == t[: len(o)] and o for o, t in zip(ours, theirs))


@pytest.mark.parametrize("method", ["dflash", "auto"])
def test_a_loaded_muse_glimmer_assistant_drafts_as_its_folder_does(tmp_path, small_vocab, method):
    """The MuseGlimmerAssistantModel a transformers user loads for `assistant_model=` drafts given as
    draft= (by `dflash` or `auto`) as its folder does, and is left as it is; `draft_model` names it."""
    target = small_vocab
    assistant = write_muse_glimmer(tmp_path / "mg", target, window=3)
    before = {k: v.clone() for k, v in assistant.state_dict().items()}
    input_ids, attention_mask = random_batch(seed=7, batch=2, vocab=8, min_len=4, max_len=11)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    folder = _generate(
        target,
        input_ids,
        attention_mask,
        dict(method="dflash", draft=str(tmp_path / "mg"), num_draft_tokens=3),
    )
    loaded = _generate(
        target, input_ids, attention_mask, dict(method=method, draft=assistant, num_draft_tokens=3)
    )
    assert torch.equal(loaded.sequences, target.generate(**kwargs))
    assert loaded.speculative_stats.method == "dflash"
    assert (loaded.speculative_stats.drafted, loaded.speculative_stats.accepted) == (
        folder.speculative_stats.drafted,
        folder.speculative_stats.accepted,
    )
    assert all(torch.equal(v, before[k]) for k, v in assistant.state_dict().items())
    with pytest.raises(ValueError, match="not a draft model but a dflash draft"):
        target.generate(**kwargs, speculative=dict(method="draft_model", draft=assistant))


@pytest.mark.filterwarnings("error:speculative= settings")  # chains read the threshold
def test_dspark_confidence_estimates_are_the_drafts_and_cut_them(tmp_path, target, monkeypatch):
    folder = write_dspark(tmp_path / "dspark", target)
    seen = []
    real = DFlashDrafter.propose

    def spy(self, request):
        draft = real(self, request)
        seen.append(draft)
        return draft

    monkeypatch.setattr(DFlashDrafter, "propose", spy)
    input_ids, attention_mask = random_batch(seed=10, batch=2, min_len=5, max_len=9)
    plain = _generate(target, input_ids, attention_mask)
    whole = _generate(
        target, input_ids, attention_mask, dict(method="dspark", draft=str(folder), num_draft_tokens=4)
    )
    assert all(d.confidence is not None for d in seen)
    estimates = torch.cat([d.confidence[b, : d.lengths[b]] for d in seen for b in range(len(d.lengths))])
    assert 0 < float(estimates.min()) < float(estimates.max()) < 1  # the head's, not the tokens' odds
    threshold = float(estimates.median())
    seen.clear()
    options = {"confidence_threshold": threshold}
    cut = _generate(
        target,
        input_ids,
        attention_mask,
        dict(method="dspark", draft=str(folder), num_draft_tokens=4, options=options),
    )
    for draft in seen:  # every kept token's estimate is above the threshold, and so are those before it
        for b, n in enumerate(draft.lengths):
            assert bool((draft.confidence[b, :n] >= threshold).all())
    assert cut.speculative_stats.drafted < whole.speculative_stats.drafted
    assert_greedy_match(target, plain, cut.sequences, attention_mask)


def test_dspark_needs_dspark_heads(tmp_path, target):
    folder = write_zlab(tmp_path / "zlab", target)
    with pytest.raises(ValueError, match=r"without DSpark's Markov and confidence heads.*method='dflash'"):
        target.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2, speculative=dict(method="dspark", draft=str(folder))
        )


def test_a_confidence_threshold_for_a_draft_without_a_confidence_head_is_refused(target):
    """The threshold cuts chains by DSpark's confidence head: a draft without one would silently
    draft as if it were not set."""
    head = random_block_draft(target, (0, 1), block_size=4, confidence_head=False)
    spec = dict(method="dflash", draft=head, options={"confidence_threshold": 0.5})
    with pytest.raises(ValueError, match="confidence_threshold=0.5.*has no confidence head"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, speculative=spec)


@pytest.mark.parametrize("tree", [True, "auto"])
def test_a_confidence_threshold_beside_trees_is_named_as_unread(target, tree):
    """Trees do not read the threshold: the call drafts as without it, and a warning says so (the
    chain that reads it draws none: `test_dspark_confidence_estimates_are_the_drafts_and_cut_them`)."""
    head = random_block_draft(target, (0, 1), block_size=4, confidence_head=True)
    spec = dict(method="dflash", draft=head, tree=tree, options={"confidence_threshold": 0.5})
    with pytest.warns(
        UserWarning,
        match=r"- options confidence_threshold=0.5 cuts chain drafts, and this call "
        r"drafts trees: drop tree= or the option",
    ):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, speculative=spec)


def test_dflash_without_a_draft_says_where_to_get_one(target):
    with pytest.raises(
        ValueError, match=r"needs a block draft.*train-draft --target <model> --method dflash"
    ):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, speculative=dict(method="dflash"))


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(20, vocab_size=8, eos_token_id=None)


def test_tree_samples_follow_target_distribution(sampling_target, monkeypatch):
    """Trees of a DSpark draft (each node's children from its own token's Markov term) sampled through
    the target's tree walk: exact (the same test rejects a walk that favours drafted tokens:
    tests/properties/test_trees.py and the other tree drafters' tests)."""
    head = random_block_draft(sampling_target, (0, 1), block_size=4, markov_rank=4, drafts_from_anchor=True)
    spec = dict(method="dspark", draft=head, num_draft_tokens=4, tree=True, options={"tree_top_k": 2})
    exact = exact_distribution(sampling_target, SETTINGS["topk_topp"], BRANCHING_PROMPT)
    samples = sample_trees(sampling_target, SETTINGS["topk_topp"], 70, monkeypatch, spec=spec)
    assert chi2_pvalue(samples, exact) > ALPHA
