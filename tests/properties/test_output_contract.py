"""generate's whole output contract with speculative=: what plain `generate` returns, step by step.

With `return_dict_in_generate=True` plain `generate` returns, per generated token, its scores and
logits, each layer's attention weights over the sequence so far and each layer's hidden states
(the first token's: the whole prompt), and its cache. Speculation must return the same, sliced
out of its multi-token verify forwards (the accepted positions; for trees, the accepted path's),
for the 14 decoder-only architectures of issue 20 (Gemma 3 both as text model and image-text
model), at batch size 1 and in left-padded batches whose rows accept different numbers of drafts,
with every model input plain decoding would pass (GPT-2's token types, Gemma 3's image) reaching
the model. transformers' own GenerationTesterMixin tests check the shapes of all this
(`benchmarks/engines/upstream_tests.py` runs them); these compare the values too, in fp32 with eager
attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    GemmaConfig,
    ImageGPTConfig,
    ImageGPTForCausalImageModeling,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    SiglipVisionConfig,
)
from transformers.cache_utils import DummyLayer

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.core.kv import holds_holes

from ..helpers.architectures import VOCAB, tiny

ARCHITECTURES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3_image", "phi3", "gpt2",
    "opt", "gpt_neox", "falcon", "starcoder2", "olmo2", "gemma3n_text",
]  # fmt: skip
SLIDING = ["mistral", "gemma2", "gemma3_text", "starcoder2"]
WINDOW = 4  # shorter than the sequences: sliding layers' attentions and cache are cut to it
IMAGE_TOKEN, IMAGE_TOKENS = 4, 4
EVERYTHING = dict(
    return_dict_in_generate=True,
    output_scores=True,
    output_logits=True,
    output_attentions=True,
    output_hidden_states=True,
)


def model(name: str, seed: int = 0, attention: str = "eager") -> torch.nn.Module:
    if name == "gemma3_image":
        return _gemma3_image(seed, attention)
    if name == "gemma3n_text":
        return _gemma3n(seed, attention)
    window = {"sliding_window": WINDOW} if name in SLIDING else {}
    return tiny(name, seed, attn_implementation=attention, eos_token_id=None, **window)


def _gemma3_image(seed: int, attention: str) -> Gemma3ForConditionalGeneration:
    """Gemma 3 with a SigLIP tower: a 20x20 image becomes 4 soft tokens at the image token's places."""
    text = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=20,
        patch_size=5,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN, boi_token_index=5, eoi_token_index=6,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration._from_config(config, attn_implementation=attention).eval()


def _gemma3n(seed: int, attention: str) -> Gemma3nForCausalLM:
    """Gemma 3n's text model: its hidden states carry its AltUp streams first ([2, rows, positions,
    hidden]), and its last layers share the KV of earlier ones."""
    config = Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=16, hidden_size_per_layer_input=16,
        num_hidden_layers=4, num_kv_shared_layers=2, num_attention_heads=2, num_key_value_heads=2,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW, altup_num_inputs=2, intermediate_size=22, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Gemma3nForCausalLM._from_config(config, attn_implementation=attention).eval()


def prompts(name: str, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 7-10 tokens, with the inputs the architecture's tests give it: GPT-2
    token types (a prompt's last token's type is that of every generated token), an image."""
    g = torch.Generator().manual_seed(seed)
    lengths = [10, 7, 8][:batch]
    input_ids = torch.zeros(batch, 10, dtype=torch.long)
    attention_mask = torch.zeros(batch, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, 10 - n :] = torch.randint(7, VOCAB, (n,), generator=g)
        attention_mask[b, 10 - n :] = 1
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if name == "gpt2":
        inputs["token_type_ids"] = torch.randint(0, 2, input_ids.shape, generator=g) * attention_mask
    if name == "gemma3_image":  # <boi> image image image image <eoi> ... in every row
        input_ids[:, -7] = 5
        input_ids[:, -6:-2] = IMAGE_TOKEN
        input_ids[:, -2] = 6
        inputs["token_type_ids"] = (input_ids == IMAGE_TOKEN).long()
        inputs["pixel_values"] = torch.randn(batch, 3, 20, 20, generator=g)
    return inputs


def generate(target, inputs, speculative=None, max_new_tokens=6, **kwargs):
    kwargs = {**EVERYTHING, "max_new_tokens": max_new_tokens, "do_sample": False, **kwargs}
    with torch.no_grad():
        return target.generate(**inputs, speculative=speculative, **kwargs)


def assert_like_plain(target, inputs, speculative, compare_cache=True, **kwargs):
    """Speculation's output equals plain greedy generate's: the same tokens, and every returned tensor
    of the same shape and, up to fp32 rounding, the same values."""
    plain = generate(target, inputs, **kwargs)
    spec = generate(target, inputs, speculative, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)
    for field in ("attentions", "hidden_states"):
        ours, theirs = getattr(spec, field), getattr(plain, field)
        assert len(ours) == len(theirs), field
        for step, (layers, expected) in enumerate(zip(ours, theirs)):
            assert_close_steps(layers, expected, f"{field}[{step}]")
    if compare_cache:
        ours, theirs = spec.past_key_values, plain.past_key_values
        assert [type(layer) for layer in ours.layers] == [type(layer) for layer in theirs.layers]
        for i, (layer, expected) in enumerate(zip(ours.layers, theirs.layers)):
            if isinstance(expected, DummyLayer):  # a layer reading another's keys (Gemma 3n)
                continue
            assert_close_steps((layer.keys, layer.values), (expected.keys, expected.values), f"cache[{i}]")
    return plain, spec


def assert_close_steps(ours, theirs, what):
    assert isinstance(ours, tuple) and len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, f"{what}[{i}]: {tuple(a.shape)} != {tuple(b.shape)}"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"{what}[{i}]: {m}")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_output_like_plain_at_batch_1(name):
    """A random draft of the same architecture: most drafts rejected, the cache rolled back each step;
    sliding-window layers' attentions and the returned cache cut to the window, as plain's."""
    target = model(name)
    draft = SpeculativeConfig(method="draft_model", draft=model(name, seed=1), num_draft_tokens=3)
    assert_like_plain(target, prompts(name, 1), draft)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_output_like_plain_in_a_ragged_batch(name):
    """Left-padded rows accepting different numbers of drafts (holes in the cache, cut out of each
    token's attentions), then the model as its own draft in trees (each token's attentions and hidden
    states from its node on the accepted path), and the cache handed back plain decoding's whichever
    step each row ended at (`pad_steps`)."""
    target, inputs = model(name), prompts(name, 3)
    chain = SpeculativeConfig(method="draft_model", draft=model(name, seed=1), num_draft_tokens=3)
    assert_like_plain(target, inputs, chain)
    tree = SpeculativeConfig(method="draft_model", draft=target, num_draft_tokens=4, tree=True)
    plain, spec = assert_like_plain(target, inputs, tree)
    assert spec.speculative_stats.tree_steps > 0 and spec.speculative_stats.accepted > 0


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("method", ["ngram", "ngram+tree"])
def test_every_output_like_plain_with_prompt_lookup(name, method):
    """Prompt lookup on prompts that repeat, so that its drafts are accepted: several tokens a step."""
    target = model(name)
    inputs = prompts(name, 3)
    inputs["input_ids"][:, -6:] = inputs["input_ids"][:, -3:].repeat(1, 2)
    speculative = SpeculativeConfig(method="ngram", num_draft_tokens=3, tree=method.endswith("tree"))
    plain, spec = assert_like_plain(target, inputs, speculative, compare_cache=False, max_new_tokens=10)
    assert spec.speculative_stats.accepted > 0


# Batches whose rows keep different numbers of drafts (holes mid-cache) yet end in the same step.
ENDING_TOGETHER = [("mistral", "ngram", 16), ("mistral", "ngram+tree", 16), ("gpt2", "ngram", 14),
                   ("gpt2", "draft_model", 12)]  # fmt: skip


@pytest.mark.parametrize(("name", "method", "max_new_tokens"), ENDING_TOGETHER)
def test_a_ragged_batch_hands_back_plain_decodings_cache(name, method, max_new_tokens):
    """The holes are compacted away (`RaggedKV.compact`, within the call and at its end), so rows that
    end together hand back plain decoding's cache: its layers' types (a sliding window cut back to
    it), and their keys and values."""
    target, inputs = model(name), prompts(name, 3)
    inputs["input_ids"][:, -6:] = inputs["input_ids"][:, -3:].repeat(1, 2)  # prompt lookup finds drafts
    if method == "draft_model":
        speculative = SpeculativeConfig(method="draft_model", draft=_near(target), num_draft_tokens=4)
    else:
        speculative = SpeculativeConfig(method="ngram", num_draft_tokens=3, tree=method.endswith("tree"))
    plain, spec = assert_like_plain(target, inputs, speculative, max_new_tokens=max_new_tokens)
    assert spec.speculative_stats.accepted > 0 and not holds_holes(spec.past_key_values)


def _near(target: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """`target` with noise on its weights: a draft that agrees with it now and then."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return draft


@pytest.mark.parametrize("name", ["llama", "gpt2", *SLIDING, "gemma3n_text"])
def test_a_chunked_prefill_returns_the_last_chunks_states_as_plain(name):
    """With prefill_chunk_size plain generate prefills the prompt chunk by chunk and returns, as the
    first token's attentions and hidden states, those of the last chunk's forward: its queries, over
    the whole prompt (a sliding layer: its window before the chunk, then the chunk). Speculation
    prefills in one forward and returns the same slice of it (it returned the whole prompt's)."""
    target, inputs = model(name), prompts(name, 2)  # 10 columns: chunks of 4, 4 and 2
    # The caches differ at row 1's padding only (its keys from layer 1 on, computed from chunks).
    plain, _ = assert_like_plain(target, inputs, "ngram", compare_cache=False, prefill_chunk_size=4)
    assert plain.hidden_states[0][0].shape[-2] == 2


def test_a_chunked_prefill_under_sdpa_returns_no_attentions_as_plain():
    """Attentions asked alone of a model that returns none (sdpa): empty steps, as plain's."""
    target, inputs = model("llama", attention="sdpa"), prompts("llama", 2)
    alone = dict(prefill_chunk_size=4, output_hidden_states=False)
    plain, spec = generate(target, inputs, **alone), generate(target, inputs, "ngram", **alone)
    assert torch.equal(spec.sequences, plain.sequences) and spec.attentions == plain.attentions


def test_gpt2_token_types_reach_the_model():
    """Issue 20: GPT-2's token_type_ids were dropped (the first token already differed)."""
    target, inputs = model("gpt2"), prompts("gpt2", 3)
    plain, _ = assert_like_plain(target, inputs, "ngram", compare_cache=False)
    without = generate(target, {k: v for k, v in inputs.items() if k != "token_type_ids"})
    assert not torch.allclose(without.scores[0], plain.scores[0])  # the types matter to this model


def test_gemma3_image_reaches_the_model():
    """Issue 20: Gemma 3's pixel_values were dropped (the output was plain generate's without the image)."""
    target, inputs = model("gemma3_image"), prompts("gemma3_image", 1)
    plain, _ = assert_like_plain(target, inputs, "ngram")
    without = generate(target, {k: v for k, v in inputs.items() if k != "pixel_values"})
    assert not torch.allclose(without.scores[0], plain.scores[0])  # the image matters to this model


@pytest.mark.parametrize("mask", [[1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0]], ids=["1-of-7", "5-of-7"])
@pytest.mark.parametrize("name", ["llama", *SLIDING])
def test_right_padding_like_plain(name, mask):
    """Right padding, as transformers' testers' masks have it: plain generate counts the window in cache
    columns (padding included) and continues positions from the prompt's last position id, not from
    its number of real tokens; speculation does the same (issue 20: sliding-window models' first
    scores were 0.05-0.45 off)."""
    target = model(name)
    inputs = prompts(name, 2)
    inputs["input_ids"], inputs["attention_mask"] = inputs["input_ids"][:, 3:], torch.tensor([mask, [1] * 7])
    draft = SpeculativeConfig(method="draft_model", draft=model(name, seed=1), num_draft_tokens=3)
    for rows in (slice(0, 1), slice(0, 2)):
        assert_like_plain(
            target, {k: v[rows] for k, v in inputs.items()}, draft, compare_cache=rows.stop == 1
        )


def test_own_position_ids_like_plain():
    """position_ids given to generate: the prompt's are used, and generated tokens continue from them
    (GPT-2: absolute position embeddings, which a shift changes)."""
    target, inputs = model("gpt2"), prompts("gpt2", 2)
    shift = torch.tensor([[5], [2]])
    inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp_min(0) + shift
    plain, _ = assert_like_plain(target, inputs, "ngram", compare_cache=False)
    unshifted = generate(target, {k: v for k, v in inputs.items() if k != "position_ids"})
    assert not torch.allclose(unshifted.scores[0], plain.scores[0])


def test_paligemma_counts_positions_from_one_as_plain_does():
    """PaliGemma's `prepare_inputs_for_generation` adds 1 to generate's position ids: plain feeds its
    language model positions 1..n, and so does speculation (fed 0..n-1 before, RoPE rounded its
    scores otherwise than plain's), its drafts continuing from there."""
    text = GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=20,
        patch_size=10, projection_dim=32,
    )  # fmt: skip
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=4, projection_dim=32)
    config.text_config.num_image_tokens = 4
    torch.manual_seed(0)

    class FineTuned(PaliGemmaForConditionalGeneration):  # a subclass counts from 1 as well
        pass

    target = FineTuned._from_config(config, attn_implementation="eager").eval()
    prompt = torch.cat([torch.full((1, 4), 4), torch.randint(5, VOCAB, (1, 6)).repeat(1, 2)], dim=1)
    inputs = dict(
        input_ids=prompt, token_type_ids=torch.zeros_like(prompt), pixel_values=torch.randn(1, 3, 20, 20)
    )
    fed: list[list[int]] = []
    hook = lambda module, args, kwargs: fed.append(kwargs["position_ids"][0].tolist())  # noqa: E731
    target.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    plain = target.generate(**inputs, max_new_tokens=6, do_sample=False)
    plain_fed, fed[:] = fed[:], []
    ngram = dict(method="ngram", num_draft_tokens=3, options=dict(min_ngram=1))
    ours = target.generate(**inputs, max_new_tokens=6, do_sample=False, speculative=ngram)
    assert torch.equal(ours, plain)
    assert fed[0] == plain_fed[0] == list(range(1, prompt.shape[1] + 1))
    assert fed[1] == list(range(prompt.shape[1] + 1, prompt.shape[1] + 1 + len(fed[1]))) and len(fed[1]) > 1


def test_sdpa_returns_attentions_as_plain_does():
    """With sdpa, transformers returns no attention weights: plain's steps hold empty tuples, so do ours."""
    target, inputs = model("llama", attention="sdpa"), prompts("llama", 2)
    draft = SpeculativeConfig(method="draft_model", draft=target, num_draft_tokens=3)
    plain, spec = assert_like_plain(target, inputs, draft, compare_cache=False)
    assert spec.attentions == plain.attentions == ((),) * 6


def test_finished_rows_get_what_plain_ran_their_padding_through():
    """A row that stops early: plain generate still runs its last token, then its pad token, through
    the model, and so does speculation at the end of the call (`core/pad_steps.py`)."""
    target, inputs = model("llama"), prompts("llama", 3)
    eos = int(generate(target, inputs).sequences[1, 11])  # row 1 stops at its second token
    draft = SpeculativeConfig(method="draft_model", draft=target)
    plain, _ = assert_like_plain(target, inputs, draft, compare_cache=False, eos_token_id=eos)
    assert bool(plain.sequences[1, -1] == 0)  # row 1 was padded


def test_a_head_narrower_than_the_config_vocabulary():
    """ImageGPT's head scores one id fewer than its config's `vocab_size` (no logit for its start
    id): scores and sampling over the head's width, as plain's (a seeded sample draws per column);
    an n-gram draft holding the start id (63, which it embeds) is verified, not refused."""
    torch.manual_seed(0)
    config = ImageGPTConfig(vocab_size=64, n_positions=256, n_embd=32, n_layer=2, n_head=4)
    target = ImageGPTForCausalImageModeling(config).eval()
    prompt = torch.tensor([[63, 3, 29, 63, 26, 59, 54, 3, 52, 3]])
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=3)
    plain, _ = assert_like_plain(target, inputs, ngram, max_new_tokens=12, pad_token_id=0)
    assert plain.scores[0].shape[-1] == 63
    for seed in range(3):
        torch.manual_seed(seed)
        expected = generate(target, inputs, do_sample=True, pad_token_id=0).sequences
        torch.manual_seed(seed)
        sampled = generate(target, inputs, "ngram", do_sample=True, pad_token_id=0).sequences
        assert torch.equal(sampled, expected)


def _shapes(output, field):
    return [
        [t.shape for t in step] if isinstance(step, tuple) else step.shape for step in getattr(output, field)
    ]


def test_sampling_returns_plain_shapes():
    """Sampled speculation (transformers' test_assisted_decoding_sample): every output of plain's shape."""
    target, inputs = model("gemma2"), prompts("gemma2", 2)
    kwargs = dict(do_sample=True, num_return_sequences=2, top_k=10)
    plain = generate(target, inputs, **kwargs)
    spec = generate(target, inputs, SpeculativeConfig(method="draft_model", draft=target), **kwargs)
    for field in ("scores", "logits", "attentions", "hidden_states"):
        assert _shapes(spec, field) == _shapes(plain, field), field


def test_unforwarded_model_input_is_refused():
    """A model input the loop does not pass on is refused by name, never dropped."""
    target = tiny("mixtral", 0)
    with pytest.raises(ValueError, match="would not pass 'output_router_logits' to the model: drop it"):
        target.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=3, output_router_logits=True, speculative="ngram"
        )


def test_nothing_extra_is_computed_unless_asked():
    """Without output_attentions / output_hidden_states the target computes neither."""
    target, asked = model("llama"), []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: asked.append(
            bool(kwargs.get("output_attentions")) or bool(kwargs.get("output_hidden_states"))
        ),
        with_kwargs=True,
    )
    try:
        generate(
            target,
            prompts("llama", 2),
            SpeculativeConfig(method="draft_model", draft=model("llama", 1)),
            return_dict_in_generate=True,
            output_attentions=False,
            output_hidden_states=False,
        )
    finally:
        hook.remove()
    assert asked and not any(asked)


def test_transformers_own_tests():
    """transformers' GenerationTesterMixin assisted-decoding and prompt-lookup tests of the 14
    architectures, run by `benchmarks/engines/upstream_tests.py` from the checkout at
    $HF_SPECDEC_TRANSFORMERS_SRC (they are not on PyPI):
    every test that passes with transformers' own assisted
    generation passes with speculative=, chains and trees."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    source = os.environ.get("HF_SPECDEC_TRANSFORMERS_SRC")
    if not source:
        pytest.skip("set HF_SPECDEC_TRANSFORMERS_SRC to a transformers checkout to run its own tests")
    runner = Path(hf_specdec.__file__).resolve().parents[1] / "benchmarks" / "engines" / "upstream_tests.py"
    command = [sys.executable, str(runner), "--transformers", source, "--runs", "stock,ours,ours-tree"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _qwen3_vl() -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=None, max_position_embeddings=256,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32)
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()


def test_text_prompt_of_a_model_with_multi_axis_positions_like_plain():
    """Qwen-VL-style models get position_ids over several rotary axes from generate; a text prompt's
    are the same on every axis, and its mm_token_type_ids (all text) grow with zeros, as plain's."""
    target, inputs = _qwen3_vl(), prompts("llama", 2)
    inputs["mm_token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    draft = SpeculativeConfig(method="draft_model", draft=target, num_draft_tokens=3)
    assert_like_plain(target, inputs, draft, compare_cache=False)


def test_positions_that_differ_between_axes_are_refused():
    """An image in such a model gives its tokens positions that differ between axes: refused, not guessed."""
    from hf_specdec.core.inputs import ModelInputs

    input_ids = torch.tensor([[7, 8, 9, 10]])
    positions = torch.arange(4).expand(4, 1, 4).clone()
    positions[1:, 0, 1:3] = 1  # two image tokens sharing a temporal position
    with pytest.raises(ValueError, match="rotary positions that differ between axes.*use plain generate"):
        ModelInputs(model("llama"), input_ids, {"position_ids": positions})


def test_positions_that_differ_between_axes_are_decoded_plainly_under_auto():
    """What plain generate decodes (an image's positions, here given as generate would make them):
    speculative=True decodes it plainly, saying why, and a named method refuses it before the call."""
    from hf_specdec.core.checks import Unsupported

    target, input_ids = _qwen3_vl(), torch.tensor([[7, 8, 9, 10, 11, 12]])
    positions = torch.arange(6).expand(3, 1, 6).clone()
    positions[1:, 0, 1:3] = 1  # two image tokens sharing a temporal position
    kw = dict(position_ids=positions, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    plain = target.generate(input_ids, **kw)
    out = target.generate(input_ids, **kw, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.speculative_stats.method == "plain"
    assert "rotary positions that differ between axes" in out.speculative_stats.selection
    with pytest.raises(Unsupported, match="rotary positions that differ between axes.*use plain generate"):
        target.generate(input_ids, **kw, speculative="ngram")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_every_output_like_plain_with_heads(method, tree):
    """EAGLE and Medusa heads read the target's hidden states as they draft; asking for them as outputs
    as well changes neither the drafts nor what is returned."""
    from ..conftest import random_batch, tiny_llama
    from ..helpers.heads import copied_layer_eagle, identity_medusa

    target = tiny_llama(30, layers=1, eos_token_id=None)  # every row runs to max_new_tokens
    target.set_attn_implementation("eager")
    head = copied_layer_eagle(target) if method == "eagle" else identity_medusa(target)
    input_ids, attention_mask = random_batch(seed=22, batch=3)
    speculative = SpeculativeConfig(method=method, draft=head, num_draft_tokens=3, tree=tree)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain, spec = assert_like_plain(target, inputs, speculative, compare_cache=False, max_new_tokens=12)
    assert spec.speculative_stats.accepted > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_every_output_like_plain_with_a_block_draft(tree):
    """A DFlash block draft reads the target's hidden states at several layers as it drafts: every
    output of plain's, in a left-padded batch whose rows accept different numbers of drafts."""
    from ..conftest import random_batch, tiny_llama
    from ..helpers.block_drafts import random_block_draft

    target = tiny_llama(31, vocab_size=8, eos_token_id=None)  # a random draft agrees now and then
    target.set_attn_implementation("eager")
    draft = random_block_draft(target, (0, 1), block_size=4)
    input_ids, attention_mask = random_batch(seed=23, batch=3, vocab=8)
    speculative = SpeculativeConfig(method="dflash", draft=draft, num_draft_tokens=3, tree=tree)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    plain, spec = assert_like_plain(target, inputs, speculative, compare_cache=False, max_new_tokens=12)
    assert spec.speculative_stats.accepted > 0
