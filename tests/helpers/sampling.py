"""Exactness of sampling, tested the way GUIDE §6 says: enumerate every NEW-token continuation of a
vocabulary-VOCAB target, compute its probability under the processed distribution, and chi-square-test
ROWS speculative samples against it (tests/properties/test_sampling.py shows the test's power)."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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
