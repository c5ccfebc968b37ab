"""Speculation over transformers' static cache (`cache_implementation="static"`, or a `StaticCache`
passed in): greedy output identical to plain static-cache `generate`, batch 1 and left-padded batches,
for the n-gram and the draft-model drafters; sampling exact; scores and logits as plain static
`generate` returns them; the forwards compiled where transformers would compile them, one graph per
padded width, and a width's compile never taken for a verify cost."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import CompileConfig, MistralConfig, MistralForCausalLM, StaticCache

from hf_specdec import SpeculativeConfig
from hf_specdec.core.policy import AdaptiveDraftLength, FixedDraftLength
from hf_specdec.core.static_kv import COMPILED_WIDTHS, StaticKV

from ..conftest import random_batch, tiny_llama
from .test_output_contract import assert_close_steps
from .test_sampling import ALPHA, SETTINGS, chi2_pvalue, continuation_index, exact_distribution, sample

MAX_NEW = 20


def speculative(method: str, draft, **fields) -> SpeculativeConfig:
    if method == "ngram":  # one-token matches: random prompts rarely repeat longer n-grams
        return SpeculativeConfig(method="ngram", options=dict(min_ngram=1), **fields)
    return SpeculativeConfig(method="draft_model", draft=draft, **fields)


def static_generate(model, input_ids, attention_mask, speculative=None, max_new_tokens=MAX_NEW, **kwargs):
    with torch.no_grad():
        return model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            cache_implementation="static",
            speculative=speculative,
            **kwargs,
        )


CASES = {  # (method, the draft-length fields, made per test: a policy object learns across calls)
    "ngram": ("ngram", lambda: dict(num_draft_tokens=4)),
    "draft_model": ("draft_model", lambda: dict(num_draft_tokens=4)),
    "draft_model-auto_length": ("draft_model", lambda: dict(policy=AdaptiveDraftLength(min_probe_gain=0.0))),
}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_plain_static_generate(target, good_draft, case, rows):
    """`target` stops at EOS, so in a batch some rows finish early and stay in the static batch."""
    method, fields = CASES[case]
    input_ids, attention_mask = random_batch(7, rows)
    plain = static_generate(target, input_ids, attention_mask)
    spec = speculative(method, good_draft, **fields())
    out = static_generate(target, input_ids, attention_mask, spec, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain.tolist()
    assert isinstance(out.get("cache", out.get("past_key_values")), StaticCache)  # renamed in 5.2x
    stats = out.speculative_stats
    assert stats.drafted > 0  # the drafter really took part
    if case == "draft_model":  # n-grams of random prompts are rarely right; the adaptive policy may stop
        assert stats.accepted > 0


@pytest.mark.parametrize("rows", [1, 3])
def test_an_eagle_head_drafts_chains_over_a_static_cache(rows):
    """A drafter reading the target's hidden states (through padded forwards when compiled);
    `tree="auto"` drafts chains on a static cache, which takes no tree yet."""
    from ..drafters.test_heads import copied_layer_eagle

    model = tiny_llama(30, layers=1)
    head = copied_layer_eagle(model, torch.arange(4, 64))  # drafts never use tokens 0-3
    input_ids, attention_mask = random_batch(rows * 7 + 1, rows)
    plain = static_generate(model, input_ids, attention_mask)
    spec = SpeculativeConfig(method="eagle", draft=head, num_draft_tokens=4, tree="auto")
    out = static_generate(model, input_ids, attention_mask, spec, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain.tolist()
    stats = out.speculative_stats
    assert 0 < stats.accepted < stats.drafted and stats.tree_steps == 0


def test_a_passed_static_cache_of_the_least_room(good_draft, monkeypatch):
    """A StaticCache sized as plain static decoding sizes it (prompt + max_new_tokens - 1): a ragged
    batch's holes are compacted away, and drafts near the end shortened to what fits."""
    compactions = []
    compact = StaticKV.compact
    monkeypatch.setattr(StaticKV, "compact", lambda kv: compactions.append(1) or compact(kv))
    model = tiny_llama(0, eos_token_id=None)
    input_ids, attention_mask = random_batch(4, 3)
    plain = static_generate(model, input_ids, attention_mask)
    cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + MAX_NEW - 1)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            cache=cache,
            speculative=speculative("draft_model", good_draft, num_draft_tokens=6),
        )
    assert out.tolist() == plain.tolist()
    assert compactions  # the holes did use the cache up


def test_scores_and_logits_equal_plain_static_generate(target, weak_draft):
    """A weak draft, so most steps roll back: scores and logits per token as plain static generate's."""
    input_ids, attention_mask = random_batch(2, 2)
    returned = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = static_generate(target, input_ids, attention_mask, **returned)
    draft = speculative("draft_model", weak_draft, num_draft_tokens=3)
    spec = static_generate(target, input_ids, attention_mask, draft, **returned)
    assert torch.equal(spec.sequences, plain.sequences)
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampling_over_a_static_cache_is_exact(method):
    """The exact distribution of 3-token continuations of a vocab-8 target (`test_sampling`'s)."""
    target = tiny_llama(20, vocab_size=8, eos_token_id=None)
    if method == "draft_model":
        draft = tiny_llama(21, vocab_size=8, eos_token_id=None)
        setting, spec = "temp", SpeculativeConfig(method=method, draft=draft, num_draft_tokens=2)
    else:  # the most recent match only, as in test_sampling
        options = dict(min_ngram=1, max_matches=1)
        setting, spec = "topk_topp", SpeculativeConfig(method=method, num_draft_tokens=2, options=options)
    exact = exact_distribution(target, SETTINGS[setting])
    static = {**SETTINGS[setting], "cache_implementation": "static"}
    samples = sample(target, static, seed=30, speculative=spec)
    assert chi2_pvalue(continuation_index(samples), exact) > ALPHA


def test_sliding_window_static_layers_are_refused():
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    input_ids, attention_mask = random_batch(0, 1)
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer.*drop cache_implementation='static'"):
        static_generate(model, input_ids, attention_mask, "ngram", max_new_tokens=4)


class _Recorder(AdaptiveDraftLength):
    """The adaptive policy, recording the verify seconds it is told per verified width."""

    def __init__(self) -> None:
        super().__init__(min_probe_gain=0.0, max_k=3)  # widths 1 to 4: at most 3 graphs to trace
        self.told: list[tuple[int, float | None]] = []
        self.drafted: list[int] = []
        self.draft_seconds: list[float] = []

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        self.draft_seconds.append(seconds_per_token)
        super().expect_draft_cost(seconds_per_token)

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        self.told.append((1 + max(draft.lengths, default=0), verify_seconds))
        self.drafted.append(max(draft.lengths, default=0))
        self.draft_seconds.append(draft_seconds)
        super().update(batch_size, draft, accepted, draft_seconds, verify_seconds, paths)


def test_compile_config_compiles_one_graph_per_padded_width(good_draft, fresh_dynamo):
    """`compile_config` (on CPU with `_compile_all_devices`, as transformers asks): the forwards after
    the prompt's are compiled, one graph per padded width, the output still plain static generate's,
    and each width's first (compiling) call is not told to the policy as a verify cost. Dynamo
    traces the graphs and runs them eagerly: inductor would take minutes per width on a small CPU."""
    model = tiny_llama(0, eos_token_id=None)
    graphs: list[int] = []

    def backend(graph, example_inputs):
        graphs.append(1)
        return graph.forward

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # transformers compiles on CPU only when told so
    input_ids, attention_mask = random_batch(4, 2)
    plain = static_generate(model, input_ids, attention_mask)
    policy = _Recorder()
    out = static_generate(
        model,
        input_ids,
        attention_mask,
        # The draft eager: the graphs counted are the target's.
        speculative("draft_model", good_draft, policy=policy, options={"compile_with_target": False}),
        compile_config=config,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == plain.tolist()
    padded = [next(w for w in COMPILED_WIDTHS if w >= width) for width, _ in policy.told]
    assert len(graphs) == len(set(padded)) > 1  # no recompile within a width
    first = {w: padded.index(w) for w in set(padded)}
    assert all((seconds is None) == (i == first[padded[i]]) for i, (_, seconds) in enumerate(policy.told))
    # The policy was told the widths, and timed each forward at the width it was fed at.
    assert policy.costs.shape.widths == COMPILED_WIDTHS
    assert {width for _, width in policy.costs.times} <= set(COMPILED_WIDTHS)


def _draft_caches(monkeypatch) -> list:
    """Every cache a PyTorch draft makes from now on, in order (the list fills as they are made)."""
    from hf_specdec.drafters.decoder import TorchDecoder

    caches = []
    new_cache = TorchDecoder.new_cache

    def recording(self, batch_size):
        caches.append(new_cache(self, batch_size))
        return caches[-1]

    monkeypatch.setattr(TorchDecoder, "new_cache", recording)
    return caches


@pytest.mark.parametrize("rows", [1, 2])
def test_a_draft_model_is_compiled_alike(good_draft, fresh_dynamo, monkeypatch, rows):
    """With the target compiled, a draft model's forwards after its first run compiled too, over a
    static cache of its own of the call's batch size, at the target's padded widths (all compiled
    before drafting starts). Output: plain's."""
    caches = _draft_caches(monkeypatch)
    model = tiny_llama(0, eos_token_id=None)
    config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, fullgraph=True, mode=None)
    config._compile_all_devices = True
    input_ids, attention_mask = random_batch(4, rows)
    plain = static_generate(model, input_ids, attention_mask)
    policy = _Recorder()
    spec = speculative("draft_model", good_draft, policy=policy)
    out = static_generate(model, input_ids, attention_mask, spec, compile_config=config)
    assert out.tolist() == plain.tolist()
    (kv,) = caches  # one cache, compiled at every width up front, probed and drafted on
    assert isinstance(kv, StaticKV) and kv.compiled and kv.fed_widths == set(COMPILED_WIDTHS)
    assert kv.model is good_draft and kv.mask.shape[0] == rows and any(n > 0 for n in policy.drafted)
    # The draft's compiles were made before the first timed step: the probe's figure and every
    # draft's stay far below a compile (each is timed on an already compiled graph).
    assert max(policy.draft_seconds) < 0.5


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_a_compiled_draft_retires_the_rows_that_finish(target, good_draft, fresh_dynamo, monkeypatch, method):
    """A batch whose rows stop at EOS at different steps: the draft's static cache keeps its batch
    (the compiled shape), the finished rows retired and fed holes, the others drafting on; no row
    is copied or dropped, and the output is plain's."""
    from ..drafters.test_heads import copied_layer_eagle

    caches = []
    init = StaticKV.__init__
    monkeypatch.setattr(StaticKV, "__init__", lambda kv, *a, **k: init(kv, *a, **k) or caches.append(kv))
    model = target if method == "draft_model" else tiny_llama(30, layers=1)
    draft = good_draft if method == "draft_model" else copied_layer_eagle(model, torch.arange(4, 64))
    config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, fullgraph=True, mode=None)
    config._compile_all_devices = True
    input_ids, attention_mask = random_batch(7, 4)
    plain = static_generate(model, input_ids, attention_mask, max_new_tokens=40)
    spec = SpeculativeConfig(method=method, draft=draft, num_draft_tokens=3)
    out = static_generate(
        model, input_ids, attention_mask, spec, max_new_tokens=40, compile_config=config,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.sequences.tolist() == plain.tolist()
    (kv,) = [kv for kv in caches if kv.model is draft]
    assert kv.compiled and kv.fed_widths == set(COMPILED_WIDTHS) and kv.mask.shape[0] == 4
    assert 0 < int((~kv.active).sum()) < 4  # rows that finished early were retired, the last one not
    assert out.speculative_stats.accepted > 0


@pytest.mark.parametrize("rows", [1, 2])
def test_an_eagle_head_is_compiled_alike(fresh_dynamo, monkeypatch, rows):
    """With the target compiled, the head's forwards after its first compiled at the target's padded
    widths (each one graph: `fullgraph`), all before drafting starts, over a static cache of its
    own of the call's batch size; it drafts what the eager head drafts (`compile_with_target=False`),
    and the output is plain's."""
    from ..drafters.test_heads import copied_layer_eagle

    caches = []
    init = StaticKV.__init__
    monkeypatch.setattr(StaticKV, "__init__", lambda kv, *a, **k: init(kv, *a, **k) or caches.append(kv))
    model = tiny_llama(30, layers=1)
    head = copied_layer_eagle(model, torch.arange(4, 64))
    config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, fullgraph=True, mode=None)
    config._compile_all_devices = True
    input_ids, attention_mask = random_batch(rows * 7 + 1, rows)
    plain = static_generate(model, input_ids, attention_mask)
    runs = {}
    for compiled in (False, True):
        policy = _FixedRecorder(4)  # a length no timing changes: both runs draft alike
        spec = SpeculativeConfig(
            method="eagle", draft=head, policy=policy, options={"compile_with_target": compiled}
        )
        out = static_generate(
            model, input_ids, attention_mask, spec, compile_config=config, return_dict_in_generate=True
        )
        assert out.sequences.tolist() == plain.tolist()
        runs[compiled] = (out.speculative_stats, policy)
    (eager, _), (stats, policy) = runs[False], runs[True]
    assert (stats.drafted, stats.accepted) == (eager.drafted, eager.accepted) and stats.accepted > 0
    (kv,) = [kv for kv in caches if kv.model is head]
    assert kv.compiled and kv.fed_widths == set(COMPILED_WIDTHS) and kv.mask.shape[0] == rows
    assert max(policy.draft_seconds) < 0.5  # every draft timed on compiled graphs


class _FixedRecorder(FixedDraftLength):
    """A fixed draft length, recording the seconds each draft took."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.draft_seconds: list[float] = []

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        self.draft_seconds.append(draft_seconds)
        super().update(batch_size, draft, accepted, draft_seconds, verify_seconds, paths)


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_calls_of_new_batch_sizes_keep_compiling(good_draft, fresh_dynamo, method):
    """Each batch size is a new shape for the target's five widths and the draft's: dynamo's limit
    of graphs per function (8 by default, a hard failure under `fullgraph=True`) is raised for each
    new shape, so five batch sizes in one process all compile, and every output is plain's."""
    from ..drafters.test_heads import copied_layer_eagle

    model = tiny_llama(30, layers=1) if method == "eagle" else tiny_llama(0, eos_token_id=None)
    draft = copied_layer_eagle(model, torch.arange(4, 64)) if method == "eagle" else good_draft
    config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, fullgraph=True, mode=None)
    config._compile_all_devices = True
    for rows in range(1, 6):
        input_ids, attention_mask = random_batch(7 + rows, rows)
        plain = static_generate(model, input_ids, attention_mask)
        spec = SpeculativeConfig(method=method, draft=draft, num_draft_tokens=3)
        out = static_generate(model, input_ids, attention_mask, spec, compile_config=config)
        assert out.tolist() == plain.tolist()


@pytest.mark.filterwarnings("error:speculative= settings")  # a compiled target reads the option
def test_a_draft_asked_not_to_compile_drafts_eagerly(good_draft, fresh_dynamo, monkeypatch):
    """`options={"compile_with_target": False}`: the draft keeps its dynamic cache beside a compiled
    target."""
    caches = _draft_caches(monkeypatch)
    model = tiny_llama(0, eos_token_id=None)
    config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, mode=None)
    config._compile_all_devices = True
    input_ids, attention_mask = random_batch(4, 1)
    plain = static_generate(model, input_ids, attention_mask)
    spec = SpeculativeConfig(
        method="draft_model", draft=good_draft, num_draft_tokens=3, options={"compile_with_target": False}
    )
    out = static_generate(model, input_ids, attention_mask, spec, compile_config=config)
    assert out.tolist() == plain.tolist()
    assert caches and not any(isinstance(kv, StaticKV) for kv in caches)


def test_a_draft_a_static_cache_cannot_serve_drafts_eagerly(fresh_dynamo):
    """A sliding-window draft (its static layers are ring buffers) beside a compiled target: the
    draft stays on its dynamic cache, and the output is plain's."""
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4,
    )  # fmt: skip
    draft = MistralForCausalLM(config).eval()
    model = tiny_llama(0, eos_token_id=None)
    compile_config = CompileConfig(backend=lambda graph, example_inputs: graph.forward, mode=None)
    compile_config._compile_all_devices = True
    input_ids, attention_mask = random_batch(4, 1)
    plain = static_generate(model, input_ids, attention_mask)
    spec = speculative("draft_model", draft, num_draft_tokens=3)
    out = static_generate(model, input_ids, attention_mask, spec, compile_config=compile_config)
    assert out.tolist() == plain.tolist()


SMOLLM2_CASES = {  # (method, rows)
    "ngram-1": ("ngram", 1),
    "ngram-2": ("ngram", 2),
    "draft_model-2": ("draft_model", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SMOLLM2_CASES))
def test_smollm2_greedy_equals_plain_static_generate(smollm2, case):
    """The real SmolLM2-135M, a prompt that repeats itself (n-grams match), and a left-padded batch;
    the draft model is the target itself, accepted in full."""
    from ..conftest import assert_greedy_match

    model, tokenizer = smollm2
    method, rows = SMOLLM2_CASES[case]
    texts = ["Repeat after me: the cat sat on the mat, the cat sat on the mat,", "Count: one, two, three,"]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts[:rows], return_tensors="pt", padding=True)
    plain = static_generate(model, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=12)
    spec = speculative(method, model, num_draft_tokens=4)
    out = static_generate(
        model,
        inputs["input_ids"],
        inputs["attention_mask"],
        spec,
        max_new_tokens=12,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == plain.shape
    assert_greedy_match(model, plain, out.sequences, attention_mask=inputs["attention_mask"])
    assert out.speculative_stats.accepted > 0


@pytest.mark.compile
@pytest.mark.skipif(
    os.environ.get("HF_SPECDEC_INDUCTOR_TESTS") != "1",
    reason="inductor compiles take minutes per width on a small CPU: set HF_SPECDEC_INDUCTOR_TESTS=1",
)
def test_inductor_compiled_speculation_equals_plain_static_generate(good_draft, fresh_dynamo):
    """transformers' default CompileConfig (inductor), on CPU with `_compile_all_devices`: a one-token
    draft, so the verify forwards are compiled at widths 2 and 1 (near the end) only."""
    model = tiny_llama(0, eos_token_id=None)
    config = CompileConfig()
    config._compile_all_devices = True
    input_ids, attention_mask = random_batch(4, 2)
    plain = static_generate(model, input_ids, attention_mask, max_new_tokens=8)
    spec = speculative("draft_model", good_draft, num_draft_tokens=1)
    out = static_generate(
        model,
        input_ids,
        attention_mask,
        spec,
        max_new_tokens=8,
        compile_config=config,
        return_dict_in_generate=True,
    )
    assert out.sequences.tolist() == plain.tolist()
    assert set(out.speculative_stats.verified_widths) <= {1, 2}
