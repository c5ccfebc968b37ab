"""`hf_specdec.lossless.check_greedy` on controls: identical rows, a constructed tie, and mismatches."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.lossless import IDENTICAL, MISMATCH, TIE, check_greedy, count_kinds, rounding_bound

from ..conftest import random_batch, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, eos_token_id=None)


@pytest.fixture(scope="module")
def ragged(model):
    input_ids, attention_mask = random_batch(seed=5, batch=3)
    plain = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False
    )
    return input_ids, attention_mask, plain


def test_rounding_bounds():
    assert rounding_bound(20.0, torch.bfloat16) == 4 * 2.0**-3  # four bf16 steps of 1/8 at 16-32
    assert rounding_bound(-40.0, torch.bfloat16) == 4 * 2.0**-2
    assert rounding_bound(20.0, torch.float16) == 4 * 2.0**-6
    assert rounding_bound(20.0, torch.float32) == pytest.approx(2e-3)
    assert rounding_bound(0.01, torch.float32) == pytest.approx(1e-4)


def test_identical_rows(model, ragged):
    input_ids, attention_mask, plain = ragged
    checks = check_greedy(model, input_ids, plain, plain.clone(), attention_mask)
    assert [c.kind for c in checks] == [IDENTICAL] * 3
    assert count_kinds(checks) == {IDENTICAL: 3, TIE: 0, MISMATCH: 0}


def test_a_token_outside_the_top_two_is_a_mismatch(model, ragged):
    """Control: row 1 altered at a position that is no tie. The recomputed scores (left padding and
    positions as `generate` had them) rank plain's token first."""
    input_ids, attention_mask, plain = ragged
    spec, at = plain.clone(), input_ids.shape[1] + 4
    spec[1, at] = (plain[1, at] + 7) % model.config.vocab_size
    checks = check_greedy(model, input_ids, plain, spec, attention_mask)
    assert [c.kind for c in checks] == [IDENTICAL, MISMATCH, IDENTICAL]
    bad = checks[1]
    assert bad.position == 4 and bad.top_two[0] == int(plain[1, at]) and bad.gap > bad.bound
    assert "mismatch at generated token 4" in bad.describe()


def test_a_tie_within_the_bound_with_both_tokens_on_top_is_a_tie(model, ragged):
    """Control: scores made to tie (as rounding does) at one position; the speculative row takes the
    runner-up there. A gap just over the bound, or a third token, is still a mismatch."""
    input_ids, attention_mask, plain = ragged
    at = input_ids.shape[1] + 3
    first = int(plain[0, at])

    def tie(runner_up: int, gap: float):
        def processor(ids, scores):
            if ids.shape[1] == at:
                scores = scores.clone()
                scores[:, runner_up] = scores[:, first] - gap
            return scores

        return processor

    runner_up = (first + 1) % model.config.vocab_size
    spec = plain.clone()
    spec[0, at] = runner_up
    within = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 0.0))
    assert [c.kind for c in within] == [TIE, IDENTICAL, IDENTICAL]
    assert set(within[0].top_two) == {first, runner_up} and within[0].gap == 0.0

    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 1.0))
    assert check[0].kind == MISMATCH  # 1.0 is far more than fp32 rounding at these magnitudes

    third = (first + 2) % model.config.vocab_size
    spec[0, at] = third  # the top two tie, but speculation took neither of them
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 0.0))
    assert check[0].kind == MISMATCH


def test_the_bound_is_taken_at_the_rows_largest_score(model, ragged):
    """Every score of a row carries the rounding of the same hidden state: two small top scores in
    a row that also holds a large one are held to the large one's bound (in bf16, a gap of 0.094
    between two tokens at 3.3, in a row reaching |28|, was rounding: the same prefix fed in other
    chunks moved it between 0.016 and 0.20)."""
    input_ids, attention_mask, plain = ragged
    at = input_ids.shape[1] + 3
    first = int(plain[0, at])
    runner_up, far = ((first + i) % model.config.vocab_size for i in (1, 2))

    def small_top_two(ids, scores):
        if ids.shape[1] == at:
            scores = scores.clamp(max=0.0)
            scores[:, first], scores[:, runner_up], scores[:, far] = 3.3, 3.25, -1000.0
        return scores

    spec = plain.clone()
    spec[0, at] = runner_up
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=small_top_two)[0]
    assert check.kind == TIE and check.bound == rounding_bound(1000.0, torch.float32)


def test_a_three_way_tie_is_a_tie_whichever_two_tokens_were_taken(model, ragged):
    """Where three tokens score within rounding of each other, the recomputation may rank a third
    one first (seen in bf16 on SmolLM2: plain took a token the one-forward recompute put third,
    0.125 below the best): both tokens within the bound of the best score is still a tie."""
    input_ids, attention_mask, plain = ragged
    at = input_ids.shape[1] + 3
    first = int(plain[0, at])
    second, third = ((first + i) % model.config.vocab_size for i in (1, 2))

    def three_way(ids, scores):
        if ids.shape[1] == at:
            scores = scores.clone()
            scores[:, second] = scores[:, first] + 1e-4  # ranked above plain's token, within fp32 rounding
            scores[:, third] = scores[:, first]
        return scores

    spec = plain.clone()
    spec[0, at] = third
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=three_way)[0]
    assert check.kind == TIE and check.top_two[0] == second and first not in check.top_two[:1]
    assert check.gap <= check.bound


def test_padding_after_eos_is_ignored_and_a_short_row_is_a_mismatch(model, ragged):
    input_ids, attention_mask, plain = ragged
    eos = int(plain[2, input_ids.shape[1] + 2])
    spec = plain.clone()
    spec[2, input_ids.shape[1] + 3 :] = 0  # after row 2's "EOS": padding, not output
    checks = check_greedy(model, input_ids, plain, spec, attention_mask, eos_token_ids=[eos])
    assert checks[2].kind == IDENTICAL
    shorter = plain[:, :-2]
    checks = check_greedy(model, input_ids, plain, shorter, attention_mask, eos_token_ids=[])
    assert [c.kind for c in checks] == [MISMATCH] * 3
    assert "lengths differ" in checks[0].describe()
