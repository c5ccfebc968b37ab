"""`hf_specdec.lossless.check_greedy` and `check_sampled` on controls: identical rows, ties, mismatches."""

from __future__ import annotations

import pytest
import torch

from hf_specdec import lossless
from hf_specdec.lossless import (
    IDENTICAL,
    MISMATCH,
    TIE,
    can_check_sampled,
    check_greedy,
    check_sampled,
    count_kinds,
    rounding_bound,
)

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


def _taking(model, input_ids, attention_mask, rows, at, token):
    """`rows` [B, P + N] with row 0 taking `token` at column `at` and going on from there as the
    target's greedy continuation of that prefix: what speculation that took another token at a tie
    outputs."""
    prefix = torch.cat([rows[0, :at], torch.tensor([token])])[None]
    mask = torch.cat([attention_mask[0], torch.ones(at + 1 - input_ids.shape[1], dtype=attention_mask.dtype)])
    continued = model.generate(
        input_ids=prefix, attention_mask=mask[None], max_new_tokens=rows.shape[1] - at - 1, do_sample=False
    )
    spec = rows.clone()
    spec[0] = continued[0]
    return spec


def _tied_row(model, ragged, at):
    """A processor that makes plain row 0's token at column `at` tie with the runner-up, and the
    rows with row 0 taking the runner-up there and going on as the target would (`_taking`)."""
    input_ids, attention_mask, plain = ragged
    first = int(plain[0, at])
    runner_up = (first + 1) % model.config.vocab_size

    def tie(ids, scores):
        if ids.shape[1] == at:
            scores = scores.clone()
            scores[:, runner_up] = scores[:, first]
        return scores

    return tie, _taking(model, input_ids, attention_mask, plain, at, runner_up)


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
    spec = _taking(model, input_ids, attention_mask, plain, at, runner_up)
    within = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 0.0))
    assert [c.kind for c in within] == [TIE, IDENTICAL, IDENTICAL]
    assert set(within[0].top_two) == {first, runner_up} and within[0].gap == 0.0

    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 1.0))
    assert check[0].kind == MISMATCH  # 1.0 is far more than fp32 rounding at these magnitudes

    third = (first + 2) % model.config.vocab_size
    spec[0, at] = third  # the top two tie, but speculation took neither of them
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie(runner_up, 0.0))
    assert check[0].kind == MISMATCH


def test_a_wrong_token_after_a_tie_is_a_mismatch(model, ragged):
    """A tie ends the comparison with plain's row, not the check: from there speculation's row must
    be the target's greedy continuation of its own prefix. Planted: a row that took the runner-up at
    a tie and then, three tokens on, a token the target ranks far down (as a draft accepted one
    position too far, or a rejected token left in the cache, gives); judged on its first difference
    alone, the row passed for a tie."""
    input_ids, attention_mask, plain = ragged
    at = input_ids.shape[1] + 3
    tie, spec = _tied_row(model, ragged, at)
    assert check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie)[0].kind == TIE
    later = at + 3
    spec[0, later] = (spec[0, later] + 7) % model.config.vocab_size
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie)[0]
    assert check.kind == MISMATCH and check.tie_at == 3 and check.position == 6 and check.gap > check.bound
    assert check.plain_token is None and check.speculative_token == int(spec[0, later])
    assert "mismatch at generated token 6, after a tie at 3" in check.describe()


def test_the_padding_after_a_stop_string_is_not_held_to_the_target(model, ragged):
    """A row that took a tie and was then stopped by a stop string ends in padding (no EOS to end
    the comparison at): the padding after the stop is no choice of the target's, so the row is still
    a tie."""
    input_ids, attention_mask, plain = ragged
    at = input_ids.shape[1] + 3
    tie, spec = _tied_row(model, ragged, at)
    assert model.generation_config.pad_token_id == 0 and model.generation_config.eos_token_id is None
    spec[0, at + 3 :] = 0  # stopped three tokens after the tie, padded
    check = check_greedy(model, input_ids, plain, spec, attention_mask, logits_processor=tie)[0]
    assert check.kind == TIE and check.position == 3


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

    spec = _taking(model, input_ids, attention_mask, plain, at, runner_up)
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

    spec = _taking(model, input_ids, attention_mask, plain, at, third)
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


# --- check_sampled: seeded sampling against plain's sample ---


@pytest.fixture(scope="module")
def sampled(model):
    """Plain seeded sampling of a left-padded batch of three, with the scores it sampled from."""
    input_ids, attention_mask = random_batch(seed=6, batch=3)
    torch.manual_seed(11)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=10,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return input_ids, attention_mask, out


def _check(out, spec, prompt_length, seed=11, scores=None):
    return check_sampled(
        out.sequences, scores or out.scores, spec, prompt_length, seed, torch.float32, eos_token_ids=[]
    )


def test_a_seeded_speculative_sample_is_identical_and_a_changed_token_a_mismatch(model, sampled):
    """The seeded ngram call samples plain's tokens (drafts chosen without draws); row 2 changed to
    a token plain's draw ranks far down is a mismatch, and a wrong seed cannot reproduce plain's
    draws: refused, not misread."""
    input_ids, attention_mask, out = sampled
    torch.manual_seed(11)
    ours = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=10,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        speculative="ngram",
    )
    prompt_length = input_ids.shape[1]
    assert [c.kind for c in _check(out, ours, prompt_length)] == [IDENTICAL] * 3
    spec, at = out.sequences.clone(), prompt_length + 5
    noise = torch.Generator().manual_seed(11)
    drawn = [torch.empty(s.shape).exponential_(generator=noise) for s in out.scores[:6]]
    spec[2, at] = int((out.scores[5][2] - drawn[5][2].log()).argmin())
    checks = _check(out, spec, prompt_length)
    assert [c.kind for c in checks] == [IDENTICAL, IDENTICAL, MISMATCH]
    assert checks[2].position == 5 and checks[2].gap > checks[2].bound
    with pytest.raises(ValueError, match="not the argmax of its scores over the Exp"):
        _check(out, spec, prompt_length, seed=12)


def test_a_draw_that_rounding_can_flip_is_a_tie(sampled):
    """Control: plain's scores at one position made to put the runner-up of s - log E within the
    rounding bound of plain's token (as a verify forward's rounding can); the speculative row took
    that runner-up. Just over the bound, the same row is a mismatch."""
    input_ids, _, out = sampled
    prompt_length, at = input_ids.shape[1], 4
    noise = torch.Generator().manual_seed(11)
    drawn = [torch.empty(s.shape).exponential_(generator=noise) for s in out.scores[: at + 1]]
    u = out.scores[at][0] - drawn[at][0].log()
    top, runner = u.topk(2).indices.tolist()
    bound = rounding_bound(float(out.scores[at][0].abs().max()), torch.float32)
    spec = out.sequences.clone()
    spec[0, prompt_length + at] = runner
    for slack, kind in ((0.5, TIE), (1.5, MISMATCH)):
        scores = [s.clone() for s in out.scores]
        scores[at][0, runner] += float(u[top] - u[runner]) - slack * bound  # `runner` `slack` bounds below
        checks = _check(out, spec, prompt_length, scores=scores)
        assert checks[0].kind == kind and checks[0].gap == pytest.approx(slack * bound, rel=1e-2)


@pytest.mark.parametrize(
    ("temperature", "logit", "gap", "kind"),
    [
        (0.7, 20.0, 0.6, TIE),  # bound 0.5 / 0.7 = 0.71; taken at |28.6| it read 0.5: a false alarm
        (0.7, 20.0, 0.8, MISMATCH),
        (1.5, 20.0, 0.3, TIE),  # bound 0.5 / 1.5 = 0.33; taken at |13.3| it read 0.25
        (1.5, 20.0, 0.4, MISMATCH),
        (0.9, 30.0, 0.8, MISMATCH),  # bound 0.5 / 0.9 = 0.56; taken at |33.3| it read 1.0: a bug passed
    ],
)
def test_the_bound_is_the_logits_rounding_divided_by_the_temperature(sampled, temperature, logit, gap, kind):
    """Control: a bf16 row whose logits reach |logit|, divided by the temperature as sampling's
    processors divide them, with the runner-up of s - log E `gap` below plain's token. The logits
    were rounded at their own magnitude and the division scales that rounding by 1/T, so the bound
    is `rounding_bound(logit) / T`, not the bound at the processed scores' magnitude logit / T."""
    input_ids, _, out = sampled
    prompt_length, at = input_ids.shape[1], 4
    noise = torch.Generator().manual_seed(11)
    drawn = [torch.empty(s.shape).exponential_(generator=noise) for s in out.scores[: at + 1]]
    u = out.scores[at][0] - drawn[at][0].log()
    top, runner = u.topk(2).indices.tolist()
    scores = [s.clone() for s in out.scores]
    scores[at][0, u.argmin()] = -logit / temperature  # the row's largest |logit|, a token no draw picks
    scores[at][0, runner] += float(u[top] - u[runner]) - gap
    spec = out.sequences.clone()
    spec[0, prompt_length + at] = runner
    check = check_sampled(
        out.sequences,
        scores,
        spec,
        prompt_length,
        11,
        torch.bfloat16,
        eos_token_ids=[],
        temperature=temperature,
    )[0]
    assert check.kind == kind and check.gap == pytest.approx(gap, rel=1e-4)
    assert check.bound == pytest.approx(rounding_bound(logit, torch.bfloat16) / temperature)


@pytest.mark.parametrize(("gap", "kind"), [(0.375, TIE), (1.25, MISMATCH)])
def test_under_top_k_the_bound_is_taken_at_the_unmasked_logits(sampled, gap, kind):
    """Control modelled on a bf16 SmolLM2 row (benchmarks/micro/logit_drift.py): its logits reach
    5.78 and -33.0, and a verify forward moved its top two 0.375 apart: 1.5 bf16 steps at |33|,
    twelve at 5.78. Top-k cuts the -33.0, so the kept scores alone put the bound at 5.78 (0.125):
    such a tie read as a mismatch. With plain's raw logits the bound is the one at |33| (1.0), over
    the temperature; a gap past it stays a mismatch."""
    input_ids, _, out = sampled
    prompt_length, at, temperature = input_ids.shape[1], 4, 0.8
    noise = torch.Generator().manual_seed(11)
    log_e = [torch.empty(s.shape).exponential_(generator=noise) for s in out.scores[: at + 1]][at][0].log()
    plain_token = int(out.sequences[0, prompt_length + at])
    runner = int(log_e.masked_fill(torch.arange(len(log_e)) == plain_token, torch.inf).argmin())
    logits = [s * temperature for s in out.scores]
    row = torch.full_like(logits[at][0], -10.0)
    row[0] = -33.0  # the row's largest |logit|, one top-k cuts
    row[plain_token] = 5.78
    # the runner-up's draw `gap` (in logits) below plain's: u = logit / T - log E
    row[runner] = 5.78 - temperature * float(log_e[plain_token] - log_e[runner]) - gap
    row[int(log_e.argmax())] = -5.0  # top-k's k-th, far below both and drawn too low to win
    assert -5 < float(row[runner]) < 5.78  # kept by top-k; 5.78 the largest score kept
    logits[at][0] = row
    scores = [s / temperature for s in logits]
    scores[at][0] = (row / temperature).masked_fill(row < -5.0, -torch.inf)  # top-k: 3 kept
    spec = out.sequences.clone()
    spec[0, prompt_length + at] = runner
    check = check_sampled(
        out.sequences,
        scores,
        spec,
        prompt_length,
        11,
        torch.bfloat16,
        eos_token_ids=[],
        temperature=temperature,
        plain_logits=logits,
    )[0]
    assert check.kind == kind and check.gap == pytest.approx(gap / temperature, rel=1e-4)
    assert check.bound == pytest.approx(rounding_bound(33.0, torch.bfloat16) / temperature)


def test_plain_token_at_a_top_k_cut_off_that_rounding_can_cut_is_a_tie(sampled):
    """Control: plain's scores at one position cut to a top set whose lowest score is plain's own
    token (top-k's k-th, tied at the cut-off), which a verify forward's rounding can push below the
    cut: speculation then takes the best draw of the other tokens, a tie of the cut-off however far
    below plain's draw it lies. With one token kept 3 bounds below plain's, plain's token is clear
    of the cut-off and the same row is a mismatch; so is a speculative token cut by plain's
    processors, which plain's scores cannot judge."""
    input_ids, _, out = sampled
    prompt_length = input_ids.shape[1]
    noise = torch.Generator().manual_seed(11)
    drawn = [torch.empty(s.shape).exponential_(generator=noise) for s in out.scores]
    plain = out.sequences[0, prompt_length:].tolist()
    at = next(t for t, s in enumerate(out.scores) if int((s[0] > s[0, plain[t]]).sum()) >= 2)
    row, log_e = out.scores[at][0], drawn[at][0].log()
    bound = rounding_bound(float(row.abs().max()), torch.float32)
    cut = row.masked_fill(row < row[plain[at]], -torch.inf)  # kept: plain's token and those above it
    best_rest = int((cut - log_e).masked_fill(torch.arange(len(row)) == plain[at], -torch.inf).argmax())
    assert float((cut - log_e)[plain[at]] - (cut - log_e)[best_rest]) > bound  # not a tie of the draw
    spec = out.sequences.clone()
    spec[0, prompt_length + at] = best_rest
    scores = [s.clone() for s in out.scores]
    scores[at][0] = cut
    check = _check(out, spec, prompt_length, scores=scores)[0]
    assert check.kind == TIE and check.at_cut_off and check.gap == 0 and "cut-off" in check.describe()

    below = (row - log_e).masked_fill(row >= row[plain[at]], torch.inf).argmin()  # a draw too low to win
    scores[at][0, below] = float(row[plain[at]]) - 3 * bound
    check = _check(out, spec, prompt_length, scores=scores)[0]
    assert check.kind == MISMATCH and not check.at_cut_off

    spec[0, prompt_length + at] = int(below)
    scores[at][0] = cut
    assert _check(out, spec, prompt_length, scores=scores)[0].kind == MISMATCH


def test_check_sampled_refuses_a_device_whose_draws_it_cannot_reproduce(sampled):
    """Plain's draws are drawn again from the default generator of CPU or CUDA only: scores on any
    other device are refused with a message, not judged against other numbers."""
    input_ids, _, out = sampled
    assert can_check_sampled("cpu") and not can_check_sampled("meta")
    scores = [s.to("meta") for s in out.scores]
    with pytest.raises(ValueError, match="cannot reproduce plain sampling's draws on meta"):
        _check(out, out.sequences, input_ids.shape[1], scores=scores)


def test_the_generation_configs_processors_score_the_rows(ragged, monkeypatch):
    """A repetition penalty in the model's generation config (Qwen's chat models set one) applies
    to plain greedy `generate` and to speculation alike: the target's scores a row is held to are
    processed by it too, where the caller passes no processors (raw logits would call a row that
    followed the penalised scores a mismatch, or one that did not a tie)."""
    input_ids, attention_mask, plain = ragged
    model = tiny_llama(0, eos_token_id=None)
    model.generation_config.repetition_penalty = 1.5
    scored = []
    along = lossless._scores_along
    monkeypatch.setattr(lossless, "_scores_along", lambda *a: scored.append(a[-1]) or along(*a))
    spec = plain.clone()
    spec[0, -1] = (spec[0, -1] + 1) % model.config.vocab_size
    check_greedy(model, input_ids, plain, spec, attention_mask)
    (processors,) = scored
    assert [type(p).__name__ for p in processors] == ["RepetitionPenaltyLogitsProcessor"]
    model.generation_config.repetition_penalty = 1.0
    scored.clear()
    check_greedy(model, input_ids, plain, spec, attention_mask)
    assert scored == [None]


def test_the_generation_configs_penalty_spares_a_rows_left_padding(ragged, monkeypatch):
    """Plain greedy `generate` builds the repetition penalty with each row's left-padding length, so
    the pad token (often the EOS) in a row's padding is not penalised: a row held to scores that
    penalised it would be held to other scores than plain's. A padded row (pad id 0, in no prompt)
    that differs at its last token is held to plain's own `scores` there."""
    input_ids, attention_mask, _ = ragged
    model = tiny_llama(0, eos_token_id=None)
    model.generation_config.repetition_penalty = 1.5
    row = int((attention_mask[:, 0] == 0).nonzero()[0])
    plain = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    assert 0 not in plain.sequences[row, input_ids.shape[1] :].tolist()  # in its padding alone
    scored = []
    along = lossless._scores_along
    monkeypatch.setattr(lossless, "_scores_along", lambda *a: scored.append(along(*a)) or scored[-1])
    spec = plain.sequences.clone()
    spec[row, -1] = (spec[row, -1] + 1) % model.config.vocab_size
    check_greedy(model, input_ids, plain.sequences, spec, attention_mask)
    (scores,) = scored
    torch.testing.assert_close(scores[0], plain.scores[-1][row], rtol=1e-5, atol=1e-5)
