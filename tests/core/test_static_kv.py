"""StaticKV: speculative decoding over transformers' StaticCache, rolled back by its write position.

A small greedy loop here drives it (`generate` drives it in test_static_cache.py): drafts are the plain
output with a wrong token at a scheduled place, so steps accept all, none or some of a draft, and
the result must equal plain `generate(cache_implementation="static")`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from transformers import (
    CompileConfig,
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    MllamaConfig,
    MllamaForCausalLM,
    MllamaForConditionalGeneration,
    MllamaTextConfig,
    MllamaVisionConfig,
    StaticCache,
)

from hf_specdec import SpeculativeConfig
from hf_specdec.core import static_kv
from hf_specdec.core.kv import mark_holes
from hf_specdec.core.static_kv import MAX_RECOMPILE_LIMIT, StaticKV, allow_graphs

from ..conftest import random_batch, tiny_llama
from ..helpers.architectures import tiny

MAX_NEW = 24
SCHEDULE = [7, 0, 3, 7, 1, 7, 5, 2]  # drafted tokens before the first wrong one, step by step


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, eos_token_id=None)  # no EOS: every row runs MAX_NEW tokens


def plain_static(model, input_ids, attention_mask) -> torch.Tensor:
    """Plain static-cache greedy decoding: the new tokens [B, MAX_NEW]."""
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        cache_implementation="static",
    )
    return out[:, input_ids.shape[1] :]


def speculate(kv: StaticKV, input_ids, attention_mask, reference: torch.Tensor, k_max: int) -> torch.Tensor:
    """Greedy speculative decoding over `kv`, drafting from `reference` [B, MAX_NEW]; the new tokens."""
    rows = input_ids.shape[0]
    valid = None if bool(attention_mask.all()) else attention_mask.bool()
    positions = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    last = kv.forward(input_ids, valid, logits_to_keep=1, positions=positions).logits[:, -1].argmax(-1)
    emitted = [[t] for t in last.tolist()]
    step = 0
    while remaining := [MAX_NEW - len(e) for e in emitted if len(e) < MAX_NEW]:
        k = kv.widest(min(k_max + 1, *remaining)) - 1  # no row drafts past MAX_NEW
        drafts = torch.zeros(rows, k, dtype=torch.long)
        for b in range(rows):
            n = len(emitted[b])
            drafts[b, : max(0, min(k, MAX_NEW - n))] = reference[b, n : n + k]
            wrong = SCHEDULE[(step + b) % len(SCHEDULE)]
            if wrong < k:
                drafts[b, wrong] = (drafts[b, wrong] + 1) % kv.model.config.vocab_size
        active = torch.tensor([len(e) < MAX_NEW for e in emitted])
        before = kv.lengths.clone()
        tokens = torch.cat([last[:, None], drafts], dim=1)
        fed = None if bool(active.all()) else active[:, None].expand_as(tokens)
        predicted = kv.forward(tokens, fed).logits.argmax(-1)  # [B, k + 1]
        accepted = (drafts == predicted[:, :k]).long().cumprod(dim=1).sum(dim=1) * active
        kv.truncate(before + (1 + accepted) * active)
        last = predicted[torch.arange(rows), accepted]
        for b in range(rows):
            if active[b]:
                emitted[b] = (emitted[b] + drafts[b, : accepted[b]].tolist() + [int(last[b])])[:MAX_NEW]
                if len(emitted[b]) == MAX_NEW:
                    kv.retire(torch.tensor([b]))
        step += 1
    return torch.tensor(emitted)


def sized_as_generate(model, input_ids, **options) -> StaticKV:
    """A StaticKV over the cache `generate` would build: max_cache_len = prompt + max_new_tokens - 1."""
    cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + MAX_NEW - 1)
    return StaticKV(model, cache, input_ids.shape[0], input_ids.device, **options)


@pytest.mark.parametrize("widths", [(), (1, 2, 4, 8)], ids=["unpadded", "padded"])
def test_batch_one_equals_plain_static_generate(model, widths):
    input_ids, attention_mask = random_batch(3, 1)
    with torch.inference_mode():
        plain = plain_static(model, input_ids, attention_mask)
        kv = sized_as_generate(model, input_ids, widths=widths)
        spec = speculate(kv, input_ids, attention_mask, plain, k_max=7)
    assert spec.tolist() == plain.tolist()
    assert kv.compactions == 0  # one row has no holes: rejected columns are given back at once


def test_ragged_batch_equals_plain_static_generate(model):
    input_ids, attention_mask = random_batch(4, 3)  # left-padded prompts of different lengths
    with torch.inference_mode():
        plain = plain_static(model, input_ids, attention_mask)
        kv = sized_as_generate(model, input_ids, widths=(1, 2, 4, 8))
        spec = speculate(kv, input_ids, attention_mask, plain, k_max=7)
    assert spec.tolist() == plain.tolist()
    assert kv.compactions > 0  # holes used up the cache generate sizes, and were reclaimed


@pytest.mark.parametrize("rows", [1, 3])
def test_a_cache_handed_back_continues_as_plain_decodings(model, weak_draft, rows):
    """A left-padded batch's rows keep different numbers of drafts, and may end at different steps:
    the static cache handed back is laid out as plain decoding's (`pad_steps`), so continued, it
    gives plain's tokens. One marked ragged (`mark_holes`: layers that cannot be laid out so) is
    refused until `reset()` empties it for reuse."""
    input_ids, attention_mask = random_batch(4, rows)

    def turns(speculative=None):
        """Two turns over one StaticCache: the first `speculative`, the second continued plainly."""
        cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + 2 * MAX_NEW)
        options = dict(cache=cache, do_sample=False)
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW,
            speculative=speculative,
            **options,
        )
        turn = torch.cat([out, torch.full((rows, 2), 7)], dim=1)
        mask = torch.cat([attention_mask, torch.ones(rows, turn.shape[1] - input_ids.shape[1])], dim=1)
        return cache, lambda: model.generate(turn, attention_mask=mask, max_new_tokens=4, **options)

    cache, continued = turns(SpeculativeConfig(method="draft_model", draft=weak_draft, num_draft_tokens=3))
    assert continued().tolist() == turns()[1]().tolist()
    mark_holes(cache)
    with pytest.raises(ValueError, match=r"cannot be continued\. Pass the whole conversation"):
        continued()
    cache.reset()  # emptied, the cache is reused as a fresh one
    reused = model.generate(
        input_ids, attention_mask=attention_mask, cache=cache, do_sample=False, max_new_tokens=MAX_NEW
    )
    assert reused[:, input_ids.shape[1] :].tolist() == plain_static(model, input_ids, attention_mask).tolist()


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_forwards_take_one_graph_per_width(model, rows, fresh_dynamo):
    """Traced by dynamo (whole graphs, no breaks) and run without inductor, which would take
    minutes per width on a small CPU: the probe `benchmarks/micro/static_cache_probe.py` runs inductor."""
    input_ids, attention_mask = random_batch(5, rows)
    counter = CompileCounter()
    compiled = torch.compile(model.__call__, backend=counter, dynamic=False, fullgraph=True)
    widths_fed = set()

    def decode(**inputs):
        widths_fed.add(inputs["input_ids"].shape[1])
        return compiled(**inputs)

    with torch.inference_mode():
        plain = plain_static(model, input_ids, attention_mask)
        kv = sized_as_generate(model, input_ids, widths=(1, 2, 4), decode=decode)
        spec = speculate(kv, input_ids, attention_mask, plain, k_max=3)
    assert spec.tolist() == plain.tolist()
    # With rows > 1 the mask is passed from the start, so holes appearing add no graph.
    assert widths_fed <= {1, 2, 4} and counter.frame_count == len(widths_fed)


def test_a_row_stopped_early_is_padded_at_its_own_positions():
    """A row that stops at an EOS is fed its padding at the end (`pad_steps`) through `rows_apart`,
    which must keep the row's position offset: with position ids of the user's own (GPT-2's absolute
    positions), the scores returned for its padded steps are plain static generate's."""
    target = tiny("gpt2", 0, attn_implementation="eager", eos_token_id=None)
    input_ids, attention_mask = random_batch(0, 2, vocab=128, min_len=7, max_len=10)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0) + torch.tensor([[5], [2]])
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    options = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        first = target.generate(**inputs, **options)[:, input_ids.shape[1] :]
        eos = int(first[0, 0])  # row 0 stops at once, row 1 decodes every step
        assert eos not in first[1].tolist()
        options.update(eos_token_id=eos, return_dict_in_generate=True, output_scores=True)
        plain = target.generate(**inputs, **options)
        spec = target.generate(**inputs, speculative="ngram", **options)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(plain.scores) == 8
    for step, (ours, theirs) in enumerate(zip(spec.scores, plain.scores)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_roll_back_moves_the_write_position_and_copies_nothing(target):
    input_ids = torch.tensor([[7, 8, 9, 10]])
    with torch.inference_mode():
        kv = StaticKV(target, StaticCache(config=target.config, max_cache_len=16), 1, input_ids.device)
        kv.forward(input_ids, None)
        keys = kv.cache.layers[0].keys
        pointer = keys.data_ptr()
        kv.forward(torch.tensor([[11, 12, 13]]), None)
        assert int(kv.cache.get_seq_length()) == 7
        kv.truncate(torch.tensor([5]))
        assert (kv.end, int(kv.cache.get_seq_length()), kv.lengths.tolist()) == (5, 5, [5])
        assert kv.cache.layers[0].keys.data_ptr() == pointer and kv.cache.layers[0].keys is keys


def test_padding_is_given_back(target):
    with torch.inference_mode():
        cache = StaticCache(config=target.config, max_cache_len=16)
        kv = StaticKV(target, cache, 1, torch.device("cpu"), widths=(4,))
        kv.forward(torch.tensor([[7, 8, 9]]), None)
        logits = kv.forward(torch.tensor([[10, 11]]), None).logits
    assert logits.shape[1] == 2  # the two padded positions' logits cut off
    assert (kv.end, int(kv.cache.get_seq_length())) == (5, 5)


def test_a_forward_that_does_not_fit_is_refused(target):
    with torch.inference_mode():
        kv = StaticKV(target, StaticCache(config=target.config, max_cache_len=6), 1, torch.device("cpu"))
        kv.forward(torch.tensor([[7, 8, 9, 10]]), None)
        assert kv.widest(4) == 2
        with pytest.raises(ValueError, match="max_cache_len=7"):
            kv.forward(torch.tensor([[11, 12, 13]]), None)


def test_sliding_window_static_layers_are_refused():
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    model = MistralForCausalLM(config).eval()
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        StaticKV(model, StaticCache(config=config, max_cache_len=16), 1, torch.device("cpu"))


def test_layers_of_different_lengths_are_refused():
    """Mllama's static cache sizes its cross-attention layers by the image's patches (34 here), its
    other layers by the text (at most 32 here): a batch of text prompts crashed inside the model (a
    shape or an index error), the columns it counted on being the longer layers'."""
    text = MllamaTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    vision = MllamaVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1, num_attention_heads=4,
        image_size=20, patch_size=5, max_num_tiles=2, intermediate_layers_indices=[0], vision_output_dim=64,
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )  # fmt: skip
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(MllamaConfig(text_config=text, vision_config=vision)).eval()
    input_ids, attention_mask = random_batch(0, 3, max_len=9)  # text layers of at most 9 + 24 - 1
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=MAX_NEW, cache_implementation="static")
    model.generate(input_ids, **kwargs)  # plain static decoding takes it
    with pytest.raises(
        ValueError, match=r"every layer to hold the same positions; .* and 34 \(cross-attention"
    ):
        model.generate(input_ids, **kwargs, speculative="ngram")


def test_compacting_skips_layers_never_written():
    """Mllama's text model keeps a cache layer for each cross-attention layer, which text prompts
    never write: compacting a ragged batch's holes raised a TypeError on its empty keys."""
    text = MllamaTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MllamaForCausalLM(text).eval()
    input_ids, attention_mask = random_batch(4, 3)
    with torch.inference_mode():
        plain = plain_static(model, input_ids, attention_mask)
        kv = sized_as_generate(model, input_ids, widths=(1, 2, 4, 8))
        spec = speculate(kv, input_ids, attention_mask, plain, k_max=7)
    assert spec.tolist() == plain.tolist()
    assert kv.compactions > 0


def test_allow_graphs_raises_a_limit_whose_attribute_was_hidden(fresh_dynamo):
    """A `del` on dynamo's config module (how pytest 9.2's monkeypatch undoes a setattr there) hides
    the attribute; the limit is still read and raised, and reading it works again after."""
    del torch._dynamo.config.recompile_limit
    allow_graphs(("a model", 1, 64), 5)
    assert torch._dynamo.config.recompile_limit == 13


def test_compiled_shapes_stop_being_recorded_once_the_limit_is_at_its_most(fresh_dynamo):
    """A notebook reloading its model (or a server building one per tenant) compiles each new model
    object's shape: once the graphs counted reach MAX_RECOMPILE_LIMIT, a new shape cannot raise the
    limit further, so nothing more is recorded for it."""
    for i in range(100):
        allow_graphs((f"model {i}", 1, 64), 5)
    assert torch._dynamo.config.recompile_limit == MAX_RECOMPILE_LIMIT
    assert len(static_kv._SHAPES_COMPILED) == -(-MAX_RECOMPILE_LIMIT // 5)


def test_allow_graphs_makes_room_on_every_thread_for_every_shape_compiled(fresh_dynamo):
    """Dynamo reads its settings per thread (torch 2.13: context variables) but keeps a code
    object's graphs for the whole process: the shapes a server's warm-up compiled on its main thread
    count against the limit on its worker threads too. A worker decoding one of them makes room for
    all of them, once; counting the shapes as done for the process left the worker at dynamo's
    default, and the graphs it compiled past it ran eagerly without a word."""
    allow_graphs(("a model", 1, 64), 5)
    allow_graphs(("a model", 2, 64), 5)
    assert torch._dynamo.config.recompile_limit == 18
    seen: list[int] = []

    def worker() -> None:
        allow_graphs(("a model", 1, 64), 5)
        allow_graphs(("a model", 1, 64), 5)  # once a thread
        seen.append(torch._dynamo.config.recompile_limit)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [18]
    assert torch._dynamo.config.recompile_limit == 18


def test_compiled_by_default_as_transformers_compiles_on_this_device(monkeypatch):
    """Without a compile_config, the model's own default for its device, as transformers' decoding
    takes it (TPU and Neuron get their own backends there, not inductor)."""
    model = tiny_llama(0)
    own = CompileConfig(backend="eager", dynamic=False, mode="default")
    monkeypatch.setattr(model, "_default_compile_config", lambda: own)
    monkeypatch.setattr("hf_specdec.core.static_kv.compiles_decoding", lambda *args: True)
    cache = StaticCache(config=model.config, max_cache_len=16)
    kv = StaticKV.for_generate(model, cache, 1, torch.device("cpu"), GenerationConfig(), {})
    assert kv.compile_config == own
