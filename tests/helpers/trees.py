"""Tree-draft test inputs: repetitive prompts that n-gram tries draft from, and sampling with trees
checked against the exact distribution (`helpers.sampling`)."""

from __future__ import annotations

import torch

from hf_specdec.core.verify import tree_verify

from ..conftest import random_batch
from .sampling import NEW, ROWS, continuation_index


def repetitive_batch(seed: int, batch: int):
    input_ids, attention_mask = random_batch(seed, batch)
    tail = input_ids[:, -5:]
    input_ids = torch.cat([input_ids, tail, tail], dim=1)
    extra = torch.ones(batch, 2 * tail.shape[1], dtype=attention_mask.dtype)  # the two tails are real tokens
    attention_mask = torch.cat([attention_mask, extra], dim=1)
    return input_ids, attention_mask


# Every token of the vocabulary-8 target recurs here followed by different tokens: trees branch.
BRANCHING_PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 0, 7, 2, 3, 4, 6, 2, 6, 4, 3, 3, 7, 1, 0, 2]


def sample_trees(
    model, settings: dict, seed: int, monkeypatch, verifier=None, spec=None, least_counters=None
) -> torch.Tensor:
    """ROWS speculative samples after BRANCHING_PROMPT (n-gram tries unless `spec` says otherwise),
    checking that the trees really branched, and that the drafter reported at least
    `least_counters` (name -> count) of its own counters."""
    import hf_specdec.core.verify

    verify = verifier or hf_specdec.core.verify.tree_verify
    branched = []

    def spy(draft_tokens, draft_lengths, parents, picks):
        for row, n in zip(parents.tolist(), draft_lengths):  # two nodes with one parent: a branch
            branched.append(len(set(row[:n])) < n)
        return verify(draft_tokens, draft_lengths, parents, picks)

    monkeypatch.setattr(hf_specdec.core.verify, "tree_verify", spy)
    input_ids = torch.tensor([BRANCHING_PROMPT]).repeat(ROWS, 1)
    spec = spec or dict(method="ngram", num_draft_tokens=4, tree=True, options=dict(min_ngram=1))
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW + 4,  # room for whole trees; the first NEW tokens' marginal must be exact
        do_sample=True,
        speculative=spec,
        return_dict_in_generate=True,
        **settings,
    )
    stats = out.speculative_stats
    assert any(branched) and 0 < stats.accepted < stats.drafted
    for name, least in (least_counters or {}).items():
        assert stats.drafter_counters[name] >= least, stats.drafter_counters
    return continuation_index(out.sequences[:, : len(BRANCHING_PROMPT) + NEW], len(BRANCHING_PROMPT))


def walk_preferring_drafts(draft_tokens, draft_lengths, parents, picks):
    """`tree_verify`, except that half of the times the target's pick is no root child it accepts
    the first root child anyway: it favours drafted tokens, which the exactness tests must catch."""
    paths, tokens = tree_verify(draft_tokens, draft_lengths, parents, picks)
    for b, path in enumerate(paths):
        if not path and draft_lengths[b] > 0 and torch.rand(()) < 0.5:
            path.append(0)
            tokens[b, 0] = draft_tokens[b, 0]
            tokens[b, 1] = picks[b, 1]  # the target's pick after node 0
    return paths, tokens
