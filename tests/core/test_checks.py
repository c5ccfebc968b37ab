"""Every unsupported combination fails with a clear error that says what to do instead; and
`speculative=False/None` (or no `speculative=` at all) is plain `generate`."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BloomConfig,
    BloomForCausalLM,
    BltConfig,
    BltForCausalLM,
    DynamicCache,
    FalconConfig,
    FalconForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
    StaticCache,
    SynthIDTextWatermarkingConfig,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.generation.streamers import BaseStreamer

from hf_specdec import SpeculativeConfig
from hf_specdec.core.compat import cache_argument
from hf_specdec.integration import _ORIGINAL_GENERATE

from ..conftest import random_batch, tiny_llama


class _ListStreamer(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value)

    def end(self):
        pass


@pytest.fixture(scope="module")
def small_vocab_draft():
    return tiny_llama(3, vocab_size=48)


NGRAM = dict(method="ngram")


def _cases(target, small_vocab_draft):
    """name -> (generate kwargs, error type, regex the message must match)."""
    return {
        "unknown_method": (
            dict(speculative="lookahead"),
            ValueError,
            r"Unknown speculative method 'lookahead'; valid methods: .*draft_model.*eagle.*medusa.*ngram",
        ),
        "unknown_dict_key": (
            dict(speculative=dict(method="ngram", num_tokens=3)),
            ValueError,
            r"Unknown key\(s\) \['num_tokens'\].*valid keys are",
        ),
        "unknown_option": (
            dict(speculative=dict(method="ngram", options=dict(ngram_size=3))),
            ValueError,
            r"Unknown option\(s\) \['ngram_size'\] for NgramConfig; valid",
        ),
        "bad_ngram_sizes": (
            dict(speculative=dict(method="ngram", options=dict(min_ngram=3, max_ngram=2))),
            ValueError,
            r"1 <= min_ngram <= max_ngram",
        ),
        "bad_speculative_type": (
            dict(speculative=3.5),
            TypeError,
            r"must be True, False, None, a method name",
        ),
        "num_beams": (
            dict(speculative=NGRAM, num_beams=2),
            ValueError,
            r"cannot be combined with beam search.*num_beams=1",
        ),
        "assistant_model": (
            dict(speculative=NGRAM, assistant_model=small_vocab_draft),
            ValueError,
            r"`assistant_model` cannot be combined with `speculative=`.*method='draft_model'",
        ),
        "custom_generate": (  # was told to pass its assistant as a draft model
            dict(speculative=NGRAM, custom_generate="org/decoding-loop"),
            ValueError,
            r"`custom_generate` cannot be combined with `speculative=`: both replace generate's decoding "
            r"loop.*Drop custom_generate= for speculative decoding, or drop speculative=",
        ),
        "prompt_lookup": (
            dict(speculative=NGRAM, prompt_lookup_num_tokens=3),
            ValueError,
            r"`prompt_lookup_num_tokens` cannot be combined with `speculative=`.*speculative='ngram'",
        ),
        "prompt_lookup_in_a_generation_config": (  # ran ngram instead without a word
            dict(speculative=NGRAM, generation_config=GenerationConfig(prompt_lookup_num_tokens=5)),
            ValueError,
            r"`prompt_lookup_num_tokens` cannot be combined with `speculative=` \(it is 5, in generate's",
        ),
        "assistant_early_exit": (
            dict(speculative=NGRAM, assistant_early_exit=1),
            ValueError,
            r"`assistant_early_exit` cannot be combined with `speculative=`",
        ),
        "use_mtp": (  # drafted greedily with ngram instead, without a word
            dict(speculative=NGRAM, use_mtp=True),
            ValueError,
            r"`use_mtp` cannot be combined with `speculative=`.*speculative=True drafts with the model's own "
            r"multi-token-prediction layers.*speculative='mtp'",
        ),
        "use_mtp_in_a_generation_config": (
            dict(speculative=True, generation_config=GenerationConfig(use_mtp=True, max_new_tokens=4)),
            ValueError,
            r"`use_mtp` cannot be combined with `speculative=` \(it is True, in generate's arguments",
        ),
        # Modes transformers now runs from the Hub: with our custom_generate loop they decoded greedily.
        "contrastive_search": (
            dict(speculative=NGRAM, penalty_alpha=0.6, top_k=4),
            ValueError,
            r"not by contrastive search \(penalty_alpha=0\.6, top_k=4, in generate's arguments.*"
            r"Drop penalty_alpha= for speculative decoding, or drop speculative= for contrastive search",
        ),
        "dola": (
            dict(speculative=NGRAM, dola_layers="high"),
            ValueError,
            r"not by DoLa decoding \(dola_layers='high'.*Drop dola_layers=",
        ),
        "dola_sampled": (
            dict(speculative=NGRAM, dola_layers="low", do_sample=True),
            ValueError,
            r"not by DoLa decoding \(dola_layers='low'",
        ),
        "force_words": (
            dict(speculative=NGRAM, force_words_ids=[[7, 8]]),
            ValueError,
            r"not by constrained beam search \(force_words_ids, in.*Drop force_words_ids= / constraints=",
        ),
        "constraints": (  # transformers 5 keeps the field; the constraint classes went to the Hub repo
            dict(speculative=NGRAM, constraints=[[7, 8]]),
            ValueError,
            r"not by constrained beam search \(constraints, in",
        ),
        "classifier_free_guidance": (  # its unconditional cache went on from rejected drafts: wrong text
            dict(speculative=NGRAM, guidance_scale=2.0),
            ValueError,
            r"cannot be combined with UnbatchedClassifierFreeGuidanceLogitsProcessor, which keeps state.*"
            r"drop guidance_scale=",
        ),
        "synthid_watermark": (  # keeps the last tokens it was shown: rejected drafts among them
            dict(
                speculative=NGRAM,
                watermarking_config=SynthIDTextWatermarkingConfig(keys=[654, 400, 836], ngram_len=2),
            ),
            ValueError,
            r"cannot be combined with SynthIDTextWatermarkLogitsProcessor.*drop watermarking_config=",
        ),
        "static_cache_too_small": (
            dict(speculative=NGRAM, cache="static_small"),
            ValueError,
            r"The static cache holds 5 positions, and this call needs \d+: the prompt \(\d+\) \+ "
            r"max_new_tokens \(4\) - 1\. Pass max_cache_len=\d+ \(or more\)",
        ),
        "static_cache_tree": (
            dict(speculative=dict(method="ngram", tree=True), cache_implementation="static"),
            ValueError,
            r"Tree drafts over a static cache are not built yet; drop tree=True",
        ),
        "static_cache_hidden_states": (
            dict(
                speculative=NGRAM,
                cache_implementation="static",
                return_dict_in_generate=True,
                output_hidden_states=True,
            ),
            ValueError,
            r"does not return attentions or hidden states over a static cache; drop",
        ),
        "offloaded_cache": (  # a DynamicCache(offloading=True) was let through, unlike the static one
            dict(speculative=NGRAM, cache_implementation="offloaded"),
            ValueError,
            r"does not support an offloaded cache \(offloading=True / cache_implementation='offloaded' or "
            r"'offloaded_static'\); use the default cache or cache_implementation='static'",
        ),
        "offloaded_static_cache": (
            dict(speculative=NGRAM, cache_implementation="offloaded_static"),
            ValueError,
            r"does not support an offloaded cache",
        ),
        "quantized_cache": (  # its quantized blocks cannot be cropped after a rejected draft
            dict(speculative=NGRAM, cache_implementation="quantized", cache_config={"backend": "fp8"}),
            ValueError,
            r"needs a DynamicCache or a StaticCache it can roll back, got QuantizedCache",
        ),
        "filled_cache_without_new_tokens": (
            dict(speculative=NGRAM, cache="filled"),
            ValueError,
            r"to continue a conversation, pass input_ids holding the cached tokens followed by at least one",
        ),
        "streamer_batch": (
            dict(speculative=NGRAM, streamer="batch"),
            ValueError,
            r"stream with batch size 1, or drop streamer=",
        ),
        "draft_model_without_draft": (
            dict(speculative=dict(method="draft_model")),
            ValueError,
            r"method='draft_model' needs a draft: .*draft=",
        ),
        "draft_folder_missing": (
            dict(speculative=dict(method="draft_model", draft="/no/such/folder")),
            FileNotFoundError,
            r"draft='/no/such/folder' is not a folder that exists, nor a Hub repo id",
        ),
        "draft_vocab_mismatch": (
            dict(speculative=dict(method="draft_model", draft=small_vocab_draft)),
            ValueError,
            r"vocabulary has 48 entries but the target's has 64.*without the target's \(`tokenizer=`"
            r".* the draft's \(`draft_tokenizer=`",
        ),
        "unforwarded_model_input": (
            dict(speculative=NGRAM, output_router_logits=True),
            ValueError,
            r"would not pass 'output_router_logits' to the model: drop it, or use plain generate",
        ),
        "stop_strings_without_tokenizer": (
            dict(speculative=NGRAM, stop_strings=["x"]),
            ValueError,
            r"stop_strings need the tokenizer: pass tokenizer=",
        ),
        "use_cache_false": (
            dict(speculative=NGRAM, use_cache=False),
            ValueError,
            r"needs the KV cache, which this call's generation config turns off.*pass use_cache=True",
        ),
    }


CASE_NAMES = list(_cases(None, None))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_clear_error(target, small_vocab_draft, name):
    kwargs, error, message = _cases(target, small_vocab_draft)[name]
    batch = 2 if name == "streamer_batch" else 1
    input_ids, attention_mask = random_batch(0, batch)
    if kwargs.get("streamer") == "batch":
        kwargs["streamer"] = _ListStreamer()
    if kwargs.get("cache") == "filled":
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(input_ids=input_ids, cache=cache, use_cache=True)
        kwargs["cache"] = cache
    if kwargs.get("cache") == "static_small":
        kwargs["cache"] = StaticCache(config=target.config, max_cache_len=5)
    if kwargs.get("cache_implementation", "").startswith("offloaded"):
        try:  # transformers' offloaded caches open a stream before our check, in plain generate too
            torch.Stream()
        except RuntimeError as error_there:  # a CUDA build of torch on a machine without a GPU
            pytest.skip(f"this torch cannot open a stream, so plain generate fails too: {error_there}")
    with pytest.raises(error, match=message):
        target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "fast", None])
def test_bad_num_draft_tokens(target, bad):
    input_ids, attention_mask = random_batch(0, 1)
    with pytest.raises(ValueError, match=r"`num_draft_tokens` must be a positive integer.*got"):
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            speculative=dict(method="ngram", num_draft_tokens=bad),
        )
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(num_draft_tokens=bad)


def test_bad_method_type():
    with pytest.raises(TypeError, match="`method` must be a string"):
        SpeculativeConfig(method=3)


def test_streamer_with_one_row_is_fine(target):
    input_ids, attention_mask = random_batch(0, 1)
    streamer = _ListStreamer()
    out = target.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=6,
        speculative=NGRAM,
        streamer=streamer,
    )
    streamed = torch.cat([c.reshape(-1) for c in streamer.chunks[1:]])  # chunk 0 is the prompt
    assert torch.equal(streamed, out[0, input_ids.shape[1] :])


def test_a_streamer_given_by_position_is_found_by_name(target):
    """generate(inputs, generation_config, logits_processor, stopping_criteria,
    prefix_allowed_tokens_fn, synced_gpus, assistant_model, streamer): bound by generate's signature."""
    input_ids, attention_mask = random_batch(0, 1)
    streamer = _ListStreamer()
    positional = (input_ids, None, None, None, None, None, None, streamer)
    out = target.generate(*positional, attention_mask=attention_mask, max_new_tokens=6, speculative=NGRAM)
    streamed = torch.cat([c.reshape(-1) for c in streamer.chunks[1:]])
    assert torch.equal(streamed, out[0, input_ids.shape[1] :])
    batch, batch_mask = random_batch(0, 2)
    with pytest.raises(ValueError, match="stream with batch size 1, or drop streamer="):
        target.generate(
            batch, *positional[1:], attention_mask=batch_mask, max_new_tokens=6, speculative=NGRAM
        )


@pytest.mark.parametrize(
    "options",
    [dict(use_mtp=False), dict(penalty_alpha=0.6, top_k=1), dict(dola_layers=None)],
    ids=["use_mtp_false", "penalty_alpha_top_k_1", "dola_layers_none"],
)
def test_options_that_leave_greedy_decoding_are_not_refused(target, options):
    """The mode refusals read transformers' own mode: these options select greedy decoding."""
    input_ids, attention_mask = random_batch(1, 2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    plain = _ORIGINAL_GENERATE(target, **kwargs, **options)
    assert torch.equal(target.generate(**kwargs, **options, speculative=NGRAM), plain)


@pytest.mark.parametrize("off", [False, None])
def test_speculative_off_is_plain_generate(target, off):
    input_ids, attention_mask = random_batch(1, 3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    plain = _ORIGINAL_GENERATE(target, **kwargs)
    out = target.generate(**kwargs, speculative=off, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert getattr(out, "speculative_stats", None) is None
    assert type(out).__name__ != "SpeculativeGenerateOutput"


def test_generate_without_speculative_is_unaffected(target):
    input_ids, attention_mask = random_batch(2, 2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(**kwargs), _ORIGINAL_GENERATE(target, **kwargs))
    # Options speculative decoding refuses still work without it.
    beams = target.generate(**kwargs, num_beams=2)
    assert torch.equal(beams, _ORIGINAL_GENERATE(target, **kwargs, num_beams=2))
    no_cache = target.generate(**kwargs, use_cache=False)
    assert torch.equal(no_cache[:, : input_ids.shape[1]], input_ids)


class _NoTrim:
    def draft_length(self, batch_size):
        return 2

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds):
        pass

    def expect_draft_cost(self, seconds_per_token):
        pass


class _OnlyTrim:
    def trim(self, draft, batch_size, remaining=None):
        return draft


@pytest.mark.parametrize(
    "policy,missing",
    [(_NoTrim(), r"\['trim'\]"), (_OnlyTrim(), r"\['draft_length', 'update', 'expect_draft_cost'\]")],
)
def test_incomplete_policy_is_refused_up_front(policy, missing):
    """A policy object missing part of the protocol used to pass validation and crash mid-generate."""
    with pytest.raises(
        TypeError, match=rf"_\w+ lacks {missing}.*draft_length, trim, update and expect_draft_cost"
    ):
        SpeculativeConfig(method="ngram", policy=policy)


def test_policy_methods_checked_are_the_protocols():
    from hf_specdec.config import OPTIONAL_POLICY_METHODS, POLICY_METHODS
    from hf_specdec.core.policy import DraftLengthPolicy

    declared = {name for name in vars(DraftLengthPolicy) if not name.startswith("_")}
    assert set(POLICY_METHODS) | set(OPTIONAL_POLICY_METHODS) == declared


class _Fixed(_NoTrim):
    def trim(self, draft, batch_size, remaining=None):
        return draft


def test_a_policy_without_the_optional_methods_generates(target):
    """A policy object that does not subclass DraftLengthPolicy (the four required methods only)
    runs with the base class's defaults for the others."""
    input_ids, attention_mask = random_batch(2, 2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    out = target.generate(**kwargs, speculative=SpeculativeConfig(method="ngram", policy=_Fixed()))
    assert torch.equal(out, _ORIGINAL_GENERATE(target, **kwargs))


def test_empty_prompt(target):
    """An empty prompt used to die in a reshape inside the model."""
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"prompt is empty \(input_ids of shape \[1, 0\]\).*at least one token"
    ):
        target.generate(input_ids=empty, max_new_tokens=4, speculative=NGRAM)


def test_use_cache_off_in_the_models_generation_config_names_the_remedy():
    """Set off on the model's own generation config, not in the call, the KV cache's refusal said to
    remove a use_cache=False the user never passed; use_cache=True in the call speculates."""
    model = tiny_llama(0)
    model.generation_config.use_cache = False
    input_ids, attention_mask = random_batch(0, 2)
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    with pytest.raises(
        ValueError, match=r"generation config, the model's own included\): pass use_cache=True"
    ):
        model.generate(**kw, speculative=NGRAM)
    plain = model.generate(**kw, use_cache=True)
    assert torch.equal(model.generate(**kw, use_cache=True, speculative=NGRAM), plain)


@pytest.mark.parametrize("draft", ["/no/such/folder", "./models/none", "~/none/such/draft"])
def test_missing_draft_folder_is_named_up_front(draft):
    with pytest.raises(FileNotFoundError, match=r"not a folder that exists, nor a Hub repo id"):
        SpeculativeConfig(method="draft_model", draft=draft)


def test_a_chunked_prefill_is_named_as_not_honoured(target):
    """`prefill_chunk_size` bounds plain generate's prefill memory; speculative= prefills in one forward:
    said, not dropped without a word, and the output stays plain's."""
    input_ids, attention_mask = random_batch(0, 2)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, prefill_chunk_size=4)
    plain = target.generate(input_ids, **kwargs)
    with pytest.warns(UserWarning, match="prefill_chunk_size=4 is not honoured"):
        ours = target.generate(input_ids, **kwargs, speculative="ngram")
    assert torch.equal(ours, plain)


@pytest.mark.parametrize(
    "given, named",
    [
        (
            dict(num_assistant_tokens=7, max_new_tokens=8),
            r"num_assistant_tokens=7: speculative=\{'num_draft_tokens': <n>\}",
        ),
        (
            dict(speculation_type="dflash", max_new_tokens=8),
            r"speculation_type='dflash': speculative='dflash' with draft=",
        ),
        (
            dict(generation_config=GenerationConfig(assistant_confidence_threshold=0.2, max_new_tokens=8)),
            r"assistant_confidence_threshold=0.2: options=\{'min_confidence': <p>\}",
        ),
    ],
    ids=["num_assistant_tokens", "speculation_type", "in_a_generation_config"],
)
def test_assisted_decoding_settings_are_named_as_not_read(target, given, named):
    """Settings only transformers' assisted decoding reads were dropped without a word beside
    speculative=: now a warning names each with what sets the same thing here; the output stays
    plain's, and plain generate (which ignores them without assistant_model=) is left alone."""
    import warnings

    input_ids, attention_mask = random_batch(0, 2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **given)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plain generate: nothing said
        plain = target.generate(**kwargs)
    with pytest.warns(UserWarning, match=r"(?s)assisted decoding .* does not read.*" + named):
        ours = target.generate(**kwargs, speculative="ngram")
    assert torch.equal(ours, plain)


@pytest.fixture(scope="module")
def rwkv():
    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64
    )
    return RwkvForCausalLM(config).eval()


def test_a_model_with_a_state_of_its_own_is_refused(rwkv, target):
    """RWKV takes `state=`, not a cache: fed a cache, it would swallow it and see only the tokens fed
    (transformers 5.25 dropped the `_is_stateful` that said so; its own rule names such models). As a
    target and as a draft, refused before anything is generated."""
    prompt = torch.tensor([[5, 17, 23, 5, 17, 23, 5, 17]])
    for speculative in ("ngram", dict(method="draft_model", draft=rwkv)):
        with pytest.raises(ValueError, match="RwkvForCausalLM keeps its state in a cache of its own.*drop"):
            rwkv.generate(prompt, max_new_tokens=4, speculative=speculative)
    plain = rwkv.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(rwkv.generate(prompt, max_new_tokens=4, do_sample=False, speculative=True), plain)
    with pytest.raises(ValueError, match="The draft RwkvForCausalLM .* use a draft model with an attention"):
        target.generate(prompt, max_new_tokens=4, speculative=dict(method="draft_model", draft=rwkv))


def test_a_model_keeping_its_past_in_a_cache_of_its_own_is_refused():
    """BLT wraps the cache it is given in an `EncoderDecoderCache` of its own each forward, whose other
    part holds its local decoder's past: kept nowhere we roll back, it would be lost every step (a
    crash, or other tokens than plain's). Refused after the prompt's forward (transformers' own tests'
    tiny BLT)."""
    layers = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=32, max_position_embeddings=32, rope_parameters={"rope_type": "default"},
    )  # fmt: skip
    config = BltConfig(
        vocab_size=32, max_position_embeddings=32, patch_in_forward=False, patch_size=4, cross_attn_k=2,
        encoder_hash_byte_group_size=[2, 3], encoder_hash_byte_group_vocab=64, patcher_config=dict(layers),
        encoder_hash_byte_group_nb_functions=1, encoder_config=dict(layers),
        decoder_config=dict(layers, vocab_size=32, hidden_size_global=32),
        global_config=dict(layers, hidden_size=32), rope_parameters={"rope_type": "default"},
    )  # fmt: skip
    config.num_attention_heads, config.num_hidden_layers, config.hidden_size = 2, 1, 16
    torch.manual_seed(0)
    model = BltForCausalLM(config).eval()
    prompt = torch.tensor([[3, 5, 7, 3, 5, 7, 3]])
    with pytest.raises(ValueError, match="BltForCausalLM keeps its past in a cache of its own"):
        model.generate(prompt, max_new_tokens=4, pad_token_id=0, speculative=dict(method="ngram"))


class _LogitBias(LlamaForCausalLM):
    """A user's subclass whose forward names nothing and passes everything on to its parent's."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits[..., 7] += 3.0
        return out


class _NamedLogitBias(LlamaForCausalLM):
    """A user's subclass whose forward names some parameters and passes the rest, the cache among
    them, on through `**kwargs`."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        out.logits[..., 7] += 3.0
        return out


class _DroppedCache(LlamaForCausalLM):
    """A forward that takes `**kwargs` but drops the cache they bring: plain generate finds the cache
    still empty after each forward and feeds the whole sequence again."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        kept = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "use_cache")}
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kept)


class _OwnCacheEachForward(LlamaForCausalLM):
    """Drops the cache it is given, so its parent builds one of its own each forward (which plain
    generate then passes it, to be dropped again)."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        kept = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kept)


def _copy_of(target, cls):
    model = cls(target.config).eval()
    model.load_state_dict(target.state_dict())
    return model


@pytest.mark.parametrize("cls", [_LogitBias, _NamedLogitBias], ids=["args_kwargs", "named_and_kwargs"])
def test_a_subclass_forward_passing_the_cache_on_speculates_through_its_own_forward(target, cls):
    """A forward(*args, **kwargs), or one naming some parameters beside `**kwargs`, takes the cache
    its parent's takes and passes it on, and plain generate fills it; each was refused as keeping
    no KV cache (speculative=True decoded it plainly). Its own forward, logit bias and all, is what
    the loop verifies with, greedy and seeded sampling."""
    model = _copy_of(target, cls)
    assert cache_argument(model) == "cache"  # its parent's name, which plain generate passes
    prompt = torch.tensor([[9, 17, 23, 7, 9, 17, 23, 7, 9]])
    plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert not torch.equal(plain, target.generate(prompt, max_new_tokens=12, do_sample=False))
    for speculative in ("ngram", True):
        out = model.generate(
            prompt, max_new_tokens=12, do_sample=False, speculative=speculative, return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method != "plain" and out.speculative_stats.drafted > 0
    sampled = dict(max_new_tokens=12, do_sample=True, top_k=0)
    torch.manual_seed(3)
    plain = model.generate(prompt, **sampled)
    torch.manual_seed(3)
    out = model.generate(prompt, **sampled, speculative="ngram", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.speculative_stats.drafted > 0


@pytest.mark.parametrize(
    "cls, cache_implementation",
    # (plain generate itself fails for `_DroppedCache` over a static cache: its 4D mask spans the cache)
    [(_DroppedCache, None), (_OwnCacheEachForward, None), (_OwnCacheEachForward, "static")],
)
def test_a_forward_dropping_the_cache_its_kwargs_bring_is_refused_and_auto_decodes_it_plainly(
    target, cls, cache_implementation
):
    """Its signature is the good subclass's; only the prompt's forward tells: the cache passed is
    left empty. Named methods refuse it; speculative=True decodes it plainly, plain's output, its
    samples too."""
    model = _copy_of(target, cls)
    prompt = torch.tensor([[9, 17, 23, 7, 9, 17, 23, 7, 9]])
    for sampled in (dict(do_sample=False), dict(do_sample=True, top_k=0)):
        kw = dict(max_new_tokens=12, cache_implementation=cache_implementation, **sampled)
        torch.manual_seed(5)
        plain = model.generate(prompt, **kw)
        torch.manual_seed(5)
        out = model.generate(prompt, **kw, speculative=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == "plain"
        assert f"{cls.__name__} did not keep" in out.speculative_stats.selection
    with pytest.raises(ValueError, match=f"{cls.__name__} did not keep .*pass them on to it"):
        model.generate(
            prompt, max_new_tokens=12, cache_implementation=cache_implementation, speculative="ngram"
        )


def test_a_draft_forward_passing_kwargs_on_drafts_and_one_dropping_the_cache_is_refused(target, weak_draft):
    """As drafts: the subclass passing the cache on drafts (it was refused as keeping no KV cache);
    the one dropping it is refused at its first forward, under auto too (tokens are out by then)."""
    prompt = torch.tensor([[9, 17, 23, 7, 9, 17, 23, 7, 9]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    for method in ("draft_model", "auto"):
        speculative = dict(method=method, draft=_copy_of(weak_draft, _NamedLogitBias), num_draft_tokens=3)
        out = target.generate(
            prompt, max_new_tokens=12, do_sample=False, speculative=speculative, return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == "draft_model" and out.speculative_stats.drafted > 0
        speculative = dict(method=method, draft=_copy_of(weak_draft, _DroppedCache))
        with pytest.raises(
            ValueError, match="_DroppedCache did not keep .*another model, if this one is the draft"
        ):
            target.generate(prompt, max_new_tokens=12, do_sample=False, speculative=speculative)


def _training_with_dropout(kind: str) -> torch.nn.Module:
    if kind == "gpt2":  # dropout layers, at the rates GPT-2's config ships
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=5)
        torch.manual_seed(0)
        return GPT2LMHeadModel(config).train()
    model = tiny_llama(0)  # a rate its attention reads
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return model.train()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_target_in_training_mode_with_dropout_decodes_plainly_under_auto_and_named_methods_refuse(kind):
    """Left in training mode (a model mid fine-tuning), each forward draws dropout: plain's output is
    one of its draws, which verify forwards of several tokens cannot reproduce. It speculated, and
    differed from plain with the same seed."""
    model = _training_with_dropout(kind)
    prompt = torch.tensor([[9, 17, 23, 9, 17, 23, 9, 17]])
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    torch.manual_seed(0)
    plain = model.generate(prompt, **kw)
    torch.manual_seed(0)
    out = model.generate(prompt, **kw, speculative=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.method == "plain"
    assert "training mode with dropout" in out.speculative_stats.selection
    with pytest.raises(ValueError, match="is in training mode with dropout .*Call model.eval"):
        model.generate(prompt, **kw, speculative="ngram")
    assert model.training  # left as given


def test_a_target_quantizing_activations_per_forward_decodes_plainly_under_auto_and_named_methods_refuse():
    """`torch.ao.quantization.quantize_dynamic` gives each Linear one activation scale for all the
    tokens of a forward (and every row of the batch): a verify forward of several tokens scales
    each token otherwise than plain's one-token forwards, and its greedy output differed from
    plain's by scores far past fp32 rounding (0.18 below the best at generated token 4, bound 6e-4)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        model = torch.ao.quantization.quantize_dynamic(tiny_llama(1), {torch.nn.Linear}, dtype=torch.qint8)
    prompt = torch.tensor([[9, 17, 23, 9, 17, 23, 9, 17]])
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    plain = model.generate(prompt, **kw)
    out = model.generate(prompt, **kw, speculative=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.method == "plain"
    assert "quantizes its inputs with one scale per forward" in out.speculative_stats.selection
    with pytest.raises(
        ValueError, match="model.layers.0.self_attn.q_proj.*quantizes its inputs.*Quantize the weights only"
    ):
        model.generate(prompt, **kw, speculative=dict(method="ngram", num_draft_tokens=3))


def test_torchao_activations_quantized_per_tensor_are_refused_and_per_row_ones_speculate():
    """torchao's dynamic int8 activations scale each forward's inputs as a whole with
    `granularity=PerTensor()` (refused as `quantize_dynamic` is: greedy output differed from plain's
    by up to 1.3 in the scores, bound 5e-4), and each token by its own with the default `PerRow()`."""
    quantization = pytest.importorskip("torchao.quantization")
    from torchao.quantization.granularity import PerTensor

    models = {}
    for granularity in ("per_tensor", "per_row"):
        models[granularity] = tiny_llama(1)
        fields = dict(granularity=PerTensor()) if granularity == "per_tensor" else {}
        quantization.quantize_(
            models[granularity], quantization.Int8DynamicActivationInt8WeightConfig(**fields)
        )
    prompt = torch.tensor([[9, 17, 23, 9, 17, 23, 9, 17]])
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with pytest.raises(
        ValueError, match="model.layers.0.self_attn.q_proj quantizes its inputs with one scale"
    ):
        models["per_tensor"].generate(prompt, **kw, speculative="ngram")
    out = models["per_row"].generate(prompt, **kw, speculative="ngram", return_dict_in_generate=True)
    assert out.speculative_stats.method == "ngram"


@pytest.mark.parametrize("alibi", ["bloom", "falcon"])
def test_trees_through_alibi_biases_are_refused(alibi):
    """BLOOM and Falcon with `alibi` build their position biases from a 2D mask: a tree's 4D mask
    cannot reach them (their own code failed on it with an unpacking error)."""
    torch.manual_seed(0)
    if alibi == "bloom":
        model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)).eval()
    else:
        shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        model = FalconForCausalLM(FalconConfig(**shape, alibi=True)).eval()
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    with pytest.raises(ValueError, match="ALiBi position biases from a 2D attention mask.*drop tree=True"):
        model.generate(prompt, max_new_tokens=4, speculative=dict(method="ngram", tree=True))
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False)
    for chains in ("ngram", dict(method="ngram", tree="auto")):  # tree="auto": chains, not a refusal
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, speculative=chains)
        assert torch.equal(out, plain)


def test_token_healing_of_an_encoder_decoder_is_refused_saying_why(smollm2_path):
    """generate heals the ids it continues, an encoder-decoder's decoder start ids rather than its
    prompt (transformers' own healing fails on them): refused by name, not healed on the prompt."""
    from transformers import AutoTokenizer

    model, inputs = _encoder_decoders()["bart"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    with pytest.raises(ValueError, match="token_healing heals .* an encoder-decoder.*drop token_healing="):
        model.generate(**inputs, max_new_tokens=2, token_healing=True, tokenizer=tokenizer, speculative=True)


def _encoder_decoders() -> dict[str, tuple[torch.nn.Module, dict]]:
    """Tiny random T5, BART and Whisper (Whisper's own `generate` calls generate's), with their inputs."""
    torch.manual_seed(0)
    t5_sizes = dict(d_model=16, d_ff=32, d_kv=4, num_layers=1, num_heads=2, decoder_start_token_id=0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, **t5_sizes))
    sizes = dict(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, max_position_embeddings=64, **sizes))
    audio = dict(num_mel_bins=8, max_source_positions=25, max_target_positions=32)
    whisper = WhisperForConditionalGeneration(WhisperConfig(vocab_size=64, **audio, **sizes))
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7], [9, 8, 7, 6, 5, 9, 8, 7]])
    features = torch.randn(2, 8, 50, generator=torch.Generator().manual_seed(1))
    return {
        "t5": (t5.eval(), dict(input_ids=ids)),
        "bart": (bart.eval(), dict(input_ids=ids)),
        "whisper": (whisper.eval(), dict(input_features=features)),
    }


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_an_encoder_decoder_target_is_decoded_plainly_under_auto_and_refused_by_a_named_method(name):
    """speculative= verifies drafts for decoder-only models. `speculative=True` on an encoder-decoder
    (a summarizer, a translator, Whisper) was refused, where it promises plain decoding's output at no
    less than its speed: it now decodes with generate's own loop, output for output (Whisper's
    generation config, which holds transformers' default for every field, draws no warning about
    assisted-decoding settings); a named method still refuses, saying what to do."""
    import warnings

    model, inputs = _encoder_decoders()[name]
    kwargs = dict(inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(**kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*assisted decoding")
        out = model.generate(**kwargs, speculative=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, plain.scores, strict=True))
    name = type(model).__name__
    with pytest.raises(
        ValueError,
        match=f"{name} is an encoder-decoder model, and speculative= verifies decoder-only models.*: "
        r"drop speculative= for it \(speculative=True decodes it plainly\)",
    ):
        model.generate(**inputs, max_new_tokens=2, speculative="ngram")


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(force_words_ids=[[7, 8]]), r"not by constrained beam search \(force_words_ids, in"),
        (
            dict(num_beam_groups=2, diversity_penalty=1.0),
            r"not by group beam search \(num_beam_groups=2, diversity_penalty=1\.0, in"
            r".*Drop num_beam_groups=",
        ),
    ],
)
@pytest.mark.parametrize("speculative", [True, NGRAM])
def test_beam_search_modes_run_from_the_hub_are_refused_not_decoded_as_beam_search(
    target, given, message, speculative
):
    """Constrained and group beam search (num_beams > 1) are Hub code plain generate runs only with
    trust_remote_code: refused by auto too, which would otherwise decode them as plain beam search,
    their constraints or groups dropped without a word."""
    input_ids, attention_mask = random_batch(0, 2)
    with pytest.raises(ValueError, match=message):
        target.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=4,
            num_beams=4,
            speculative=speculative,
            **given,
        )
