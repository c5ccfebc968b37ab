"""Greedy speculative decoding is token-identical to plain `generate` (GUIDE §6), for every drafter,
draft length, batch shape, EOS position, length limit and stop criterion."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from hf_specdec import SpeculativeConfig

from ..conftest import random_batch, tiny_llama

NEAR_TIE = 1e-4
DRAFT_LENGTHS = [1, 3, 8, "auto"]


# ---------------------------------------------------------------------------------------------
# Models and shared checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_no_eos():
    """`target`'s weights without an EOS token: every row runs to max_new_tokens."""
    return tiny_llama(0, eos_token_id=None)


@pytest.fixture(scope="module")
def drafts(target, weak_draft, good_draft):
    return {"weak": weak_draft, "good": good_draft, "self": target}


def spec_for(method: str, drafts: dict, k) -> dict:
    if method == "ngram":
        return dict(method="ngram", num_draft_tokens=k, options=dict(min_ngram=1))
    return dict(method="draft_model", draft=drafts[method], num_draft_tokens=k)


_PLAIN: dict = {}


def plain_generate(model, input_ids, attention_mask, **kwargs):
    """Plain greedy `generate`, memoised per model and arguments (it is the reference, not the test)."""
    key = (id(model), input_ids.numpy().tobytes(), tuple(input_ids.shape), tuple(sorted(kwargs.items())))
    if key not in _PLAIN:
        _PLAIN[key] = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **kwargs
        )
    return _PLAIN[key]


def generated_counts(sequences: torch.Tensor, prompt_len: int, eos: int | None) -> list[int]:
    """Tokens each row generated: up to and including its first EOS, else all."""
    counts = []
    for row in sequences[:, prompt_len:].tolist():
        counts.append(row.index(eos) + 1 if eos is not None and eos in row else len(row))
    return counts


def check_stats(stats, sequences: torch.Tensor, prompt_len: int, eos: int | None) -> None:
    assert stats.steps == stats.speculative_steps + stats.plain_steps
    assert 0 <= stats.accepted <= stats.drafted
    assert stats.emitted == sum(generated_counts(sequences, prompt_len, eos))
    # The prompt's forward gives each row one token; every step after it at least one and at most
    # its accepted drafts plus one.
    rows = sequences.shape[0]
    assert stats.emitted <= rows + stats.steps + stats.accepted
    assert stats.target_forwards - 1 <= stats.steps


def assert_same_as_plain(
    model, spec: torch.Tensor, plain: torch.Tensor, attention_mask: torch.Tensor
) -> None:
    """Exact equality, except at a float near-tie of the target's top two logits (GUIDE §6)."""
    if torch.equal(spec, plain):
        return
    assert spec.shape[0] == plain.shape[0], (spec.shape, plain.shape)
    width = min(spec.shape[1], plain.shape[1])
    diff = (spec[:, :width] != plain[:, :width]).nonzero()
    assert diff.numel(), f"same prefix, different lengths: {spec.shape} vs {plain.shape}"
    row, col = (int(x) for x in diff[0])
    if attention_mask is None:  # no padding
        real = plain[row, :col]
    else:
        prompt_len = attention_mask.shape[1]
        real = torch.cat([plain[row, :prompt_len][attention_mask[row].bool()], plain[row, prompt_len:col]])
    with torch.no_grad():
        logits = model(real[None]).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, (
        f"row {row} differs at position {col} (spec {int(spec[row, col])}, plain {int(plain[row, col])}) "
        f"and the target's top-2 logit gap there is {gap:.3g}, not a near-tie"
    )


def run_both(model, spec_kwargs, input_ids, attention_mask, max_new_tokens=None, **extra):
    if max_new_tokens is not None:
        extra["max_new_tokens"] = max_new_tokens
    plain = plain_generate(model, input_ids, attention_mask, **extra)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        speculative=spec_kwargs,
        return_dict_in_generate=True,
        **extra,
    )
    assert_same_as_plain(model, out.sequences, plain, attention_mask)
    check_stats(
        out.speculative_stats, out.sequences, input_ids.shape[1], model.generation_config.eos_token_id
    )
    return out, plain


# ---------------------------------------------------------------------------------------------
# The main table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,seed", [(1, 0), (3, 1), (3, 2)], ids=["b1-s0", "b3-s1", "b3-s2"])
@pytest.mark.parametrize("k", DRAFT_LENGTHS, ids=[f"k{k}" for k in DRAFT_LENGTHS])
@pytest.mark.parametrize("method", ["ngram", "weak", "good", "self"])
def test_greedy_identity(target, drafts, method, k, batch, seed):
    input_ids, attention_mask = random_batch(seed, batch)
    out, _ = run_both(target, spec_for(method, drafts, k), input_ids, attention_mask, max_new_tokens=12)
    stats = out.speculative_stats
    if method == "self" and k != "auto":
        assert stats.speculative_steps > 0 and stats.accepted == stats.drafted


@pytest.mark.parametrize("max_new_tokens", range(1, 6))
@pytest.mark.parametrize("method", ["ngram", "good", "self"])
def test_greedy_every_length_boundary(target_no_eos, drafts, method, max_new_tokens):
    """k = 3: max_new_tokens from 1 (no room to draft) to k + 2 (one full step and one more)."""
    input_ids, attention_mask = random_batch(3, 3)
    out, _ = run_both(target_no_eos, spec_for(method, drafts, 3), input_ids, attention_mask, max_new_tokens)
    assert out.sequences.shape[1] == input_ids.shape[1] + max_new_tokens


@pytest.mark.parametrize("form", ["string", "dict", "config"])
def test_speculative_argument_forms(target, form):
    input_ids, attention_mask = random_batch(4, 2)
    spec = {
        "string": "ngram",
        "dict": dict(method="ngram"),
        "config": SpeculativeConfig(method="ngram", num_draft_tokens=2),
    }[form]
    run_both(target, spec, input_ids, attention_mask, max_new_tokens=10)


def test_one_row_of_identical_prompts_batch(target, drafts):
    """Identical rows in a batch stay identical (no cross-row leakage in the ragged caches)."""
    input_ids, attention_mask = random_batch(5, 1)
    ids, mask = input_ids.repeat(3, 1), attention_mask.repeat(3, 1)
    out, _ = run_both(target, spec_for("good", drafts, 3), ids, mask, max_new_tokens=12)
    assert torch.equal(out.sequences[0], out.sequences[1]) and torch.equal(out.sequences[1], out.sequences[2])


# ---------------------------------------------------------------------------------------------
# EOS inside a draft, rows finishing at different steps
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_setup(target_no_eos):
    """A target whose EOS is a token it really generates mid-output, at different steps per row."""
    input_ids, attention_mask = random_batch(7, 4)
    generated = target_no_eos.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False
    )[:, input_ids.shape[1] :].tolist()
    best, best_spread = None, -1
    for token in sorted({t for row in generated for t in row}):
        first = [row.index(token) if token in row else 20 for row in generated]
        mid = [f for f in first if 2 <= f < 18]
        spread = len(set(first)) if len(mid) >= 2 else -1
        if token not in (0,) and spread > best_spread:
            best, best_spread = token, spread
    assert best is not None
    model = tiny_llama(0, eos_token_id=best)
    return model, best, input_ids, attention_mask


@pytest.mark.parametrize("k", [2, 8, "auto"], ids=["k2", "k8", "kauto"])
@pytest.mark.parametrize("method", ["ngram", "good", "self"])
def test_greedy_eos_inside_draft(eos_setup, drafts, target_no_eos, method, k):
    model, eos, input_ids, attention_mask = eos_setup
    # The "self" draft has the target's weights, so its drafts run straight through EOS.
    spec = spec_for(method, {**drafts, "self": target_no_eos}, k)
    out, plain = run_both(model, spec, input_ids, attention_mask, max_new_tokens=20)
    counts = generated_counts(plain, input_ids.shape[1], eos)
    assert len(set(counts)) >= 2 and min(counts) < 20, counts  # rows finish at different steps
    pad = model.generation_config.pad_token_id
    for row, n in enumerate(counts):
        assert bool((out.sequences[row, input_ids.shape[1] + n :] == pad).all())


# ---------------------------------------------------------------------------------------------
# Stop strings (real tokenizer) and num_return_sequences
# ---------------------------------------------------------------------------------------------


def test_greedy_stop_strings_real_tokenizer(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    enc = tokenizer(["The capital of France is", "1, 2, 3, 4,"], return_tensors="pt", padding=True)
    free = model.generate(**enc, max_new_tokens=10, do_sample=False)
    text = tokenizer.decode(free[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 3, text
    stop = words[len(words) // 2]  # a word in the middle of row 0's continuation
    kwargs = dict(max_new_tokens=10, stop_strings=[stop], tokenizer=tokenizer)
    plain = model.generate(**enc, do_sample=False, **kwargs)
    assert plain.shape[1] < free.shape[1] or not torch.equal(plain, free)  # the stop string bites
    spec = dict(method="ngram", num_draft_tokens=3, options=dict(min_ngram=1))
    out = model.generate(**enc, do_sample=False, speculative=spec, return_dict_in_generate=True, **kwargs)
    assert_same_as_plain(model, out.sequences, plain, enc.attention_mask)


@pytest.mark.parametrize("method", ["ngram", "good"])
def test_num_return_sequences_with_sampling(target_no_eos, drafts, method):
    input_ids, attention_mask = random_batch(6, 2)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=6,
        do_sample=True,
        num_return_sequences=3,
    )
    torch.manual_seed(0)
    plain = target_no_eos.generate(**kwargs)
    out = target_no_eos.generate(
        **kwargs, speculative=spec_for(method, drafts, 2), return_dict_in_generate=True
    )
    assert out.sequences.shape == plain.shape == (6, input_ids.shape[1] + 6)
    prompt = input_ids.repeat_interleave(3, dim=0)
    assert torch.equal(out.sequences[:, : input_ids.shape[1]], prompt)
    check_stats(out.speculative_stats, out.sequences, input_ids.shape[1], None)


# ---------------------------------------------------------------------------------------------
# The "auto" draft-length policy
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_target_and_shallow_copy():
    """An 8-layer target whose last 6 layers add exactly zero (their output projections are zero),
    and the same model without them: a draft that always agrees and costs a fraction of a step."""
    deep = tiny_llama(0, layers=8, eos_token_id=None)
    with torch.no_grad():
        for layer in deep.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    shallow = copy.deepcopy(deep)
    shallow.model.layers = shallow.model.layers[:2]
    shallow.config.num_hidden_layers = 2
    return deep, shallow


def test_auto_with_an_always_agreeing_cheaper_draft_speculates(deep_target_and_shallow_copy):
    target, draft = deep_target_and_shallow_copy
    input_ids, attention_mask = random_batch(8, 1)
    spec = dict(method="draft_model", draft=draft, num_draft_tokens="auto")
    out, _ = run_both(target, spec, input_ids, attention_mask, max_new_tokens=40)
    stats = out.speculative_stats
    assert stats.speculative_steps > 0
    assert stats.accepted == stats.drafted > 0


@pytest.fixture(scope="module")
def contrary_draft(target_no_eos):
    """The target with its output rows rolled by one: its argmax is always the target's + 1."""
    draft = tiny_llama(0, eos_token_id=None)
    with torch.no_grad():
        draft.lm_head.weight.copy_(torch.roll(target_no_eos.lm_head.weight, 1, dims=0))
    return draft


def test_auto_with_contrary_draft_mostly_decodes_plainly(target_no_eos, contrary_draft):
    input_ids, attention_mask = random_batch(9, 1)
    spec = dict(method="draft_model", draft=contrary_draft, num_draft_tokens="auto")
    out, _ = run_both(target_no_eos, spec, input_ids, attention_mask, max_new_tokens=60)
    stats = out.speculative_stats
    assert stats.accepted == 0
    assert stats.plain_steps > stats.speculative_steps, stats.to_dict()


# ---------------------------------------------------------------------------------------------
# No state leaks across calls
# ---------------------------------------------------------------------------------------------


def _counts(stats) -> dict:
    d = stats.to_dict()
    return {k: v for k, v in d.items() if not k.endswith("_seconds")}


@pytest.mark.parametrize("method", ["ngram", "good"])
def test_repeated_calls_give_identical_results_and_stats(target, drafts, method):
    input_ids, attention_mask = random_batch(10, 3)
    spec = SpeculativeConfig(**spec_for(method, drafts, 3))
    before_options = copy.deepcopy(spec.options)
    before = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    runs = [
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=12,
            do_sample=False,
            speculative=spec,
            return_dict_in_generate=True,
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert _counts(runs[0].speculative_stats) == _counts(runs[1].speculative_stats)
    for name, value in before.items():
        assert getattr(spec, name) is value, name
    assert spec.options == before_options


def test_user_config_is_not_modified(target, good_draft):
    input_ids, attention_mask = random_batch(11, 2)
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens="auto", options={"min_ngram": 1})
    auto = SpeculativeConfig(method="auto", draft=good_draft, num_draft_tokens=2)
    snapshot = dataclasses.asdict(ngram)
    for spec in (ngram, auto):
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=8,
            do_sample=False,
            speculative=spec,
        )
    assert dataclasses.asdict(ngram) == snapshot
    assert auto.method == "auto" and auto.draft is good_draft and auto.options == {}


# ---------------------------------------------------------------------------------------------
# Logits processors, EOS lists, length forms, output_scores / output_logits
# ---------------------------------------------------------------------------------------------

PROCESSOR_CASES = {
    # Fails today: generate builds RepetitionPenaltyLogitsProcessor with a per-row
    # `prompt_ignore_length` tensor for padded batches, and hf_specdec calls it one row at a time.
    "repetition_penalty_padded_batch": dict(repetition_penalty=1.3),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=10),
    # every length-based processor (min_new_tokens sets min_length too), batched with the penalty
    "length_rules_with_penalty": dict(
        min_new_tokens=4, exponential_decay_length_penalty=(6, 1.8), repetition_penalty=1.3
    ),
    "eos_list": dict(eos_token_id=[5, 38, 21]),
    "bad_words": dict(bad_words_ids=[[21], [38]]),
    "suppress": dict(suppress_tokens=[21, 38], begin_suppress_tokens=[53]),
    "sequence_bias": dict(sequence_bias={(21,): -10.0, (53, 60): 5.0}),
}


@pytest.mark.parametrize("method", ["ngram", "good"])
@pytest.mark.parametrize("case", list(PROCESSOR_CASES))
def test_greedy_with_logits_processors(target, drafts, case, method):
    input_ids, attention_mask = random_batch(3, 3)
    extra = PROCESSOR_CASES[case]
    plain = target.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=15, do_sample=False, **extra
    )
    out = target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=15,
        do_sample=False,
        speculative=spec_for(method, drafts, 3),
        **extra,
    )
    assert_same_as_plain(target, out, plain, attention_mask)


@pytest.mark.parametrize("form", ["max_length", "prompt_of_one_token", "no_attention_mask"])
def test_greedy_length_and_input_forms(target_no_eos, drafts, form):
    input_ids, attention_mask = random_batch(12, 2)
    kwargs = dict(max_new_tokens=9)
    if form == "max_length":
        kwargs = dict(max_length=input_ids.shape[1] + 7)
    elif form == "prompt_of_one_token":
        input_ids, attention_mask = torch.tensor([[17]]), torch.tensor([[1]])
    else:
        input_ids, attention_mask = input_ids[:1, -3:], None
    for method in ("ngram", "good"):
        run_both(target_no_eos, spec_for(method, drafts, 3), input_ids, attention_mask, **kwargs)


def test_output_scores_and_logits_match_plain(target_no_eos, drafts):
    input_ids, attention_mask = random_batch(13, 3)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    plain = target_no_eos.generate(**kwargs)
    for method in ("ngram", "good"):
        out = target_no_eos.generate(**kwargs, speculative=spec_for(method, drafts, 3))
        assert_scores_like_plain(out, plain)
        assert len(out.scores) == 8


def assert_scores_like_plain(out, plain) -> None:
    """The same sequences, and per generated token the same processed scores and raw logits."""
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == len(out.logits) == len(plain.logits)
    for mine, theirs in zip(out.scores + out.logits, plain.scores + plain.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


class _UnsureStop(StoppingCriteria):
    """Stops a row once the target's top probability for its latest token falls below `threshold`;
    reads `scores` as transformers passes them: a tuple of each step's processed scores [B, V]."""

    def __init__(self, threshold: float, prompt_len: int) -> None:
        self.threshold, self.prompt_len = threshold, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        assert len(scores) == input_ids.shape[1] - self.prompt_len  # one entry per generated token
        assert all(s.shape == (input_ids.shape[0], 64) for s in scores)
        return scores[-1].softmax(-1).max(-1).values < self.threshold


@pytest.mark.parametrize("method", ["ngram", "good"])
def test_stopping_criteria_that_read_scores(target, drafts, method):
    input_ids, attention_mask = random_batch(21, 3)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=16,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    stop = StoppingCriteriaList([_UnsureStop(0.6, input_ids.shape[1])])
    plain = target.generate(**kwargs, stopping_criteria=stop)
    assert plain.sequences.shape[1] < input_ids.shape[1] + 16  # the criterion did stop rows early
    out = target.generate(**kwargs, stopping_criteria=stop, speculative=spec_for(method, drafts, 3))
    assert torch.equal(out.sequences, plain.sequences)


class _BiasPerRow(LogitsProcessor):
    """A user's processor that steers each row of the batch its own way: row b may emit only its own
    band of token ids (a bias tensor of one row per row, as the user built it for the batch)."""

    def __init__(self, batch: int, vocab: int = 64) -> None:
        self.bias = torch.full((batch, vocab), -1e4)
        for b in range(batch):
            self.bias[b, _band(b)] = 0.0

    def __call__(self, input_ids, scores):
        return scores + self.bias


class _BudgetPerRow(StoppingCriteria):
    """A user's criterion that stops row b after `budgets[b]` new tokens."""

    def __init__(self, budgets: list[int], prompt_len: int) -> None:
        self.budgets, self.prompt_len = torch.tensor(budgets), prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.prompt_len >= self.budgets


@pytest.mark.parametrize("method", ["ngram", "good"])
def test_rows_a_criterion_stops_without_an_eos_keep_decoding_as_plain(target_no_eos, drafts, method):
    """Plain `generate` pads a finished row only where an EOS criterion is among its stopping
    criteria; without one, a row a criterion stopped keeps decoding until every row has stopped.
    Speculation returns the same tokens and scores there, not padding and -inf. The criterion, a
    user's, is shown the whole batch (`as_row`; its scores as views: tests/core/test_output.py)."""
    input_ids, attention_mask = random_batch(7, 4, min_len=2, max_len=30)
    budgets = [3, 9, 5, 12]
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    plain = target_no_eos.generate(
        **kwargs, stopping_criteria=StoppingCriteriaList([_BudgetPerRow(budgets, input_ids.shape[1])])
    )
    assert plain.sequences.shape[1] == input_ids.shape[1] + 12  # stopped by the last row's budget
    budget = _BudgetPerRow(budgets, input_ids.shape[1])
    spec = spec_for(method, drafts, 4)
    assert_scores_like_plain(
        target_no_eos.generate(**kwargs, stopping_criteria=StoppingCriteriaList([budget]), speculative=spec),
        plain,
    )


class _LengthStop(StoppingCriteria):
    """A criterion written for older transformers: one answer for the whole batch, a Python bool or
    a tensor of one element (`shape`), which plain `generate` reads for every row (`is_done | answer`)."""

    def __init__(self, length: int, shape: tuple[int, ...] | None) -> None:
        self.length, self.shape = length, shape

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] >= self.length
        return done if self.shape is None else torch.tensor(done).reshape(self.shape)


@pytest.mark.parametrize("shape", [None, (), (1,)], ids=["bool", "0-dim", "one"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_criterion_answering_for_the_whole_batch(target_no_eos, drafts, batch, shape):
    input_ids, attention_mask = random_batch(5, batch)
    stop = StoppingCriteriaList([_LengthStop(input_ids.shape[1] + 6, shape)])
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    plain = target_no_eos.generate(**kwargs, stopping_criteria=stop)
    assert plain.shape[1] == input_ids.shape[1] + 6
    out = target_no_eos.generate(**kwargs, stopping_criteria=stop, speculative=spec_for("ngram", drafts, 3))
    assert torch.equal(out, plain)


class _Collect:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.tokens += value.flatten().tolist()

    def end(self) -> None:
        pass


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_a_streamer_gets_no_token_past_a_stop_without_an_eos(target_no_eos, drafts, method):
    """The stop of the batch's last row ends it inside a step's accepted drafts: nothing past it is
    streamed, as plain streams nothing past it."""
    input_ids, attention_mask = random_batch(7, 1, min_len=2, max_len=30)
    streamed = {}
    for name, extra in (("plain", {}), ("ours", {"speculative": spec_for(method, drafts, 4)})):
        streamed[name] = _Collect()
        target_no_eos.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=16,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([_BudgetPerRow([5], input_ids.shape[1])]),
            streamer=streamed[name],
            **extra,
        )
    assert streamed["ours"].tokens == streamed["plain"].tokens


def _band(row: int) -> list[int]:
    return list(range(6 + 14 * row, 20 + 14 * row))


@pytest.mark.parametrize(
    "option",
    ["bias_per_row", "prefix_allowed_tokens_fn", "encoder_repetition_penalty", "encoder_no_repeat", "budget"],
)
@pytest.mark.parametrize("method", ["ngram", "good"])
def test_processors_and_criteria_that_tell_rows_apart_by_index(target, drafts, option, method):
    """Plain `generate` calls processors and criteria on the whole batch; verifying rows apart, each
    is shown its row in a batch of the user's size, so one that indexes rows treats each its way."""
    input_ids, attention_mask = random_batch(7, 4, min_len=2, max_len=30)
    kwargs = {
        "bias_per_row": dict(logits_processor=LogitsProcessorList([_BiasPerRow(4)])),
        "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda batch_id, ids: _band(batch_id)),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
        "encoder_no_repeat": dict(encoder_no_repeat_ngram_size=2),
        "budget": dict(
            stopping_criteria=StoppingCriteriaList([_BudgetPerRow([3, 9, 5, 14], input_ids.shape[1])])
        ),
    }[option]
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
    plain = target.generate(**common, **kwargs)
    out = target.generate(**common, **kwargs, speculative=spec_for(method, drafts, 4))
    assert_same_as_plain(target, out, plain, attention_mask)
    if option in ("bias_per_row", "prefix_allowed_tokens_fn"):  # each row kept to its own band
        for b, row in enumerate(out[:, input_ids.shape[1] :].tolist()):
            assert set(row) <= set(_band(b))


@pytest.mark.parametrize("method", ["ngram", "good"])
def test_prefix_allowed_tokens_fn_is_asked_about_each_row_by_its_own_batch_id(target, drafts, method):
    """Plain `generate` asks `prefix_allowed_tokens_fn(batch_id, sent)` only with row batch_id's own
    sequence: a function that allows nothing after another row's prompt (a trie per row) works."""
    input_ids, attention_mask = random_batch(7, 4, min_len=2, max_len=30)
    width = input_ids.shape[1]

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return _band(batch_id) if torch.equal(sent[:width], input_ids[batch_id]) else []

    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
    plain = target.generate(**common, prefix_allowed_tokens_fn=allowed)
    out = target.generate(**common, prefix_allowed_tokens_fn=allowed, speculative=spec_for(method, drafts, 4))
    assert_same_as_plain(target, out, plain, attention_mask)
