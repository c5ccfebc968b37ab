"""EAGLE-2 dynamic trees for the `eagle` head drafter: lossless for greedy and sampling."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.drafters.eagle import EagleDrafter

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.heads import copied_layer_eagle
from ..helpers.sampling import ALPHA, SETTINGS, VOCAB, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, sample_trees, walk_preferring_drafts


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(30, layers=1)


def _spec(head, tree=True, length=6, max_tree_nodes=None, **options):
    return dict(
        method="eagle",
        draft=head,
        num_draft_tokens=length,
        tree=tree,
        max_tree_nodes=max_tree_nodes,
        options=options,
    )


@pytest.mark.parametrize("max_tree_nodes", [None, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_matches_plain_greedy(one_layer, max_tree_nodes, batch):
    head = copied_layer_eagle(one_layer, torch.arange(4, 64))  # drafts never use tokens 0-3
    input_ids, attention_mask = random_batch(seed=batch * 7 + 1, batch=batch)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False)
    plain = one_layer.generate(**kwargs)
    out = one_layer.generate(
        **kwargs, speculative=_spec(head, max_tree_nodes=max_tree_nodes), return_dict_in_generate=True
    )
    assert_greedy_match(one_layer, plain, out.sequences, attention_mask)
    assert 0 < out.speculative_stats.accepted < out.speculative_stats.drafted


@pytest.mark.parametrize("batch", [1, 3])
def test_top_1_tree_drafts_what_the_chain_drafts(one_layer, batch, monkeypatch):
    """A tree of one child per node is a chain: fed level by level under tree masks, each node
    reading its parent's predicted feature at its own position, it drafts the chain's tokens."""
    drafts = {}
    input_ids, attention_mask = random_batch(seed=batch * 7 + 1, batch=batch)
    head = copied_layer_eagle(one_layer)
    for tree in (False, True):
        seen = drafts[tree] = []
        monkeypatch.setattr(
            EagleDrafter, "observe", lambda self, draft, accepted, seen=seen: seen.append(draft)
        )
        top_1 = {"tree_top_k": 1} if tree else {}  # a chain reads no tree_top_k
        one_layer.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=30,
            do_sample=False,
            speculative=_spec(head, tree, length=4, **top_1),
        )
    assert len(drafts[True]) == len(drafts[False]) > 3
    for chain, tree in zip(drafts[False], drafts[True]):
        assert tree.lengths == chain.lengths
        for b, n in enumerate(tree.lengths):
            assert tree.tokens[b, :n].tolist() == chain.tokens[b, :n].tolist()
            torch.testing.assert_close(tree.confidence[b, :n], chain.confidence[b, :n], atol=1e-4, rtol=1e-4)
            assert tree.parents[b, :n].tolist() == list(range(-1, n - 1))


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(31, vocab_size=VOCAB, layers=1, eos_token_id=None)


def unsure_head(target):
    """The copied-layer head with its layer's output damped: the plain copy is so sure of itself
    (0.999) that the most probable nodes form chains; this one branches. Tokens 4 and 7 can only
    come from the target."""
    head = copied_layer_eagle(target, torch.tensor([0, 1, 2, 3, 5, 6]))
    with torch.no_grad():
        head.layer.mlp.down_proj.weight.mul_(0.2)
        head.layer.self_attn.o_proj.weight.mul_(0.2)
    return head


@pytest.mark.parametrize("setting", ["temp", "topk_topp", "rep_penalty"])
def test_tree_samples_follow_target_distribution(sampling_target, setting, monkeypatch):
    head = unsure_head(sampling_target)
    exact = exact_distribution(sampling_target, SETTINGS[setting], BRANCHING_PROMPT)
    spec = _spec(head, length=4, tree_top_k=2)
    samples = sample_trees(sampling_target, SETTINGS[setting], 50, monkeypatch, spec=spec)
    assert chi2_pvalue(samples, exact) > ALPHA


def test_control_walk_that_prefers_the_draft_is_rejected(sampling_target, monkeypatch):
    head = unsure_head(sampling_target)
    exact = exact_distribution(sampling_target, SETTINGS["temp"], BRANCHING_PROMPT)
    spec = _spec(head, length=4, tree_top_k=2)
    samples = sample_trees(sampling_target, SETTINGS["temp"], 51, monkeypatch, walk_preferring_drafts, spec)
    assert chi2_pvalue(samples, exact) < ALPHA
