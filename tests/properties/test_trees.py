"""Tree drafts: an n-gram trie verified in one forward, lossless for greedy and sampling."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.core.verify import tree_verify
from hf_specdec.drafters.ngram import _trie

from ..conftest import assert_greedy_match, tiny_llama
from ..helpers.sampling import ALPHA, ROWS, SETTINGS, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, repetitive_batch, sample_trees, walk_preferring_drafts


def test_trie_keeps_its_likeliest_nodes_first():
    continuations = [[7, 8, 9, 10], [7, 8, 5], [4, 4]]
    # Best continuations mostly right (α 0.6, γ 0.2): its four tokens, then where [4, 4] leaves.
    tokens, parents, odds = _trie(continuations, budget=5)
    assert tokens == [7, 8, 9, 10, 4]
    assert parents == [-1, 0, 1, 2, -1]
    assert odds == pytest.approx([0.6, 0.6, 0.6, 0.6, 0.4 * 0.2])
    # Often wrong at once, while other matches often have the token (α 0.3, γ 0.5): the other
    # match's first token (0.7 * 0.5) ranks before the best's (0.3); parents still come first.
    tokens, parents, odds = _trie(continuations, budget=5, alpha=0.3, gamma=0.5)
    assert tokens == [4, 7, 4, 8, 5]
    assert parents == [-1, -1, 0, 1, 3]
    assert odds == pytest.approx([0.35, 0.3, 0.3, 0.3, 0.35])
    assert _trie([[7, 8, 9, 10]], 3)[0] == [7, 8, 9]
    assert _trie([[7, 8, 9, 10], [7, 8, 9, 10]], 4)[0] == [7, 8, 9, 10]


def test_trie_judges_the_best_continuation_by_its_own_odds():
    # Its third token doubtful (0.2): the other match's token after [7, 8] (0.8 * 0.5 given [7, 8])
    # ranks before it, and each node's odds are given its parent held.
    tokens, parents, odds = _trie([[7, 8, 9, 10], [7, 8, 5], [4, 4]], 4, 0.6, 0.5, [0.9, 0.9, 0.2, 0.2])
    assert tokens == [7, 8, 5, 9]
    assert parents == [-1, 0, 1, 1]
    assert odds == pytest.approx([0.9, 0.9, 0.4, 0.2])


def test_trie_odds_learn_from_what_followed():
    from hf_specdec.drafters.ngram import _TrieOdds

    odds = _TrieOdds()
    tokens, parents = [7, 8, 9, 10, 4], [-1, 0, 1, 2, -1]
    odds.observe(tokens, parents, [7, 8, 3])  # the best continuation right twice, then wrong
    odds.observe(tokens, parents, [4, 4])  # wrong at once; the other match had the token
    assert (odds.best_hits, odds.best_trials, odds.other_hits, odds.other_trials) == (2, 4, 1, 1)
    assert odds.alpha == pytest.approx((2 + 1.2) / 6) and odds.gamma == pytest.approx((1 + 0.4) / 3)


def test_tree_verify_follows_the_picks_down_the_tree():
    vocab = 10
    draft = torch.tensor([[3, 4, 5, 6]])
    parents = torch.tensor([[-1, -1, 1, 2]])  # 3 | 4 - 5 - 6
    scores = torch.full((1, 5, vocab), -1.0)
    for column, best in enumerate([4, 0, 5, 9, 0]):  # after last: 4; after node 1 (4): 5; after 5: 9
        scores[0, column, best] = 1.0
    paths, tokens = tree_verify(draft, [4], parents, scores.argmax(dim=-1))
    assert paths == [[1, 2]]  # 4 then 5 accepted, 6 rejected
    assert tokens[0, :3].tolist() == [4, 5, 9]


@pytest.mark.parametrize("tree,max_tree_nodes", [(True, None), (True, 3), ("auto", None)])
@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1), (3, 2)])
def test_tree_greedy_identity(target, tree, max_tree_nodes, batch, seed):
    input_ids, attention_mask = repetitive_batch(seed, batch)
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    config = hf_specdec.SpeculativeConfig(
        method="ngram", tree=tree, max_tree_nodes=max_tree_nodes, num_draft_tokens=6, options={"min_ngram": 1}
    )
    out = target.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        speculative=config,
        return_dict_in_generate=True,
    )
    assert_greedy_match(target, plain, out.sequences, attention_mask)
    assert out.speculative_stats.drafted > 0
    assert out.speculative_stats.tree_steps > 0  # "auto" grows trees where the drafter can


@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1)])
def test_adaptive_policy_learns_from_tree_paths(target, batch, seed, monkeypatch):
    """With `num_draft_tokens="auto"` the policy sizes trees from the accepted paths it is given
    (`TreeAcceptance`); output stays plain greedy's."""
    from hf_specdec.core.policy import AdaptiveDraftLength

    seen = []
    update = AdaptiveDraftLength.update

    def spy(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None):
        seen.append((draft.parents is not None, paths and len(paths) == len(draft.lengths)))
        return update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths)

    monkeypatch.setattr(AdaptiveDraftLength, "update", spy)
    input_ids, attention_mask = repetitive_batch(seed, batch)
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=32, do_sample=False)
    config = hf_specdec.SpeculativeConfig(method="ngram", tree=True, options={"min_ngram": 1})
    out = target.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=32,
        do_sample=False,
        speculative=config,
        return_dict_in_generate=True,
    )
    assert_greedy_match(target, plain, out.sequences, attention_mask)
    trees = [one_per_row for is_tree, one_per_row in seen if is_tree]
    assert trees and all(trees)  # each tree step passed a path for each of its rows
    assert all(paths is None for is_tree, paths in seen if not is_tree)  # plain steps: no paths
    assert out.speculative_stats.tree_steps > 0


def test_tree_greedy_with_repetition_penalty_and_scores(target):
    """Context-dependent processors see each node's own path; output_scores follow the path."""
    input_ids, attention_mask = repetitive_batch(3, 1)
    kwargs = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.2)
    plain = target.generate(
        input_ids, attention_mask=attention_mask, **kwargs, output_scores=True, return_dict_in_generate=True
    )
    config = hf_specdec.SpeculativeConfig(
        method="ngram", tree=True, num_draft_tokens=6, options={"min_ngram": 1}
    )
    out = target.generate(
        input_ids,
        attention_mask=attention_mask,
        **kwargs,
        speculative=config,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain.sequences)
    for ours, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_tree_sliding_window_model_matches_plain():
    from ..helpers.architectures import tiny

    model = tiny("gemma2", 0)
    prompt = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([prompt, prompt[:, -8:], prompt[:, -8:]], dim=1)
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    config = hf_specdec.SpeculativeConfig(method="ngram", tree=True, options={"min_ngram": 1})
    spec = model.generate(prompt, max_new_tokens=24, do_sample=False, speculative=config)
    assert_greedy_match(model, plain, spec)


def test_tree_refused_for_chain_drafters(target, good_draft, monkeypatch):
    from hf_specdec.drafters.draft_model import DraftModelDrafter

    monkeypatch.setattr(DraftModelDrafter, "supports_tree", False)
    config = hf_specdec.SpeculativeConfig(method="draft_model", draft=good_draft, tree=True)
    with pytest.raises(ValueError, match="drafts chains only"):
        target.generate(torch.tensor([[6, 7, 8]]), max_new_tokens=4, do_sample=False, speculative=config)


def test_tree_auto_drafts_chains_with_a_chain_drafter(target, good_draft, monkeypatch):
    from hf_specdec.drafters.draft_model import DraftModelDrafter

    monkeypatch.setattr(DraftModelDrafter, "supports_tree", False)
    config = hf_specdec.SpeculativeConfig(
        method="draft_model", draft=good_draft, tree="auto", num_draft_tokens=3
    )
    prompt = torch.tensor([[6, 7, 8, 9]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(
        prompt, max_new_tokens=12, do_sample=False, speculative=config, return_dict_in_generate=True
    )
    assert_greedy_match(target, plain, out.sequences)
    assert out.speculative_stats.drafted > 0 and out.speculative_stats.tree_steps == 0


@pytest.mark.parametrize("value", [0, -2, "big", 1.5])
def test_tree_setting_is_validated(value):
    with pytest.raises(ValueError, match="`tree` must be"):
        hf_specdec.SpeculativeConfig(method="ngram", tree=value)


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(20, vocab_size=8, eos_token_id=None)


@pytest.mark.parametrize("setting", ["temp", "topk_topp", "rep_penalty"])
def test_tree_samples_follow_target_distribution(sampling_target, setting, monkeypatch):
    exact = exact_distribution(sampling_target, SETTINGS[setting], BRANCHING_PROMPT)
    samples = sample_trees(sampling_target, SETTINGS[setting], 30, monkeypatch)
    assert chi2_pvalue(samples, exact) > ALPHA


def test_control_tree_walk_that_prefers_drafts_is_rejected(sampling_target, monkeypatch):
    """A verifier that, half of the times the target's pick is no root child, accepts the first
    root child anyway (favouring drafted tokens) must fail the same test."""
    exact = exact_distribution(sampling_target, SETTINGS["temp"], BRANCHING_PROMPT)
    samples = sample_trees(
        sampling_target, SETTINGS["temp"], 31, monkeypatch, verifier=walk_preferring_drafts
    )
    assert chi2_pvalue(samples, exact) < ALPHA


def test_suffix_tree_samples_follow_target_distribution(sampling_target, monkeypatch):
    """Prompt lookup's trie merged with a tree grown over a corpus that earlier sampled calls filled."""
    from hf_specdec.drafters import suffix

    settings = SETTINGS["temp"]
    suffix.clear_corpora()
    prompt = torch.tensor([BRANCHING_PROMPT]).repeat(16, 1)
    torch.manual_seed(32)
    for _ in range(2):
        sampling_target.generate(
            input_ids=prompt, max_new_tokens=6, do_sample=True, speculative="suffix", **settings
        )
    spec = dict(method="suffix", num_draft_tokens=4, tree=True, options={"min_gain": 0.0})
    # The corpus drafted, adding nodes to every row's first tree at least.
    drafted = {"corpus_drafting": 1, "corpus_drafts": ROWS}
    samples = sample_trees(sampling_target, settings, 33, monkeypatch, spec=spec, least_counters=drafted)
    suffix.clear_corpora()
    exact = exact_distribution(sampling_target, settings, BRANCHING_PROMPT)
    assert chi2_pvalue(samples, exact) > ALPHA
