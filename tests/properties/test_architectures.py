"""Architecture coverage: tiny random models built from transformers' own configs.

Each architecture speculates with n-gram lookup, with itself as the draft (every draft accepted)
and with another random model of the same shape as the draft (most drafts rejected, so the cache
is rolled back nearly every step), and must give plain greedy `generate`'s output. The
sliding-window ones run with a window of 16 and contexts past it, in batches with holes too, so a
transformers upgrade that breaks an architecture's cache or masks fails here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_specdec
from hf_specdec.core.kv import RaggedKV

from ..conftest import assert_greedy_match, random_batch
from ..helpers.architectures import (
    FULL_ATTENTION,
    RECURRENT,
    SLIDING_WINDOW,
    VOCAB,
    WINDOW,
    tiny,
)


def _methods(model, weak_draft):
    return {
        "ngram": "ngram",
        "self": hf_specdec.SpeculativeConfig(method="draft_model", draft=model, num_draft_tokens=4),
        "weak": hf_specdec.SpeculativeConfig(method="draft_model", draft=weak_draft, num_draft_tokens=3),
    }


def _check(model, weak_draft, input_ids, attention_mask=None, new_tokens=24):
    plain = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False
    )
    for method, speculative in _methods(model, weak_draft).items():
        spec = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            speculative=speculative,
        )
        assert spec.shape == plain.shape, method
        assert_greedy_match(model, plain, spec, attention_mask)


@pytest.mark.parametrize("name", FULL_ATTENTION + list(SLIDING_WINDOW))
def test_architecture_matches_plain_greedy(name):
    model, weak_draft = tiny(name, 0), tiny(name, 1)
    prompt = torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    _check(model, weak_draft, prompt)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(SLIDING_WINDOW))
def test_sliding_window_past_the_window(name, seed):
    """Contexts of 2-4 windows, batch 1 and a ragged left-padded batch (holes mid-cache)."""
    model, weak_draft = tiny(name, seed), tiny(name, seed + 10)
    prompt = torch.randint(3, VOCAB, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(seed))
    _check(model, weak_draft, prompt, new_tokens=2 * WINDOW)
    input_ids, attention_mask = random_batch(seed, 3, vocab=VOCAB, min_len=WINDOW // 2, max_len=3 * WINDOW)
    _check(model, weak_draft, input_ids, attention_mask, new_tokens=WINDOW + 8)


def test_sliding_window_masks_count_real_tokens():
    """A query sees the `window` real tokens before it however many holes lie between them."""
    model = tiny("mistral", 0)
    kv = RaggedKV(model, None, 1, torch.device("cpu"))
    assert kv.window_masks is not None
    # columns: 4 real, 3 holes, 1 real, then a query: the window of 16 reaches back over the holes
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    kv.window_masks.window = 3
    allowed = kv.window_masks.build(mask, 1)[0, 0, 0]
    # the query (position 5) sees positions 3, 4, 5: column 3, column 7 and itself; not the holes
    assert allowed.tolist() == [False, False, False, True, False, False, False, True, True]


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_architecture_matches_plain(name):
    """Linear-attention and state-space models (a recurrent state a row beside their attention
    layers, if any) at batch 1: drafts rejected nearly every step roll the target's states back, and
    a weak draft of the same kind its own; greedy and seeded sampling give plain's tokens, and the
    cache handed back continues a conversation as plain's does."""
    model, weak_draft = tiny(name, 0, eos_token_id=None), tiny(name, 1, eos_token_id=None)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 4)
    prompt[0, -3:] = torch.tensor([5, 6, 7])  # the copy breaks off: some drafts hold, others not
    _check(model, weak_draft, prompt)
    ngram = dict(method="ngram", num_draft_tokens=4, options=dict(min_ngram=1))
    out = model.generate(prompt, max_new_tokens=24, speculative=ngram, return_dict_in_generate=True)
    assert 0 < out.speculative_stats.accepted < out.speculative_stats.drafted  # held and rolled back
    for seed in range(2):
        torch.manual_seed(seed)
        plain = model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=20)
        torch.manual_seed(seed)
        assert torch.equal(
            model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=20, speculative="ngram"), plain
        )
    turn = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    plain, spec = model.generate(prompt, **turn), model.generate(prompt, **turn, speculative=ngram)
    follow_up = torch.cat([plain.sequences, prompt[:, :5]], dim=1)
    expected = model.generate(follow_up, cache=plain.past_key_values, max_new_tokens=12, do_sample=False)
    continued = model.generate(follow_up, cache=spec.past_key_values, max_new_tokens=12, speculative=ngram)
    assert torch.equal(continued, expected)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_architecture_with_a_left_padded_prompt(name):
    """A prompt of one row left-padded in its attention mask (as a tokenizer pads a batch of one):
    plain's output, with drafts rejected and with steps that draft nothing. Mamba applies whatever
    mask it is given to the tokens fed, so after the prompt it must be given none, as plain does."""
    model, weak_draft = tiny(name, 0, eos_token_id=None), tiny(name, 1, eos_token_id=None)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(1)).repeat(1, 3)
    prompt[0, :3] = 0
    _check(model, weak_draft, prompt, attention_mask=(prompt != 0).long())


def test_recurrent_architecture_refuses_what_it_cannot_roll_back():
    model = tiny("qwen3_next", 0)
    prompt = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one row at a time"):
        model.generate(prompt, max_new_tokens=4, speculative="ngram")
    with pytest.raises(ValueError, match="cannot take a tree's branches side by side: drop tree=True"):
        model.generate(prompt[:1], max_new_tokens=4, speculative=dict(method="ngram", tree=True))
    auto = dict(method="ngram", tree="auto")  # chains, not a refusal
    out = model.generate(prompt[:1], max_new_tokens=6, speculative=auto, return_dict_in_generate=True)
    assert out.speculative_stats.tree_steps == 0


@pytest.mark.parametrize("name", ["qwen3_next", "mamba"])
def test_a_recurrent_batch_under_auto_decodes_plainly(name):
    """`speculative=True` on a batch of a model with a recurrent state (which rolls back one row at a
    time) decodes it with generate's own loop, saying why, where a named method refuses: plain's
    tokens, scores and sampled sequences, and the call's statistics say it drafted nothing."""
    model = tiny(name, 0, eos_token_id=None)
    prompt = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # a left-padded row
    kw = dict(attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(prompt, do_sample=False, **kw)
    out = model.generate(prompt, do_sample=False, **kw, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, plain.scores, strict=True))
    stats = out.speculative_stats
    assert stats.method == "plain" and stats.drafted == 0 and "one row at a time" in stats.selection
    torch.manual_seed(3)
    sampled = model.generate(prompt[:1], do_sample=True, num_return_sequences=2, max_new_tokens=6)
    torch.manual_seed(3)
    spec = model.generate(
        prompt[:1], do_sample=True, num_return_sequences=2, max_new_tokens=6, speculative=True
    )
    assert torch.equal(spec, sampled)


@pytest.mark.parametrize("name", ["bert", "bert-generation", "megatron-bert", "roberta"])
def test_encoder_with_an_lm_head_speculates_only_as_a_decoder(name):
    """An encoder given an LM head (`BertLMHeadModel`, ...) attends both ways unless its config says
    is_decoder=True: a verify forward would let each token see the drafts after it (a draft of the
    model itself gave other tokens than plain), so it is refused; as a decoder it matches plain."""
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    self_draft = dict(method="draft_model", draft=tiny(name, 0), num_draft_tokens=4)
    for speculative in ["ngram", self_draft]:
        with pytest.raises(ValueError, match="is_decoder=False in its config.*load it with is_decoder=True"):
            tiny(name, 0).generate(prompt, max_new_tokens=4, speculative=speculative)
    _decoded_plainly_under_auto(tiny(name, 0), prompt)
    model, weak_draft = tiny(name, 0, is_decoder=True), tiny(name, 1, is_decoder=True)
    _check(model, weak_draft, prompt)


def _decoded_plainly_under_auto(model, prompt):
    """What a named method refuses for the model itself, `speculative=True` decodes with generate's
    own loop: plain's tokens and scores, and statistics that say so."""
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain, out = model.generate(prompt, **kw), model.generate(prompt, **kw, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, plain.scores, strict=True))
    assert out.speculative_stats.method == "plain" and type(model).__name__ in out.speculative_stats.selection


def test_a_model_without_a_kv_cache_is_refused():
    """OpenAI GPT keeps no KV cache: plain generate feeds it the whole sequence each step, and fed
    only the new tokens it would see nothing before them (it crashed in a batch and gave other
    tokens than plain at batch 1), as a target or as a draft."""
    config = AutoConfig.for_model(
        "openai-gpt", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256
    )
    torch.manual_seed(0)
    gpt = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    with pytest.raises(ValueError, match="OpenAIGPTLMHeadModel keeps no KV cache"):
        gpt.generate(prompt, max_new_tokens=4, speculative="ngram")
    _decoded_plainly_under_auto(gpt, prompt)
    draft = dict(method="draft_model", draft=gpt)
    with pytest.raises(ValueError, match="The draft OpenAIGPTLMHeadModel keeps no KV cache"):
        tiny("llama", 0).generate(prompt, max_new_tokens=4, speculative=draft)


@pytest.mark.parametrize(
    "model_type, sizes",
    [
        ("cpmant", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, dim_head=16, dim_ff=128)),
        ("xlm", dict(emb_dim=64, n_layers=2, n_heads=4)),
        (
            "prophetnet",
            dict(
                hidden_size=64,
                num_encoder_layers=2,
                num_decoder_layers=2,
                num_encoder_attention_heads=4,
                num_decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
            ),
        ),
    ],
)
def test_a_model_fed_one_token_a_step_is_refused(model_type, sizes):
    """CPM-Ant and XLM work out their masks and cache sizes for one new token a step, and ProphetNet's
    decoder asserts one: fed a draft they raised a shape or assertion error from inside their
    forward, as a target or as a draft."""
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    name = type(model).__name__
    with pytest.raises(ValueError, match=f"{name} is written to be fed one new token a step"):
        model.generate(prompt, max_new_tokens=12, speculative="ngram")
    _decoded_plainly_under_auto(model, prompt)
    with pytest.raises(ValueError, match=f"The draft {name} is written to be fed one new token a step"):
        tiny("llama", 0).generate(
            prompt, max_new_tokens=12, speculative=dict(method="draft_model", draft=model)
        )


# Decoders whose forward takes no position_ids and count their cache's columns instead; a large
# init_std makes their position embeddings matter to the tokens chosen.
_COLUMN_SIZES = dict(
    d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, init_std=0.3
)
_BY_COLUMN = {
    "trocr": _COLUMN_SIZES,
    "bart": dict(_COLUMN_SIZES, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128),
    "whisper": dict(
        _COLUMN_SIZES,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    ),
}


@pytest.mark.parametrize("name", list(_BY_COLUMN))
def test_a_model_counting_cache_columns_speculates_one_row_at_a_time(name):
    """TrOCR, the BART family's and Whisper's decoders number a token by its cache column, as plain
    generate feeds them (it gives them no position_ids). The holes a batch's rejected drafts leave,
    and a tree's siblings fed side by side, moved the positions of the tokens after them (other
    tokens than plain greedy and seeded sampling), and Whisper read the positions passed through its
    kwargs (another first token than plain for a left-padded row): one row matches plain, with drafts
    rejected and without; a batch and a tree are refused."""

    def build(seed: int) -> torch.nn.Module:
        config = AutoConfig.for_model(
            name, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=None, **_BY_COLUMN[name]
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()

    model, weak_draft = build(0), build(1)
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], dim=1)
    for input_ids in [prompt, padded]:
        mask = (input_ids != 0).long()
        plain = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        for speculative in _methods(model, weak_draft).values():
            spec = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, speculative=speculative
            )
            assert torch.equal(spec, plain)
    for seed in range(3):
        torch.manual_seed(seed)
        plain = model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=20)
        torch.manual_seed(seed)
        assert torch.equal(
            model.generate(prompt, max_new_tokens=24, do_sample=True, top_k=20, speculative="ngram"), plain
        )
    batch = torch.cat([prompt, prompt.flip(1)])
    for speculative in ["ngram", dict(method="draft_model", draft=weak_draft)]:
        with pytest.raises(ValueError, match="by their place in the cache.*one sequence at a time"):
            model.generate(batch, max_new_tokens=4, speculative=speculative)
    with pytest.raises(ValueError, match="numbers its tokens by their place in the cache.*drop tree=True"):
        model.generate(prompt, max_new_tokens=4, speculative=dict(method="ngram", tree=True))
    plain = model.generate(batch, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(batch, max_new_tokens=8, do_sample=False, speculative=True), plain)


def test_gpt_neo_local_attention_speculates_one_row_at_a_time():
    """GPT-Neo's local layers attend to the last window_size cache columns whatever the mask says:
    the holes of a batch's rejected drafts took places in the window (other tokens than plain greedy
    in a batch of 2), and over a static cache the window is counted from the buffer's end (plain's
    own static output differs from its dynamic one). One row on the dynamic cache matches plain; a
    batch, a tree and a static cache are refused."""

    def build(seed: int) -> torch.nn.Module:
        config = AutoConfig.for_model(
            "gpt_neo",
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            initializer_range=0.3,
            bos_token_id=1,
            eos_token_id=None,
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()

    model, weak_draft = build(0), build(1)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1)).repeat(1, 2)
    _check(model, weak_draft, prompt)
    batch = torch.cat([prompt, prompt.flip(1)])
    with pytest.raises(ValueError, match="local attention window .* cache columns.*one sequence at a"):
        model.generate(batch, max_new_tokens=4, speculative="ngram")
    with pytest.raises(ValueError, match="local attention window .* in cache columns.*drop tree=True"):
        model.generate(prompt, max_new_tokens=4, speculative=dict(method="ngram", tree=True))
    with pytest.raises(ValueError, match="counts its window back from the last column.*dynamic cache"):
        model.generate(prompt, max_new_tokens=4, cache_implementation="static", speculative="ngram")
    plain = model.generate(batch, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(batch, max_new_tokens=8, do_sample=False, speculative=True), plain)


def test_a_model_recording_one_recurrent_state_a_forward_is_refused(monkeypatch):
    """Zaya hands its cache the recurrent state after a forward's last token only, where a rolled-back
    draft needs the state after each token: rejecting one draft token restored the state from before
    the whole forward (other tokens than plain greedy, silently), rejecting more raised an IndexError
    from inside transformers' cache.crop. Refused before the call (a model not declared so: at its
    first forward of several tokens); `speculative=True` decodes it plainly."""

    def build(seed: int) -> torch.nn.Module:
        config = AutoConfig.for_model(
            "zaya",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            max_position_embeddings=256,
            initializer_range=0.3,
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).eval()

    model = build(0)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 2)
    one_token = dict(method="draft_model", draft=build(1), num_draft_tokens=1)
    refused = "ZayaForCausalLM's recurrent layers keep one state a forward"
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args: fed.append(1))
    with pytest.raises(ValueError, match=refused):
        model.generate(prompt, max_new_tokens=24, speculative="ngram")
    assert not fed
    hook.remove()
    _decoded_plainly_under_auto(model, prompt)
    # Any other model recording so is refused at its first forward of several tokens.
    monkeypatch.delitem(hf_specdec.core.checks._CANNOT_ROLL_BACK, "zaya")
    for speculative in [one_token, "ngram"]:
        with pytest.raises(ValueError, match=refused):
            model.generate(prompt, max_new_tokens=24, speculative=speculative)


def test_a_model_keeping_its_recurrent_state_in_its_layers_is_refused():
    """RecurrentGemma keeps its recurrent blocks' state in the blocks themselves, not in the cache:
    the first rolled-back draft raised a TypeError from inside transformers' cache (as a target or as
    a draft), and nothing could have restored the state. Refused before anything runs."""
    config = AutoConfig.for_model(
        "recurrent_gemma",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        lru_width=64,
        attention_window_size=8,
        block_types=["recurrent", "attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).repeat(1, 3)
    with pytest.raises(ValueError, match="RecurrentGemmaForCausalLM keeps its recurrent state in its own"):
        model.generate(prompt, max_new_tokens=8, speculative="ngram")
    with pytest.raises(ValueError, match="The draft RecurrentGemmaForCausalLM keeps its recurrent state"):
        tiny("llama", 0).generate(
            prompt, max_new_tokens=8, speculative=dict(method="draft_model", draft=model)
        )
