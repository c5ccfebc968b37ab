"""A conversation continued from a filled cache, as plain `generate` continues one: `input_ids`
holds what the cache holds and then the new turn, and only the new tokens are fed. The output is
plain generate's over the same cache; caches whose layout cannot be continued are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
    StaticCache,
)

from hf_specdec import SpeculativeConfig
from hf_specdec.core.kv import RaggedKV, holds_holes

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.heads import copied_layer_eagle

NEW_TURN = [7, 9, 3]


def _first_turn(model, input_ids, attention_mask, **kwargs):
    """Turn one's output, and turn two's prompt and mask: its sequences, then `NEW_TURN`."""
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        **kwargs,
    )
    batch = input_ids.shape[0]
    turn = torch.cat([out.sequences, torch.tensor([NEW_TURN] * batch)], dim=1)
    mask = torch.cat(
        [attention_mask, torch.ones(batch, turn.shape[1] - attention_mask.shape[1], dtype=torch.long)], 1
    )
    return out, turn, mask


def _cache(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


ROWS = {
    "one row": (torch.tensor([[1, 7, 9, 11, 7, 9]]), torch.ones(1, 6, dtype=torch.long)),
    "left-padded rows": (
        torch.tensor([[1, 7, 9, 11, 7, 9], [0, 0, 1, 7, 9, 4]]),
        torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]),
    ),
}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_conversation_continued_from_plain_generates_cache_is_plains_continuation(
    target, good_draft, rows, method
):
    input_ids, attention_mask = ROWS[rows]
    first, turn, mask = _first_turn(target, input_ids, attention_mask, eos_token_id=None)
    options = dict(
        attention_mask=mask,
        max_new_tokens=24,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        output_hidden_states=True,
    )
    plain = target.generate(turn, cache=copy.deepcopy(_cache(first)), **options)
    draft = good_draft if method == "draft_model" else None
    speculative = SpeculativeConfig(method=method, draft=draft, num_draft_tokens=4)
    ours = target.generate(turn, cache=copy.deepcopy(_cache(first)), speculative=speculative, **options)

    stats = ours.speculative_stats  # drafts verified, rejected and rolled back over the continued cache
    assert stats.speculative_steps > 0 and stats.drafted > stats.accepted
    assert stats.accepted > 0 or method == "ngram"  # the random model's n-grams seldom hold
    assert torch.equal(ours.sequences, plain.sequences)
    for a, b in zip(ours.scores, plain.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # The first step's hidden states are of the tokens the cache did not hold alone, as plain's: turn
    # one's last token (generated, never fed) and the new turn.
    uncached = 1 + len(NEW_TURN)
    assert ours.hidden_states[0][0].shape == plain.hidden_states[0][0].shape == (len(turn), uncached, 32)
    for a, b in zip(ours.hidden_states[0], plain.hidden_states[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    whole = target.generate(turn, **options)  # the same as feeding the whole conversation again
    assert torch.equal(whole.sequences, plain.sequences)


def test_a_speculative_turn_continues_a_speculative_turns_cache(target):
    """One row: the cache a speculative call hands back holds just its sequence, so the next turn
    continues it, speculative or plain."""
    input_ids, attention_mask = ROWS["one row"]
    first, turn, mask = _first_turn(target, input_ids, attention_mask, eos_token_id=None, speculative="ngram")
    assert _cache(first).get_seq_length() == first.sequences.shape[1] - 1
    options = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    plain = target.generate(turn, cache=copy.deepcopy(_cache(first)), **options)
    ours = target.generate(turn, cache=copy.deepcopy(_cache(first)), speculative="ngram", **options)
    assert torch.equal(ours, plain)


def test_a_row_stopped_inside_its_accepted_drafts_hands_back_just_its_sequence(target):
    """An EOS met inside a step's accepted drafts ends the row there: the drafts after it were
    accepted and cached, and must leave the cache, or a next turn would read them as its own."""
    input_ids = torch.tensor([[1, 42, 47, 23, 60, 61, 41]])  # its 4th token is the EOS, inside a draft
    perfect = SpeculativeConfig(method="draft_model", draft=target, num_draft_tokens=6)
    options = dict(max_new_tokens=20, do_sample=False, eos_token_id=6, return_dict_in_generate=True)
    ours = target.generate(input_ids, speculative=perfect, **options)
    plain = target.generate(input_ids, **options)
    assert torch.equal(ours.sequences, plain.sequences)
    assert ours.sequences[0, -1] == 6 and ours.sequences.shape[1] < input_ids.shape[1] + 20  # stopped
    assert _cache(ours).get_seq_length() == _cache(plain).get_seq_length() == ours.sequences.shape[1] - 1
    turn = torch.cat([ours.sequences, torch.tensor([NEW_TURN])], dim=1)
    later = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    continued = target.generate(turn, cache=_cache(ours), speculative="ngram", **later)
    assert torch.equal(continued, target.generate(turn, cache=_cache(plain), **later))


def test_a_chat_continued_on_smollm2_is_plains(smollm2):
    """Two chat turns on the real SmolLM2 with its tokenizer's chat template, the second continuing
    the first's cache."""
    model, tokenizer = smollm2
    chat = [{"role": "user", "content": "Name three primary colours, one per line."}]
    ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    first = model.generate(**ids, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    reply = tokenizer.decode(first.sequences[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    chat += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now repeat them in reverse order."},
    ]
    turn = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(turn, torch.Tensor):
        turn = turn["input_ids"]
    # The template re-renders turn one; continue from the columns it shares with the cache.
    cache = _cache(first)
    shared = int(
        (turn[0, : first.sequences.shape[1]] == first.sequences[0, : turn.shape[1]]).cumprod(0).sum()
    )
    assert shared > ids["input_ids"].shape[1]  # turn one's prompt and some of its reply are reused
    if shared < cache.get_seq_length():
        cache.crop(shared - cache.get_seq_length())
    options = dict(max_new_tokens=32, do_sample=False)
    plain = model.generate(turn, cache=copy.deepcopy(cache), **options)
    ours = model.generate(turn, cache=copy.deepcopy(cache), speculative="ngram", **options)
    assert_greedy_match(model, plain, ours, input_ids=turn)


def _ragged_cache(target, monkeypatch):
    """A speculative batch's cache whose rows accepted different numbers of drafts and ended at
    different steps, in a cache whose layers cannot be joined and laid out as plain decoding's (as a
    sparse-attention indexer's keys, or Mllama's cross-attention with an image: `RaggedKV.rejoins`)."""
    monkeypatch.setattr(RaggedKV, "rejoins", property(lambda kv: False))
    input_ids, attention_mask = random_batch(4, 4)
    out = target.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        speculative=SpeculativeConfig(method="ngram", num_draft_tokens=4),
        return_dict_in_generate=True,
    )
    cache = _cache(out)
    assert holds_holes(cache)  # the case under test: a cache that plain decoding's layout is not
    return out, cache


def test_a_ragged_batch_cache_is_refused_with_what_to_do(target, monkeypatch):
    """By speculation and by plain generate too, which would read the holes as tokens (or fail on the
    rows missing with a shape error), auto's plain decoding included."""
    out, cache = _ragged_cache(target, monkeypatch)
    turn = torch.cat([out.sequences, torch.tensor([NEW_TURN] * len(out.sequences))], dim=1)
    # Where auto decodes plainly (rotary frequencies recomputed past a context the call crosses), too.
    plainly = copy.deepcopy(target)
    plainly.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    plainly.config.max_position_embeddings = turn.shape[1] + 1
    for given in (cache, copy.deepcopy(cache)):  # a copy (a conversation branched) is refused too
        for model, speculative in ((target, "ngram"), (target, None), (target, True), (plainly, True)):
            with pytest.raises(
                ValueError, match=r"cannot be continued\. Pass the whole conversation without cache="
            ):
                model.generate(turn, cache=given, max_new_tokens=4, speculative=speculative)


def test_continuing_is_refused_where_the_layout_cannot_be_continued(target):
    input_ids, attention_mask = ROWS["one row"]
    turn = torch.cat([input_ids, torch.tensor([NEW_TURN])], dim=1)

    def filled(cache):
        with torch.no_grad():
            target(input_ids=input_ids, cache=cache, use_cache=True)
        return cache

    static = filled(StaticCache(config=target.config, max_cache_len=64))
    with pytest.raises(ValueError, match=r"not a filled StaticCache: pass the whole conversation"):
        target.generate(turn, cache=static, max_new_tokens=4, speculative="ngram")
    eagle = SpeculativeConfig(method="eagle", draft=copied_layer_eagle(target))
    with pytest.raises(ValueError, match=r"method='eagle' drafts from the target's hidden states"):
        target.generate(
            turn, cache=filled(DynamicCache(config=target.config)), max_new_tokens=4, speculative=eagle
        )


def test_a_sliding_window_cache_is_refused():
    model = tiny_llama(0)
    model.config.sliding_window = 4
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    input_ids, attention_mask = ROWS["one row"]
    first, turn, mask = _first_turn(model, input_ids, attention_mask, eos_token_id=None)
    with pytest.raises(ValueError, match=r"cannot continue a cache with sliding-window or quantized layers"):
        model.generate(turn, attention_mask=mask, cache=_cache(first), max_new_tokens=4, speculative="ngram")


def test_input_ids_of_the_new_tokens_alone_are_refused(target):
    """transformers also takes input_ids holding only the new tokens, with an attention mask over
    the whole conversation; continued as if they were the whole, the first ones would be dropped."""
    input_ids, attention_mask = ROWS["one row"]
    first, turn, mask = _first_turn(target, input_ids, attention_mask, eos_token_id=None)
    new_only = turn[:, _cache(first).get_seq_length() :]
    with pytest.raises(ValueError, match=r"from input_ids holding the whole conversation .* pass torch\.cat"):
        target.generate(
            new_only, attention_mask=mask, cache=_cache(first), max_new_tokens=4, speculative="ngram"
        )


@pytest.mark.parametrize("filled", [False, True])
def test_a_sliding_window_model_over_a_cache_built_without_its_config(filled):
    """`DynamicCache()` without the model's config has full layers, but the model still attends in
    its window: a batch whose rows accept differently has holes, which must not count in it."""
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.4,
        pad_token_id=0,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    input_ids, attention_mask = random_batch(3, 3)
    cache = DynamicCache()
    if filled:
        first = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, cache=cache
        )
        input_ids = torch.cat([first, torch.tensor([NEW_TURN] * 3)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones(3, 9, dtype=torch.long)], dim=1)
    assert all(type(layer).__name__ == "DynamicLayer" for layer in cache.layers)
    options = dict(attention_mask=attention_mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    plain = model.generate(input_ids, cache=copy.deepcopy(cache), **options)
    fixed = SpeculativeConfig(method="ngram", num_draft_tokens=4)
    ours = model.generate(
        input_ids, cache=copy.deepcopy(cache), speculative=fixed, return_dict_in_generate=True, **options
    )
    assert torch.equal(ours.sequences, plain)
    assert ours.speculative_stats.speculative_steps > 0


def _tiny_llava() -> LlavaForConditionalGeneration:
    """LLaVA with a CLIP tower: a 20x20 image becomes 16 soft tokens at the image token's places."""
    text = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=20,
        patch_size=5,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(
        LlavaConfig(text_config=text, vision_config=vision, image_token_id=4)
    ).eval()


def test_a_text_turn_after_an_image_turn_is_plains_continuation():
    """generate gives every image-text model an empty `mm_encoder_outputs`, image or not: a text turn
    over the cache of a turn with an image was refused as if it held an image."""
    model = _tiny_llava()
    input_ids = torch.tensor([[1, 9] + [4] * 16 + [7, 11, 13]])
    pixel_values = torch.randn(1, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    first, turn, mask = _first_turn(model, input_ids, torch.ones_like(input_ids), pixel_values=pixel_values)
    plain = model.generate(turn, cache=copy.deepcopy(_cache(first)), max_new_tokens=8, do_sample=False)
    ours = model.generate(
        turn, cache=copy.deepcopy(_cache(first)), max_new_tokens=8, do_sample=False, speculative="ngram"
    )
    assert ours.tolist() == plain.tolist()
    with pytest.raises(ValueError, match=r"continues a filled cache= with a text prompt only"):
        model.generate(
            turn, cache=_cache(first), pixel_values=pixel_values, max_new_tokens=4, speculative="ngram"
        )


def _tiny_qwen2_vl():
    """Qwen2-VL with its multimodal rotary positions: a 56x56 image, 16 patches of 14 pixels merged
    2x2, becomes 4 soft tokens at the image token's (4) places, which share a temporal position."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=None, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=4, video_token_id=5, vision_start_token_id=6,
        vision_end_token_id=7,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def test_a_text_turn_after_a_qwen2_vl_image_turn_is_plains_continuation():
    """An image turn is decoded plainly (its rotary positions differ between axes); the text turn after
    it continues the cache with positions shifted by the `rope_deltas` the image's prefill left on the
    model, which generate adds to the new turn's positions: in a left-padded batch whose rows' images
    shift them differently, drafts accepted, the output is plain's."""
    model = _tiny_qwen2_vl()
    rows = [[1, 9, 6] + [4] * 4 + [7, 11, 13, 9, 11, 13], [1, 10, 6] + [4] * 8 + [7, 12]]  # 2x2, 2x4 merged
    input_ids = torch.tensor([[0] * (13 - len(row)) + row for row in rows])
    attention_mask = (input_ids != 0).long()
    pixels = torch.randn(48, 1176, generator=torch.Generator().manual_seed(0))
    kwargs = dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 8]]))
    kwargs["mm_token_type_ids"] = (input_ids == 4).long()
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True, speculative=True, **kwargs)  # fmt: skip
    assert out.speculative_stats.method == "plain"
    assert "rotary positions that differ between axes" in out.speculative_stats.selection
    assert model.model.rope_deltas.flatten().tolist() == [-2, -4]  # the images moved the text's positions
    turn = torch.cat([out.sequences, torch.tensor([[9, 11, 13, 9, 11, 13, 9, 11]] * 2)], dim=1)
    mask = torch.cat([attention_mask, torch.ones(2, turn.shape[1] - input_ids.shape[1], dtype=torch.long)], 1)
    options = dict(
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    plain = model.generate(turn, cache=copy.deepcopy(_cache(out)), **options)
    draft = SpeculativeConfig(method="draft_model", draft=model, num_draft_tokens=3)
    for speculative in ("ngram", draft):
        ours = model.generate(turn, cache=copy.deepcopy(_cache(out)), speculative=speculative, **options)
        assert torch.equal(ours.sequences, plain.sequences)
        # A tiny random model's choices hardly move with positions shifted a little: its scores do.
        torch.testing.assert_close(torch.stack(ours.scores), torch.stack(plain.scores), rtol=1e-4, atol=1e-4)
    assert ours.speculative_stats.accepted > 0
