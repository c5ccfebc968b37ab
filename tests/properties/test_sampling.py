"""Sampling is exact (GUIDE §6): enumerate every 3-token continuation of a vocab-8 target, compute its
probability under the processed distribution, and chi-square-test thousands of speculative samples
against it. Controls show that the same test rejects samples from the wrong distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec.core.policy import AdaptiveDraftLength

from ..conftest import tiny_llama

VOCAB = 8
NEW = 3
ROWS = 4000
ALPHA = 1e-3
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4, 5]  # repeats, so the n-gram drafter proposes every step

SETTINGS = {
    "temp": dict(temperature=0.9),
    "topk_topp": dict(temperature=0.9, top_k=5, top_p=0.9),
    "rep_penalty": dict(temperature=0.9, repetition_penalty=1.3),
}


@pytest.fixture(scope="module")
def models():
    return tiny_llama(20, vocab_size=VOCAB, eos_token_id=None), tiny_llama(
        21, vocab_size=VOCAB, eos_token_id=None
    )


# ---------------------------------------------------------------------------------------------
# The exact distribution and the test
# ---------------------------------------------------------------------------------------------


def processors(temperature=1.0, top_k=None, top_p=1.0, repetition_penalty=None) -> LogitsProcessorList:
    """The processors in the order `generate` applies them: penalties first, then temperature,
    top-k, top-p."""
    procs = LogitsProcessorList()
    if repetition_penalty is not None:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


@torch.no_grad()
def next_token_probs(model, contexts: torch.Tensor, settings: dict) -> torch.Tensor:
    """Processed next-token distribution after each context row [N, L] (full forward, no cache)."""
    logits = model(contexts).logits[:, -1].float()
    return processors(**settings)(contexts, logits).softmax(-1)


def exact_distribution(model, settings: dict, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(continuation) for every one of VOCAB**NEW continuations, indexed in base VOCAB."""
    prompt = torch.tensor(prompt)
    joint = torch.ones(1)
    for depth in range(NEW):
        suffixes = list(itertools.product(range(VOCAB), repeat=depth))
        contexts = torch.stack([torch.cat([prompt, torch.tensor(s, dtype=torch.long)]) for s in suffixes])
        probs = next_token_probs(model, contexts, settings)  # [VOCAB**depth, VOCAB], same order as joint
        joint = (joint[:, None] * probs).reshape(-1)
    assert abs(float(joint.sum()) - 1.0) < 1e-4
    return joint


def continuation_index(sequences: torch.Tensor, prompt_len: int = len(PROMPT)) -> torch.Tensor:
    new = sequences[:, prompt_len:]
    assert new.shape[1] == NEW
    index = torch.zeros(new.shape[0], dtype=torch.long)
    for i in range(NEW):
        index = index * VOCAB + new[:, i]
    return index


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value; bins with expected count < 5 pooled into one, impossible samples give 0."""
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    if bool((observed[probs == 0] > 0).any()):
        return 0.0
    small = expected < 5
    obs, exp = observed[~small].tolist(), expected[~small].tolist()
    if float(expected[small].sum()) > 0:
        obs.append(float(observed[small].sum()))
        exp.append(float(expected[small].sum()))
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue)


def sample(model, settings: dict, seed: int, speculative=None, new: int = NEW) -> torch.Tensor:
    """ROWS samples of `new` tokens; only the first NEW are compared with the exact distribution
    (their marginal must be exact whatever follows)."""
    input_ids = torch.tensor([PROMPT]).repeat(ROWS, 1)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new,
        do_sample=True,
        **settings,
    )
    torch.manual_seed(seed)
    if speculative is None:
        return model.generate(**kwargs)
    out = model.generate(**kwargs, speculative=speculative, return_dict_in_generate=True)
    stats = out.speculative_stats
    assert stats.speculative_steps > 0 and stats.drafted > 0  # the drafter really took part
    assert 0 < stats.accepted < stats.drafted  # both acceptances and rejections happened
    assert stats.emitted == ROWS * new
    return out.sequences[:, : len(PROMPT) + NEW]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_reference_matches_generates_own_processing(models, setting):
    """Our enumeration uses the same processed distribution as plain `generate` (first position)."""
    target, _ = models
    input_ids = torch.tensor([PROMPT])
    out = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=1,
        do_sample=True,
        output_scores=True,
        return_dict_in_generate=True,
        **SETTINGS[setting],
    )
    ours = next_token_probs(target, input_ids, SETTINGS[setting])[0]
    torch.testing.assert_close(out.scores[0][0].softmax(-1), ours, atol=1e-6, rtol=1e-5)


CASES = {
    "draft_model-temp": ("draft_model", "temp"),
    "draft_model-topk_topp": ("draft_model", "topk_topp"),
    "draft_model-rep_penalty": ("draft_model", "rep_penalty"),
    "ngram-topk_topp": ("ngram", "topk_topp"),
    "ngram-rep_penalty": ("ngram", "rep_penalty"),
    "draft_model-temp-auto_length": ("draft_model", "temp"),
    "ngram-temp-auto_length": ("ngram", "temp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_samples_follow_target_distribution(models, case):
    target, draft = models
    method, setting = CASES[case]
    auto = case.endswith("auto_length")
    # The adaptive policy decodes the first step plainly to measure it, and may judge that a draft
    # as large as this target cannot pay: here it must draft whatever the costs, and gets 2 more
    # tokens to do so (the policy's own decisions are tested in test_policy.py).
    length = dict(policy=AdaptiveDraftLength(min_probe_gain=0.0)) if auto else dict(num_draft_tokens=2)
    if method == "draft_model":
        spec = dict(method="draft_model", draft=draft, **length)
    else:
        # One occurrence (the most recent), not a vote: the voted continuation of this tiny
        # vocabulary's prompt lies outside top-k/top-p, and the test needs both acceptances and
        # rejections to exercise the acceptance rule.
        spec = dict(method="ngram", **length, options=dict(min_ngram=1, max_matches=1))
    exact = exact_distribution(target, SETTINGS[setting])
    seed = list(CASES).index(case)
    samples = sample(target, SETTINGS[setting], seed, speculative=spec, new=NEW + 2 if auto else NEW)
    pvalue = chi2_pvalue(continuation_index(samples), exact)
    assert pvalue > ALPHA, f"{case}: p = {pvalue:.2e}"


@pytest.mark.parametrize("setting", ["temp", "topk_topp"])
def test_control_draft_alone_is_rejected(models, setting):
    """Samples from the draft model alone (same settings) must fail the same test."""
    target, draft = models
    exact = exact_distribution(target, SETTINGS[setting])
    # Sanity: the draft's own samples do pass against the draft's exact distribution.
    samples = continuation_index(sample(draft, SETTINGS[setting], seed=5))
    assert chi2_pvalue(samples, exact_distribution(draft, SETTINGS[setting])) > ALPHA
    assert chi2_pvalue(samples, exact) < ALPHA


def test_control_unprocessed_target_is_rejected(models):
    """Plain samples from the target without top-k/top-p must fail against the truncated distribution."""
    target, _ = models
    samples = continuation_index(sample(target, SETTINGS["temp"], seed=6))
    assert chi2_pvalue(samples, exact_distribution(target, SETTINGS["temp"])) > ALPHA
    assert chi2_pvalue(samples, exact_distribution(target, SETTINGS["topk_topp"])) < ALPHA


def test_control_loop_with_a_wrong_verifier_is_rejected(models, monkeypatch):
    """End-to-end power: the loop with a subtly wrong verifier (after a rejection it redraws from p
    instead of from the residual max(0, p - q)) fails the same test."""
    import hf_specdec.core.verify

    real = hf_specdec.core.verify.rejection_sample

    def residual_is_p(draft_tokens, draft_lengths, draft_probs, target_probs):
        accepted, tokens = real(draft_tokens, draft_lengths, draft_probs, target_probs)
        rows = torch.nonzero(accepted < draft_lengths)[:, 0]
        if rows.numel():
            at = accepted[rows]
            tokens[rows, at] = torch.multinomial(target_probs[rows, at], 1)[:, 0]
        return accepted, tokens

    target, draft = models
    exact = exact_distribution(target, SETTINGS["temp"])
    monkeypatch.setattr(hf_specdec.core.verify, "rejection_sample", residual_is_p)
    spec = dict(method="draft_model", draft=draft, num_draft_tokens=2)
    samples = continuation_index(sample(target, SETTINGS["temp"], seed=8, speculative=spec))
    assert chi2_pvalue(samples, exact) < ALPHA


def test_padded_batch_of_two_prompts(models):
    """Rows of different prompt lengths in one left-padded batch are each sampled exactly."""
    target, draft = models
    short = [6, 2, 6, 2, 6]
    half = ROWS // 2
    width = len(PROMPT)
    input_ids = torch.zeros(ROWS, width, dtype=torch.long)
    attention_mask = torch.zeros(ROWS, width, dtype=torch.long)
    input_ids[:half], attention_mask[:half] = torch.tensor(PROMPT), 1
    input_ids[half:, width - len(short) :], attention_mask[half:, width - len(short) :] = (
        torch.tensor(short),
        1,
    )
    settings = SETTINGS["topk_topp"]
    torch.manual_seed(11)
    out = target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW,
        do_sample=True,
        speculative=dict(method="draft_model", draft=draft, num_draft_tokens=2),
        return_dict_in_generate=True,
        **settings,
    )
    samples = continuation_index(out.sequences, width)
    assert chi2_pvalue(samples[:half], exact_distribution(target, settings, PROMPT)) > ALPHA
    assert chi2_pvalue(samples[half:], exact_distribution(target, settings, short)) > ALPHA
    # Control: the two halves are told apart (the test sees which prompt a row had).
    assert chi2_pvalue(samples[half:], exact_distribution(target, settings, PROMPT)) < ALPHA
