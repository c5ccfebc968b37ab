"""Sampling is exact (GUIDE §6): enumerate every 3-token continuation of a vocab-8 target, compute its
probability under the processed distribution, and chi-square-test thousands of speculative samples
against it. Controls show that the same test rejects samples from the wrong distribution."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from hf_specdec.bench import regimes
from hf_specdec.core.draft import Draft
from hf_specdec.core.policy import AdaptiveDraftLength, DraftLengthPolicy

from ..conftest import tiny_llama
from ..helpers.block_drafts import random_block_draft
from ..helpers.sampling import (
    ALPHA,
    NEW,
    PROMPT,
    ROWS,
    SETTINGS,
    VOCAB,
    chi2_pvalue,
    continuation_index,
    exact_distribution,
    next_token_probs,
    sample,
)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(20, vocab_size=VOCAB, eos_token_id=None), tiny_llama(
        21, vocab_size=VOCAB, eos_token_id=None
    )


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
    # Block drafts: every position's distribution from one forward (DFlash), or, with DSpark's Markov
    # head, each position's conditioned on the token sampled before it.
    "dflash-temp": ("dflash", "temp"),
    "dflash-rep_penalty": ("dflash", "rep_penalty"),
    "dspark-topk_topp": ("dspark", "topk_topp"),
}


@pytest.fixture(scope="module")
def block_drafts(models):
    target, _ = models
    markov = dict(markov_rank=4, drafts_from_anchor=True, confidence_head=True, confidence_with_markov=True)
    dspark = random_block_draft(target, (0, 1), block_size=2, **markov)
    with torch.no_grad():  # a Markov term that moves the draft's distributions a lot
        dspark.markov_head.markov_w2.weight.mul_(6)
    return {"dflash": random_block_draft(target, (0, 1), block_size=3), "dspark": dspark}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_samples_follow_target_distribution(models, block_drafts, case):
    target, draft = models
    method, setting = CASES[case]
    auto = case.endswith("auto_length")
    # The adaptive policy decodes the first step plainly to measure it, and may judge that a draft
    # as large as this target cannot pay: here it must draft whatever the costs, and gets 2 more
    # tokens to do so (the policy's own decisions are tested in tests/core/policy/). Every case
    # generates 2 tokens past those compared: else the room left cuts a fixed-length draft to one
    # token, and a draw after an accepted draft token is never among the compared ones.
    length = dict(policy=AdaptiveDraftLength(min_probe_gain=0.0)) if auto else dict(num_draft_tokens=2)
    if method == "draft_model":
        spec = dict(method="draft_model", draft=draft, **length)
    elif method in block_drafts:
        spec = dict(method=method, draft=block_drafts[method], **length)
    else:
        # One occurrence (the most recent), not a vote: the voted continuation of this tiny
        # vocabulary's prompt lies outside top-k/top-p, and the test needs both acceptances and
        # rejections to exercise the acceptance rule.
        spec = dict(method="ngram", **length, options=dict(min_ngram=1, max_matches=1))
    exact = exact_distribution(target, SETTINGS[setting])
    seed = list(CASES).index(case)
    samples = sample(target, SETTINGS[setting], seed, speculative=spec, new=NEW + 2)
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


def test_control_block_draft_reporting_another_distribution_is_rejected(models, block_drafts, monkeypatch):
    """Power for block drafts: a drafter that hands the verifier another distribution than the one its
    tokens were drawn from (DSpark's positions without their Markov term, processed alike) fails the
    test; the same draft, reporting what it sampled from, passes above."""
    from hf_specdec.drafters.dflash import DFlashDrafter

    real = DFlashDrafter._chain

    def misreported(self, request, max_tokens, anchor, hidden, logits):
        draft = real(self, request, max_tokens, anchor, hidden, logits)
        width = draft.tokens.shape[1]
        if width == 0:
            return draft
        base = [self.full_vocab(logits[:, i]).float() for i in range(width)]
        draft.probs = torch.stack([request.processor([], request.row_ids, x).softmax(-1) for x in base], 1)
        return draft

    target, _ = models
    spec = dict(method="dspark", draft=block_drafts["dspark"], num_draft_tokens=2)
    exact = exact_distribution(target, SETTINGS["temp"])
    monkeypatch.setattr(DFlashDrafter, "_chain", misreported)
    samples = continuation_index(sample(target, SETTINGS["temp"], seed=9, speculative=spec))
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


FRESH_PROMPT = [3, 1, 4, 6, 5, 2, 7]


@pytest.mark.parametrize("setting", ["topk_topp"])
def test_suffix_samples_from_a_filled_corpus_follow_target_distribution(models, setting):
    """Drafts from a corpus that earlier sampled calls filled (32 answers to the same prompt)."""
    from hf_specdec.drafters import suffix

    target, _ = models
    settings = SETTINGS[setting]
    suffix.clear_corpora()
    prompt = torch.tensor([FRESH_PROMPT])
    torch.manual_seed(41)
    for _ in range(2):
        target.generate(input_ids=prompt.repeat(16, 1), max_new_tokens=NEW + 2, do_sample=True, **settings,
                        speculative="suffix")  # fmt: skip
    input_ids = prompt.repeat(ROWS, 1)
    spec = dict(method="suffix", num_draft_tokens=2, options={"min_gain": 0.0})
    out = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW,
        do_sample=True,
        speculative=spec,
        return_dict_in_generate=True,
        **settings,
    )
    suffix.clear_corpora()
    stats = out.speculative_stats
    # The corpus drafted for every row (its first step at least), and drafts both held and failed.
    assert stats.drafter_counters["corpus_drafting"] == 1
    assert stats.drafter_counters["corpus_drafts"] >= ROWS and 0 < stats.accepted < stats.drafted
    samples = continuation_index(out.sequences, len(FRESH_PROMPT))
    assert chi2_pvalue(samples, exact_distribution(target, settings, FRESH_PROMPT)) > ALPHA


class _RandomLengths(DraftLengthPolicy):
    """Draft lengths drawn from a seeded generator, no clock: each step asks 0-8 tokens (0: a plain
    step), cuts half of the rows' drafts to a length of their own, and feeds three chain drafts (plain
    steps too) in ten one to three columns wider, holes past them: the adaptive policy's shapes, and more."""

    def __init__(self, seed: int) -> None:
        self.rng, self.shapes = random.Random(seed), collections.Counter()

    def draft_length(self, batch_size: int) -> int:
        k = self.rng.randint(0, 8)
        self.shapes["plain steps"] += k == 0
        return k

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        lengths = [self.rng.randint(0, n) if self.rng.random() < 0.5 else n for n in draft.lengths]
        self.shapes["cuts"] += lengths != draft.lengths
        draft = draft.truncated(lengths)
        if draft.parents is None and self.rng.random() < 0.3:  # a plain step's too
            self.shapes["holes"] += 1
            self.shapes["plain steps with holes"] += not any(lengths)
            return draft.widened(draft.tokens.shape[1] + self.rng.randint(1, 3))
        return draft


def _seeded_inputs(batch: int) -> tuple[torch.Tensor, dict]:
    """The prompt in `batch` rows, left-padded by 0, 2 and 1, and plain sampling's settings."""
    input_ids = torch.tensor([PROMPT, [0, 0, *PROMPT[2:]], [0, *PROMPT[1:]]][:batch])
    mask = (torch.arange(len(PROMPT)) >= torch.tensor([0, 2, 1][:batch])[:, None]).long()
    kwargs = dict(
        attention_mask=mask, max_new_tokens=24, do_sample=True, pad_token_id=0, **SETTINGS["topk_topp"]
    )
    return input_ids, kwargs


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_seeded_call_samples_what_plain_samples(models, tree, batch):
    """Drafts chosen without draws (n-gram chains and tries) are verified with plain sampling's own
    draw at each position: the same seed gives plain's tokens, and leaves the generator where plain
    leaves it, whatever the draft lengths (left padding too: each row's positions are its own).
    The lengths are drawn at random, not chosen from clock timings, so the drafts that held are
    the same on every run (the adaptive policy on a busy machine once verified too few here)."""
    target, _ = models
    input_ids, kwargs = _seeded_inputs(batch)
    accepted, shapes = 0, collections.Counter()
    for seed in range(4):
        torch.manual_seed(seed)
        plain, plain_after = target.generate(input_ids, **kwargs), torch.rand(3)
        policy = _RandomLengths(seed)
        spec = dict(method="ngram", tree=tree, policy=policy, options=dict(min_ngram=1))
        torch.manual_seed(seed)
        out = target.generate(input_ids, **kwargs, speculative=spec, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain) and torch.equal(torch.rand(3), plain_after)
        accepted += out.speculative_stats.accepted
        shapes += policy.shapes
    assert accepted > 10  # drafts held, so positions were verified several a forward
    assert shapes["plain steps"] and shapes["cuts"] and (tree or shapes["plain steps with holes"])


def test_a_seeded_call_samples_what_plain_samples_under_the_adaptive_policy(models, monkeypatch):
    """The same with the adaptive policy, each call starting from the last one's costs (as
    `DEVICE_COSTS` carries them), on a clock that a flat cost profile alone moves: its decisions,
    hence the drafts that held, are the same on every run, as the machine's own clock's are not."""
    monkeypatch.setattr(regimes, "host_clock", lambda: 0.0)  # the clock: the profile's costs alone
    target, _ = models
    input_ids, kwargs = _seeded_inputs(3)
    accepted, costs = 0, None
    for seed in range(4):
        torch.manual_seed(seed)
        plain, plain_after = target.generate(input_ids, **kwargs), torch.rand(3)
        policy = AdaptiveDraftLength(device_costs=costs)
        spec = dict(method="ngram", tree=True, policy=policy, options=dict(min_ngram=1))
        torch.manual_seed(seed)
        with regimes.emulate(target, regimes.PROFILES["flat"]):
            out = target.generate(input_ids, **kwargs, speculative=spec, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain) and torch.equal(torch.rand(3), plain_after)
        accepted, costs = accepted + out.speculative_stats.accepted, policy.costs
    assert accepted > 10
