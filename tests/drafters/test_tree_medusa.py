"""Medusa trees: the cartesian product of each head's top-k, pruned by probability; lossless for
greedy and sampling."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.drafters.medusa import MedusaDrafter, cartesian_tree

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.heads import identity_medusa
from ..helpers.sampling import ALPHA, SETTINGS, VOCAB, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, sample_trees, walk_preferring_drafts


def _probs(*heads: dict[int, float], vocab: int = 6) -> torch.Tensor:
    """[1, len(heads), vocab] from each head's {token: probability}."""
    probs = torch.zeros(1, len(heads), vocab)
    for d, head in enumerate(heads):
        for token, p in head.items():
            probs[0, d, token] = p
    return probs


HEADS = _probs({1: 0.6, 2: 0.3, 3: 0.1}, {4: 0.5, 5: 0.4, 1: 0.1}, {2: 0.9, 3: 0.1})


def test_cartesian_tree_keeps_the_most_probable_nodes_parents_first():
    draft = cartesian_tree(HEADS, [5], top_k=2)
    # Scores: 1 .6; 2 .3; 1-4 .3; 1-5 .24; 1-4-2 .27; 2-4 .15; ...: ties go to the node offered first.
    assert draft.lengths == [5]
    assert draft.tokens[0].tolist() == [1, 2, 4, 2, 5]
    assert draft.parents[0].tolist() == [-1, -1, 0, 2, 0]  # 1 | 2 | 1-4 | 1-4-2 | 1-5
    torch.testing.assert_close(draft.confidence[0], torch.tensor([0.6, 0.3, 0.5, 0.9, 0.4]))
    assert draft.probs is None  # chosen without draws: the target's walk keeps sampling exact
    assert draft.depths() == [3]
    # Any prefix is the best tree of its size: what the policy's cut keeps.
    for n in range(1, 5):
        smaller = cartesian_tree(HEADS, [n], top_k=2)
        assert smaller.tokens[0].tolist() == draft.tokens[0, :n].tolist()
        assert smaller.parents[0].tolist() == draft.parents[0, :n].tolist()


def test_cartesian_tree_budgets_confidence_and_rows_with_nothing_allowed():
    nothing = torch.full((1, 3, 6), float("nan"))  # processors allowed no draftable token
    draft = cartesian_tree(torch.cat([HEADS, nothing, HEADS]), [4, 4, 0], top_k=3)
    assert draft.lengths == [4, 0, 0]
    # top_k=1 is the chain of each head's best guess.
    chain = cartesian_tree(HEADS, [5], top_k=1)
    assert chain.tokens[0].tolist() == [1, 4, 2] and chain.parents[0].tolist() == [-1, 0, 1]
    # Nodes whose path is less probable than min_confidence are not proposed.
    sure = cartesian_tree(HEADS, [8], top_k=2, min_confidence=0.29)
    assert sure.tokens[0].tolist() == [1, 2, 4]


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(30, layers=1)


def _spec(head, tree=True, length=6, max_tree_nodes=None, **options):
    return dict(
        method="medusa",
        draft=head,
        num_draft_tokens=length,
        tree=tree,
        max_tree_nodes=max_tree_nodes,
        options=options,
    )


def _generate(model, batch, spec, **kwargs):
    input_ids, attention_mask = random_batch(seed=batch * 7 + 1, batch=batch)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, **kwargs)
    plain = model.generate(**kwargs, do_sample=False)
    out = model.generate(**kwargs, do_sample=False, speculative=spec, return_dict_in_generate=True)
    return plain, out, attention_mask


@pytest.mark.parametrize("max_tree_nodes", [None, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tree_matches_plain_greedy(one_layer, max_tree_nodes, batch):
    head = identity_medusa(one_layer, torch.arange(4, 64))  # drafts never use tokens 0-3
    plain, out, attention_mask = _generate(one_layer, batch, _spec(head, max_tree_nodes=max_tree_nodes))
    assert_greedy_match(one_layer, plain, out.sequences, attention_mask)
    stats = out.speculative_stats
    assert stats.tree_steps > 0 and 0 < stats.accepted < stats.drafted
    assert stats.mean_nodes_verified > stats.mean_tree_depth  # the trees branched
    assert stats.mean_tree_depth <= head.config.num_heads


def test_greedy_tree_sized_by_the_adaptive_policy_matches_plain_greedy(one_layer):
    head = identity_medusa(one_layer, torch.arange(4, 64))
    plain, out, attention_mask = _generate(one_layer, 3, _spec(head, length="auto"))
    assert_greedy_match(one_layer, plain, out.sequences, attention_mask)
    assert out.speculative_stats.tree_steps > 0  # it explored trees at least once


def test_control_greedy_walk_that_prefers_the_draft_is_caught(one_layer, monkeypatch):
    """The same check fails when the walk accepts the first root child where the target disagrees."""
    import hf_specdec.core.verify

    monkeypatch.setattr(hf_specdec.core.verify, "tree_verify", walk_preferring_drafts)
    torch.manual_seed(0)
    plain, out, attention_mask = _generate(one_layer, 3, _spec(identity_medusa(one_layer)))
    with pytest.raises(AssertionError):
        assert_greedy_match(one_layer, plain, out.sequences, attention_mask)


@pytest.mark.parametrize("batch", [1, 3])
def test_top_1_tree_drafts_what_the_chain_drafts(one_layer, batch, monkeypatch):
    """One guess per head makes the tree a chain: the chain's tokens, one level per head."""
    drafts = {}
    head = identity_medusa(one_layer)
    for tree in (False, True):
        seen = drafts[tree] = []
        monkeypatch.setattr(
            MedusaDrafter, "observe", lambda self, draft, accepted, seen=seen: seen.append(draft)
        )
        top_1 = {"tree_top_k": 1} if tree else {}  # a chain reads no tree_top_k
        _generate(one_layer, batch, _spec(head, tree, length=3, **top_1))
    assert len(drafts[True]) == len(drafts[False]) > 3
    for chain, tree in zip(drafts[False], drafts[True]):
        assert tree.lengths == chain.lengths
        for b, n in enumerate(tree.lengths):
            if n == 0:  # nothing drafted (no feature yet, or no room): an empty draft, no tree
                continue
            assert tree.tokens[b, :n].tolist() == chain.tokens[b, :n].tolist()
            assert tree.parents[b, :n].tolist() == list(range(-1, n - 1))


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(31, vocab_size=VOCAB, layers=1, eos_token_id=None)


def _sampling_spec(target):
    head = identity_medusa(target, torch.tensor([0, 1, 2, 3, 5, 6]))  # 4 and 7 only from the target
    return _spec(head, length=4, tree_top_k=2)


@pytest.mark.parametrize("setting", ["temp", "topk_topp", "rep_penalty"])
def test_tree_samples_follow_target_distribution(sampling_target, setting, monkeypatch):
    exact = exact_distribution(sampling_target, SETTINGS[setting], BRANCHING_PROMPT)
    spec = _sampling_spec(sampling_target)
    samples = sample_trees(sampling_target, SETTINGS[setting], 60, monkeypatch, spec=spec)
    assert chi2_pvalue(samples, exact) > ALPHA


def test_control_sampling_walk_that_prefers_the_draft_is_rejected(sampling_target, monkeypatch):
    exact = exact_distribution(sampling_target, SETTINGS["temp"], BRANCHING_PROMPT)
    spec = _sampling_spec(sampling_target)
    samples = sample_trees(sampling_target, SETTINGS["temp"], 61, monkeypatch, walk_preferring_drafts, spec)
    assert chi2_pvalue(samples, exact) < ALPHA
