"""Draft-model trees: top-k branching by cumulative draft probability (`drafters/tree.py`),
lossless for greedy (identical to plain greedy) and sampling (exact enumeration)."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from hf_specdec.core.draft import DraftRequest
from hf_specdec.core.processing import ScoreProcessor
from hf_specdec.drafters.draft_model import DraftModelDrafter
from hf_specdec.drafters.tree import grow_tree

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.sampling import ALPHA, SETTINGS, chi2_pvalue, exact_distribution
from ..helpers.trees import BRANCHING_PROMPT, sample_trees, walk_preferring_drafts


def _spec(draft, tree=True, length=6, max_tree_nodes=None, **options):
    return hf_specdec.SpeculativeConfig(
        method="draft_model",
        draft=draft,
        tree=tree,
        num_draft_tokens=length,
        max_tree_nodes=max_tree_nodes,
        options=options,
    )


def _generate(model, input_ids, attention_mask, spec, **kwargs):
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        speculative=spec,
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.mark.parametrize("max_tree_nodes", [None, 5])
@pytest.mark.parametrize("which", ["good", "weak", "itself"])
@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1)])
def test_greedy_tree_matches_plain_greedy(target, good_draft, weak_draft, which, max_tree_nodes, batch, seed):
    draft = {"good": good_draft, "weak": weak_draft, "itself": target}[which]
    input_ids, attention_mask = random_batch(seed, batch)  # left-padded when batch > 1
    plain = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    out = _generate(target, input_ids, attention_mask, _spec(draft, max_tree_nodes=max_tree_nodes))
    assert_greedy_match(target, plain, out.sequences, attention_mask)
    assert out.speculative_stats.drafted > 0


@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1)])
def test_own_draft_is_accepted_down_its_most_probable_path(target, batch, seed, monkeypatch):
    """With the target as its own draft, each step accepts exactly the tree's path of most probable
    children: the draft cache fed level by level under tree masks computes what the target does."""
    steps = []
    observe = DraftModelDrafter.observe

    def spy(self, draft, accepted):
        steps.append((draft, accepted))
        observe(self, draft, accepted)

    monkeypatch.setattr(DraftModelDrafter, "observe", spy)
    input_ids, attention_mask = random_batch(seed, batch)
    out = _generate(target, input_ids, attention_mask, _spec(target))
    assert out.speculative_stats.accepted > 0
    assert_accepted_down_most_probable_paths(steps)


def assert_accepted_down_most_probable_paths(steps: list[tuple]) -> None:
    """Each (draft, accepted) step accepted exactly the path that follows, from the root, the child
    the drafter found most probable (what a drafter that computes what the target does gets
    accepted), and some trees branched."""
    branched = False
    for draft, accepted in steps:
        for b, n in enumerate(draft.lengths):
            parents, confidence = draft.parents[b, :n].tolist(), draft.confidence[b, :n].tolist()
            branched |= parents.count(-1) > 1
            path, node = 0, -1
            while children := [i for i in range(n) if parents[i] == node]:
                node = max(children, key=lambda i: confidence[i])
                path += 1
            assert accepted[b] == path
    assert branched


def test_top_1_trees_are_chains(target, good_draft, monkeypatch):
    parents_seen = []
    observe = DraftModelDrafter.observe
    monkeypatch.setattr(
        DraftModelDrafter, "observe", lambda self, d, a: (parents_seen.append(d.parents), observe(self, d, a))
    )
    input_ids, attention_mask = random_batch(0, 1)
    _generate(target, input_ids, attention_mask, _spec(good_draft, tree_top_k=1))
    for parents in parents_seen:
        assert parents[0].tolist() == list(range(-1, parents.shape[1] - 1))


def _request(budget: list[int], vocab: int = 8) -> DraftRequest:
    batch = len(budget)
    return DraftRequest(
        tokens=torch.ones(batch, 3, dtype=torch.long),
        attention_mask=torch.ones(batch, 3, dtype=torch.long),
        lengths=[3] * batch,
        max_tokens=budget,
        do_sample=False,
        processor=ScoreProcessor(None, vocab, batch),
        row_ids=list(range(batch)),
        tree=True,
    )


def test_grow_tree_keeps_the_most_probable_nodes_parents_first():
    """A fixed draft: after token t, t + 1 has probability 0.6, t + 2 0.2, the others share 0.2."""

    def logits_after(tokens: torch.Tensor) -> torch.Tensor:
        probs = torch.full((*tokens.shape, 8), 0.2 / 6)
        probs.scatter_(-1, ((tokens + 1) % 8)[..., None], 0.6)
        probs.scatter_(-1, ((tokens + 2) % 8)[..., None], 0.2)
        return probs.log()

    levels = []

    def feed(level):
        levels.append(level)
        return logits_after(level.tokens)

    draft = grow_tree(_request([4, 0]), [4, 0], 2, 0.0, logits_after(torch.tensor([1, 1])), feed)
    assert draft.lengths == [4, 0]
    # cumulative: 2 .6, 2-3 .36, 2-3-4 .216, 3 .2 are the best four; 2-4 and 3-4 (.12) are not
    assert draft.tokens[0].tolist() == [2, 3, 4, 3]
    assert draft.parents[0].tolist() == [-1, 0, 1, -1]  # most probable first, so parents first
    # One forward per level; a node is expanded only while its subtree can still make the cut.
    assert [level.valid.sum().item() for level in levels] == [2, 1, 1]
    assert levels[0].tokens[0].tolist() == [2, 3] and levels[0].valid[1].tolist() == [False, False]
    assert levels[1].visible[0, 0].tolist() == [True, False, True]  # 2-3 sees 2 and itself
    assert levels[1].depths[0, 0].item() == 1 - 2  # position after 2, two fed tree columns counted


@pytest.fixture(scope="module")
def sampling_pair():
    return tiny_llama(20, vocab_size=8, eos_token_id=None), tiny_llama(21, vocab_size=8, eos_token_id=None)


def _tree_spec(draft):
    return dict(method="draft_model", draft=draft, num_draft_tokens=4, tree=True, options=dict(tree_top_k=2))


@pytest.mark.parametrize("setting", ["temp", "topk_topp", "rep_penalty"])
def test_tree_samples_follow_target_distribution(sampling_pair, setting, monkeypatch):
    target, draft = sampling_pair
    exact = exact_distribution(target, SETTINGS[setting], BRANCHING_PROMPT)
    samples = sample_trees(target, SETTINGS[setting], 40, monkeypatch, spec=_tree_spec(draft))
    assert chi2_pvalue(samples, exact) > ALPHA


def test_control_walk_that_prefers_the_draft_is_rejected(sampling_pair, monkeypatch):
    """A walk that, where the target's pick is no root child, accepts the draft's first root child
    half of the time must fail the same test."""
    target, draft = sampling_pair
    exact = exact_distribution(target, SETTINGS["temp"], BRANCHING_PROMPT)
    samples = sample_trees(
        target, SETTINGS["temp"], 41, monkeypatch, walk_preferring_drafts, _tree_spec(draft)
    )
    assert chi2_pvalue(samples, exact) < ALPHA
