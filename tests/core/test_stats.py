"""`SpeculativeStats` arithmetic, and the invariants the stats of real calls satisfy."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec import SpeculativeStats

from ..conftest import random_batch, tiny_llama

# (drafted, accepted) per step
STEP_TABLES = {
    "empty": [],
    "plain_only": [(0, 0), (0, 0)],
    "all_accepted": [(3, 3), (3, 3)],
    "none_accepted": [(4, 0), (2, 0)],
    "mixed": [(3, 1), (0, 0), (5, 5), (2, 0), (1, 1)],
}


def reference(steps):
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max((d for d, _ in steps), default=0)
    pos_d = [sum(1 for d, _ in steps if d > i) for i in range(width)]
    pos_a = [sum(1 for _, a in steps if a > i) for i in range(width)]
    return dict(
        steps=len(steps),
        speculative_steps=sum(1 for d, _ in steps if d),
        plain_steps=sum(1 for d, _ in steps if not d),
        drafted=drafted,
        accepted=accepted,
        position_drafted=pos_d,
        position_accepted=pos_a,
    )


def recorded(steps, method="x") -> SpeculativeStats:
    stats = SpeculativeStats(method=method)
    for d, a in steps:
        stats.record_step(d, a)
    return stats


def check_invariants(stats: SpeculativeStats) -> None:
    assert stats.steps == stats.speculative_steps + stats.plain_steps
    assert 0 <= stats.accepted <= stats.drafted
    assert sum(stats.position_drafted) == stats.drafted
    assert sum(stats.position_accepted) == stats.accepted
    assert all(a <= d for a, d in zip(stats.position_accepted, stats.position_drafted))
    assert stats.position_drafted == sorted(stats.position_drafted, reverse=True)  # drafts are prefixes
    assert 0.0 <= stats.acceptance_rate <= 1.0
    if stats.steps:
        assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted / stats.steps)
    else:
        assert stats.mean_accepted_length == 0.0
    if stats.speculative_steps:
        # vLLM's "mean acceptance length" and Spec-Bench's τ: per step that verified a draft.
        assert stats.mean_accepted_length_speculative == pytest.approx(
            1 + stats.accepted / stats.speculative_steps
        )
        assert stats.mean_accepted_length_speculative >= stats.mean_accepted_length
    else:
        assert stats.mean_accepted_length_speculative == 0.0


@pytest.mark.parametrize("table", list(STEP_TABLES))
def test_record_step_and_derived_figures(table):
    steps = STEP_TABLES[table]
    stats = recorded(steps)
    ref = reference(steps)
    for name, value in ref.items():
        assert getattr(stats, name) == value, name
    check_invariants(stats)
    assert stats.acceptance_rate == (
        pytest.approx(ref["accepted"] / ref["drafted"]) if ref["drafted"] else 0.0
    )
    expected_alpha = [a / d for a, d in zip(ref["position_accepted"], ref["position_drafted"])]
    assert stats.per_position_acceptance == pytest.approx(expected_alpha)


def test_mixed_table_by_hand():
    stats = recorded(STEP_TABLES["mixed"])
    assert stats.position_drafted == [4, 3, 2, 1, 1]
    assert stats.position_accepted == [3, 1, 1, 1, 1]
    assert stats.per_position_acceptance == pytest.approx([0.75, 1 / 3, 0.5, 1.0, 1.0])
    assert stats.acceptance_rate == pytest.approx(7 / 11)
    assert stats.mean_accepted_length == pytest.approx(1 + 7 / 5)  # 5 steps, one of them plain
    assert stats.mean_accepted_length_speculative == pytest.approx(1 + 7 / 4)  # 4 drafts


@pytest.mark.parametrize(
    "left,right", [("mixed", "all_accepted"), ("empty", "mixed"), ("plain_only", "none_accepted")]
)
def test_merge_equals_recording_everything(left, right):
    a = recorded(STEP_TABLES[left], method="")
    a.emitted, a.target_forwards, a.draft_seconds, a.verify_seconds = 5, 2, 0.5, 1.0
    b = recorded(STEP_TABLES[right], method="ngram")
    b.emitted, b.target_forwards, b.draft_seconds, b.verify_seconds = 7, 3, 0.25, 2.0
    b_before = b.to_dict()
    a.merge(b)
    both = recorded(STEP_TABLES[left] + STEP_TABLES[right])
    for name in ("steps", "speculative_steps", "plain_steps", "drafted", "accepted"):
        assert getattr(a, name) == getattr(both, name), name
    assert a.position_drafted == both.position_drafted
    assert a.position_accepted == both.position_accepted
    assert (a.emitted, a.target_forwards) == (12, 5)
    assert a.draft_seconds == pytest.approx(0.75) and a.verify_seconds == pytest.approx(3.0)
    assert a.method == "ngram"  # an empty method takes the other's
    assert b.to_dict() == b_before  # merging does not modify the other
    check_invariants(a)


def test_merge_adds_up_the_drafters_own_counters_by_name():
    a, b = recorded([(1, 1)]), recorded([(1, 0)])
    a.drafter_counters, a.finish_seconds = {"corpus_drafting": 1, "corpus_drafts": 3}, 0.25
    b.drafter_counters, b.finish_seconds = {"corpus_drafts": 2, "other": 5}, 0.5
    a.merge(b)
    assert a.drafter_counters == {"corpus_drafting": 1, "corpus_drafts": 5, "other": 5}
    assert a.finish_seconds == pytest.approx(0.75)
    assert b.drafter_counters == {"corpus_drafts": 2, "other": 5}  # the other's are not modified
    fresh = SpeculativeStats()
    fresh.merge(b)
    assert fresh.drafter_counters == b.drafter_counters


def test_merge_keeps_own_method():
    a, b = recorded([(1, 1)], method="draft_model"), recorded([(1, 0)], method="ngram")
    a.merge(b)
    assert a.method == "draft_model"


def test_to_dict_is_json_and_consistent():
    stats = recorded(STEP_TABLES["mixed"], method="ngram")
    stats.drafter_counters, stats.finish_seconds = {"corpus_drafts": 4}, 0.125
    d = stats.to_dict()
    json.dumps(d)
    assert d["method"] == "ngram"
    for name in (
        "target_forwards",
        "steps",
        "speculative_steps",
        "plain_steps",
        "rejection_sampled_steps",
        "drafted",
        "accepted",
        "emitted",
        "finish_seconds",
        "drafter_counters",
    ):
        assert d[name] == getattr(stats, name)
    assert d["acceptance_rate"] == stats.acceptance_rate
    assert d["mean_accepted_length"] == stats.mean_accepted_length
    assert d["mean_accepted_length_speculative"] == stats.mean_accepted_length_speculative
    assert d["per_position_acceptance"] == stats.per_position_acceptance
    assert "ngram" in str(stats) and "2.75 per speculative step" in str(stats)


def test_tree_steps_count_nodes_and_depths():
    """A tree's nodes count as drafted (all were verified); its depth is counted apart."""
    chain = recorded([(3, 1), (0, 0), (3, 3)])
    assert (chain.tree_steps, chain.tree_depth, chain.mean_tree_depth) == (0, 0, 0.0)
    assert chain.mean_nodes_verified == pytest.approx(3.0)  # a chain's nodes are its tokens
    assert "tree nodes" not in str(chain)

    tree = SpeculativeStats(method="ngram")
    tree.record_step(6, 2, tree_depth=3)
    tree.record_step(0, 0, tree_depth=0)  # a row that drafted nothing is a plain step, not a tree step
    tree.record_step(8, 1, tree_depth=4)
    assert (tree.tree_steps, tree.tree_depth, tree.drafted, tree.accepted) == (2, 7, 14, 3)
    assert tree.mean_nodes_verified == pytest.approx(7.0)
    assert tree.mean_tree_depth == pytest.approx(3.5)
    assert tree.mean_accepted_length_speculative == pytest.approx(1 + 3 / 2)
    assert "7.0 tree nodes verified per speculative step (mean depth 3.5)" in str(tree)
    d = tree.to_dict()
    assert (d["mean_nodes_verified"], d["mean_tree_depth"], d["tree_steps"]) == (7.0, 3.5, 2)
    check_invariants(tree)

    chain.merge(tree)  # counters add up across calls
    assert (chain.tree_steps, chain.tree_depth, chain.drafted) == (2, 7, 20)


def test_rejection_sampled_steps_count_rows_and_add_up():
    """A verify forward whose tokens rejection sampling chose counts each of its rows, drafted or
    not; merged calls add up, and the JSON carries the count."""
    stats = SpeculativeStats()
    stats.record_steps([2, 0], [1, 0], None, rejection_sampled=True)
    stats.record_steps([3], [3], None)  # plain's draws (a draft chosen without draws)
    assert (stats.steps, stats.plain_steps, stats.rejection_sampled_steps) == (3, 1, 2)
    other = SpeculativeStats()
    other.record_step(1, 0, rejection_sampled=True)
    stats.merge(other)
    assert stats.rejection_sampled_steps == 3 and stats.to_dict()["rejection_sampled_steps"] == 3
    check_invariants(stats)


def test_fresh_stats_do_not_share_lists():
    a, b = SpeculativeStats(), SpeculativeStats()
    a.record_step(2, 1)
    assert b.position_drafted == [] and b.position_accepted == []


# ---------------------------------------------------------------------------------------------
# Stats of real calls
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_no_eos():
    return tiny_llama(0, eos_token_id=None)


CALLS = {
    "ngram-k3-b3": (dict(method="ngram", num_draft_tokens=3, options=dict(min_ngram=1)), 3, False),
    "draft-k2-b3": (dict(method="draft_model", num_draft_tokens=2), 3, False),
    "draft-auto-b1": (dict(method="draft_model", num_draft_tokens="auto"), 1, False),
    "draft-k3-b2-sample": (dict(method="draft_model", num_draft_tokens=3), 2, True),
    "ngram-auto-b2-eos": (dict(method="ngram", num_draft_tokens="auto", options=dict(min_ngram=1)), 2, False),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_real_call_stats_invariants(target, target_no_eos, good_draft, case):
    spec, batch, do_sample = CALLS[case]
    model = target if case.endswith("eos") else target_no_eos
    if spec["method"] == "draft_model":
        spec = {**spec, "draft": good_draft}
    input_ids, attention_mask = random_batch(20, batch)
    torch.manual_seed(0)
    new = 16
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new,
        do_sample=do_sample,
        speculative=spec,
        return_dict_in_generate=True,
    )
    stats = out.speculative_stats
    check_invariants(stats)
    assert stats.method == spec["method"]
    eos = model.generation_config.eos_token_id
    lengths = [
        row.index(eos) + 1 if eos is not None and eos in row else len(row)
        for row in out.sequences[:, input_ids.shape[1] :].tolist()
    ]
    assert stats.emitted == sum(lengths)
    # Rows that stopped before the others: the call hands its cache back (return_dict_in_generate),
    # so its last forward feeds them their padding, as plain decoding does, and verifies nothing.
    padded = int(len(set(lengths)) > 1)
    if eos is None:
        assert stats.emitted == batch * new
        # Drafts never run past max_new_tokens, so without EOS nothing is cut: the prompt's forward
        # gives each row its first token and is no step; each row-step then emits exactly its
        # accepted drafts plus one token of the target's, so the mean accepted length is the tokens
        # a row gained per verify forward.
        assert stats.emitted == batch + stats.steps + stats.accepted
        assert stats.mean_accepted_length == pytest.approx((stats.emitted - batch) / stats.steps)
    # Each row-step emits between 1 and accepted + 1 tokens (fewer only when cut at EOS / max length).
    assert stats.emitted <= batch + stats.steps + stats.accepted
    assert stats.steps >= batch
    # Every forward after the prompt's verifies a step of each row it holds, at least one.
    stepped = stats.target_forwards - 1 - padded
    assert stepped <= stats.steps <= batch * stepped
    if batch == 1:
        assert stats.steps == stepped
    assert stats.draft_seconds >= 0 and stats.verify_seconds > 0
    if spec["num_draft_tokens"] == "auto":
        assert len(stats.draft_lengths) == stats.target_forwards
    else:
        assert all(length <= spec["num_draft_tokens"] for length, _ in enumerate(stats.position_drafted, 1))
    # Per forward: what was verified and what it cost; the widths are those the drafted counts add up to.
    assert len(stats.verified_widths) == len(stats.verify_times) == stats.target_forwards
    untimed = {0, stats.target_forwards - 1} if padded else {0}  # the prompt's forward, the padding's
    assert all((t is None) == (i in untimed) for i, t in enumerate(stats.verify_times))
    assert all(t > 0 for t in stats.verify_times if t is not None)
    if batch == 1:
        assert sum(w - 1 for w in stats.verified_widths) == stats.drafted


@pytest.mark.parametrize("tree", [False, True])
def test_real_call_counts_the_nodes_it_verified(target_no_eos, tree, monkeypatch):
    """The stats' nodes and depths are those of the drafts the target verified (after the policy's
    cut), row by row; with trees the nodes outnumber the depth, with chains there are no tree steps."""
    import hf_specdec.core.loop

    from ..helpers.trees import repetitive_batch

    nodes, depths, trees = 0, 0, 0
    accept = hf_specdec.core.loop.accept

    def spy(request, draft, logits, draws):
        nonlocal nodes, depths, trees
        nodes += sum(draft.lengths)
        if draft.parents is not None:
            depths += sum(draft.depths())
            trees += sum(n > 0 for n in draft.lengths)
        return accept(request, draft, logits, draws)

    monkeypatch.setattr(hf_specdec.core.loop, "accept", spy)
    input_ids, attention_mask = repetitive_batch(1, 3)
    spec = dict(method="ngram", tree=tree, num_draft_tokens=6, options=dict(min_ngram=1))
    out = target_no_eos.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        speculative=spec,
        return_dict_in_generate=True,
    )
    stats = out.speculative_stats
    check_invariants(stats)
    assert stats.drafted == nodes > 0
    assert stats.mean_nodes_verified == pytest.approx(nodes / stats.speculative_steps)
    assert (stats.tree_steps, stats.tree_depth) == (trees, depths)
    if tree:
        assert stats.tree_steps == stats.speculative_steps
        assert stats.mean_nodes_verified > stats.mean_tree_depth > 0  # the trees branched
    else:
        assert stats.tree_steps == 0 and stats.mean_tree_depth == 0.0
