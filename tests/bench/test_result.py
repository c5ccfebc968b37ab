"""Tokens per target forward counted from outside a call (`tokens_per_verify_forward`): the same
figure as the statistics' mean accepted length, plain decoding's 1.0."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.bench.result import tokens_per_verify_forward

from ..conftest import tiny_llama
from ..helpers.trees import repetitive_batch

NEW = 24


@pytest.fixture(scope="module")
def target_no_eos():
    return tiny_llama(0, eos_token_id=None)


def counted(model, speculative=None, seed: int = 0):
    """(new tokens, target forwards as a forward hook counts them, the call's output) of one call."""
    input_ids, attention_mask = repetitive_batch(seed, 1)
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    extra = {} if speculative is None else {"speculative": speculative, "return_dict_in_generate": True}
    try:
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False, **extra
        )
    finally:
        hook.remove()
    sequences = out if speculative is None else out.sequences
    return sequences.shape[1] - input_ids.shape[1], len(forwards), out


def test_by_hand():
    # Prompt forward + 3 verify forwards, 10 tokens: the first token is the prompt's, 9 from 3.
    assert tokens_per_verify_forward(10, 4) == pytest.approx(3.0)
    assert tokens_per_verify_forward(10 + 7, 4 + 3, calls=2) == pytest.approx((9 + 6) / (3 + 2))
    assert tokens_per_verify_forward(1, 1) == 0.0  # nothing after the prompt's forward


def test_plain_decoding_makes_one(target_no_eos):
    tokens, forwards, _ = counted(target_no_eos)
    assert (tokens, forwards) == (NEW, NEW)  # the prompt's forward and one a token after it
    assert tokens_per_verify_forward(tokens, forwards) == 1.0


@pytest.mark.parametrize("k", [2, 6])
def test_equals_the_stats_mean_accepted_length(target_no_eos, k):
    """Without an EOS nothing is cut, so the count from outside and the statistics agree exactly:
    neither counts the prompt's forward (a figure that did would sit below this one)."""
    spec = dict(method="ngram", num_draft_tokens=k, options=dict(min_ngram=1))
    tokens, forwards, out = counted(target_no_eos, spec)
    stats = out.speculative_stats
    assert stats.accepted > 0 and forwards == stats.target_forwards
    assert tokens_per_verify_forward(tokens, forwards) == pytest.approx(stats.mean_accepted_length)
    assert stats.mean_accepted_length > tokens / forwards  # the prompt's forward left out


def test_pooled_over_calls_equals_merged_stats(target_no_eos):
    spec = dict(method="ngram", num_draft_tokens=4, options=dict(min_ngram=1))
    calls = [counted(target_no_eos, spec, seed) for seed in (0, 1, 2)]
    merged = calls[0][2].speculative_stats
    for _, _, out in calls[1:]:
        merged.merge(out.speculative_stats)
    tokens, forwards = sum(c[0] for c in calls), sum(c[1] for c in calls)
    assert tokens_per_verify_forward(tokens, forwards, calls=3) == pytest.approx(merged.mean_accepted_length)
    assert torch.tensor([c[0] for c in calls]).eq(NEW).all()
