"""Capabilities checked before generating, each with an error that says what to do instead."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StaticCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)
from transformers.generation import GenerationMixin, GenerationMode, logits_process
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
)

from .compat import forward_cache_argument, generate_cache, takes_dynamic_cache
from .inputs import cached_columns, forwarded_refusal, plain_feeds_otherwise, positions_refusal
from .kv import holds_holes, mark_holes, rotary_refusal, sliding_refusal, windows_by_column
from .static_kv import layers_refusal

# Cache layers a filled cache may hold to be continued: full attention, recurrent states (rolled back
# as `kv.RaggedKV` records them), and the placeholders of layers that cache nothing.
_CONTINUED_LAYERS = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer, DummyLayer)

# Generation-config fields that select transformers' assisted decoding, and what to do instead.
_ASSISTED_DECODING = {
    "prompt_lookup_num_tokens": "speculative='ngram' drafts by prompt lookup (num_draft_tokens=<n> for a "
    "fixed length); or drop speculative=.",
    "assistant_early_exit": "Drop one of them.",
    "use_mtp": "speculative=True drafts with the model's own multi-token-prediction layers where its "
    "checkpoint has them (speculative='mtp' to insist on them); or drop speculative=.",
}

# Generation-config fields that only transformers' assisted decoding reads: without
# `assistant_model=` plain `generate` ignores them, and so does `speculative=`, which says what
# sets the same thing here.
_ASSISTANT_SETTINGS = {
    "num_assistant_tokens": "speculative={'num_draft_tokens': <n>} fixes the draft length "
    "(by default it is adapted each step)",
    "num_assistant_tokens_schedule": "speculative= adapts the draft length each step by default; "
    "speculative={'num_draft_tokens': <n>} fixes it",
    "assistant_confidence_threshold": "options={'min_confidence': <p>} stops a draft model's greedy "
    "draft below that confidence",
    "max_matching_ngram_size": "speculative={'method': 'ngram', 'options': {'max_ngram': <n>}} sets "
    "prompt lookup's longest match",
    "assistant_lookbehind": "speculative= aligns a draft of another tokenizer itself "
    "(options={'translation': ...})",
    "target_lookbehind": "speculative= aligns a draft of another tokenizer itself "
    "(options={'translation': ...})",
    "assistant_ensemble_weight": "speculative= verifies against the target's own distribution "
    "(lossless), never a mixture with the draft's",
    "speculation_type": "speculative='dflash' with draft=<a DFlash draft> drafts with a block draft",
}

# Decoding modes other than greedy and sampling (beam search aside), which a verify cannot
# reproduce: what sets each, and the option to drop for speculative decoding. transformers runs them
# from the Hub (`custom_generate` repos), a route a `custom_generate` loop such as ours closes, so
# unrefused they would decode greedily, or as plain beam search under auto, without a word.
_OTHER_MODES = {
    GenerationMode.CONTRASTIVE_SEARCH: ("contrastive search", ("penalty_alpha", "top_k"), "penalty_alpha="),
    GenerationMode.DOLA_GENERATION: ("DoLa decoding", ("dola_layers",), "dola_layers="),
    GenerationMode.CONSTRAINED_BEAM_SEARCH: (
        "constrained beam search",
        ("force_words_ids", "constraints"),
        "force_words_ids= / constraints=",
    ),
    GenerationMode.GROUP_BEAM_SEARCH: (
        "group beam search",
        ("num_beam_groups", "diversity_penalty"),
        "num_beam_groups=",
    ),
}


class Unsupported(ValueError):
    """What speculative decoding here cannot reproduce for a call that plain `generate` decodes: a
    method the user named raises it; `method="auto"` decodes the call plainly instead and says why
    (`speculative_stats.selection`), as it promises plain's output at no less than plain's speed."""


def check_supported(
    model: Any, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any], streamer: Any
) -> None:
    """Raise `Unsupported` for anything speculative decoding here cannot reproduce losslessly (a
    clear `ValueError` for a call plain `generate` refuses too)."""
    # Before the empty-prompt check: given inputs_embeds alone, `generate` passes empty input_ids.
    if model_kwargs.get("inputs_embeds") is not None:
        raise Unsupported(
            "speculative= needs input_ids; inputs_embeds is not supported: pass the prompt's token ids "
            "as input_ids instead, without inputs_embeds, or drop speculative= (where a model's own "
            "generate builds them for its language model, as BLIP-2's does, drop it for that model)."
        )
    if input_ids.shape[-1] == 0:
        raise ValueError(
            f"The prompt is empty (input_ids of shape {list(input_ids.shape)}); generation needs at least "
            "one token to continue from, e.g. the tokenizer's BOS token."
        )
    if (why := verify_refusal(model)) is not None:
        raise Unsupported(
            f"{type(model).__name__}{why}: drop speculative= for it (speculative=True decodes it plainly)."
        )
    if (dropout := active_dropout(model)) is not None:
        raise Unsupported(
            f"{type(model).__name__} is in training mode with dropout ({dropout}): every forward draws its "
            "own, and a verify forward of several tokens draws otherwise than plain decoding's one-token "
            "forwards, so the output could not be plain's. Call model.eval() before generate, or drop "
            "speculative= (speculative=True decodes such a call plainly)."
        )
    if (quantized := per_forward_activation_scale(model)) is not None:
        raise Unsupported(
            f"{type(model).__name__}'s {quantized} quantizes its inputs with one scale per forward "
            "(torch.ao.quantization.quantize_dynamic, or torchao's with granularity=PerTensor()), "
            "shared by every token and row the forward holds: a verify forward of several tokens "
            "scales each token otherwise than plain decoding's one-token forwards, so the output could "
            "not be plain's. Quantize the weights only (e.g. torchao's Int8WeightOnlyConfig through "
            "TorchAoConfig) or per row, or drop speculative= (speculative=True decodes such a model "
            "plainly)."
        )
    if not config.use_cache:
        # The model's own generation config may say so too, where the call never did.
        raise Unsupported(
            "speculative= needs the KV cache, which this call's generation config turns off "
            "(use_cache=False, given to generate or set in a generation config, the model's own included): "
            "pass use_cache=True."
        )
    if getattr(config, "prefill_chunk_size", None):
        warnings.warn(
            f"prefill_chunk_size={config.prefill_chunk_size} is not honoured by speculative=: the prompt is "
            "prefilled in one forward, with the memory peak that has (the output is the same). Drop "
            "speculative= where a chunked prefill is needed to fit the prompt.",
            stacklevel=6,
        )
    cache = generate_cache(model_kwargs)
    if getattr(cache, "offloading", False):  # a DynamicCache or a StaticCache, whose layers wait on the CPU
        raise Unsupported(
            "speculative= does not support an offloaded cache (offloading=True / cache_implementation="
            "'offloaded' or 'offloaded_static'); use the default cache or cache_implementation='static'."
        )
    if type(cache) is StaticCache:
        check_static_cache(model, input_ids, config, cache)
    elif cache is not None and (type(cache) is not DynamicCache or not getattr(cache, "is_croppable", True)):
        raise Unsupported(
            f"speculative= needs a DynamicCache or a StaticCache it can roll back, got "
            f"{type(cache).__name__} (a quantized or hybrid cache). Drop cache_implementation= / cache=, "
            "or use cache_implementation='static'."
        )
    elif (refusal := sliding_refusal(model, cache)) is not None:
        raise Unsupported(refusal)
    if streamer is not None and input_ids.shape[0] > 1:
        # transformers' own streamers refuse a batch, but plain generate puts each step's tokens of
        # every row to a streamer of one's own, which reads them as it likes.
        raise Unsupported(
            "A streamer takes one sequence: stream with batch size 1, or drop streamer= (speculative=True "
            "decodes such a call plainly)."
        )
    if cache is not None and cache.get_seq_length() > 0:
        check_continued(input_ids, cache, _mask_length(config, model_kwargs))
    if (refusal := forwarded_refusal(input_ids, model_kwargs)) is not None:
        raise Unsupported(refusal)
    if (refusal := positions_refusal(model_kwargs.get("position_ids"), input_ids)) is not None:
        raise Unsupported(refusal)


_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def active_dropout(model: Any) -> str | None:
    """Where `model`'s forward draws dropout, else None: a module in training mode holding a rate
    above zero, as a dropout layer or as a number its forward reads (Llama's `attention_dropout`,
    `layerdrop`). A model in training mode without one computes as in eval mode."""
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, _DROPOUTS) and module.p > 0:
            return f"{name or 'the model'}: p={module.p}"
        for attribute, rate in vars(module).items():
            if "drop" in attribute and type(rate) is float and rate > 0:
                return f"{name + '.' if name else ''}{attribute}={rate}"
    return None


def per_forward_activation_scale(model: Any) -> str | None:
    """The first module of `model` that quantizes its inputs with one scale for the whole forward,
    else None: torch's dynamically quantized modules (`quantize_dynamic`), found by the package
    they come from, which `torch.ao` (deprecated) may no longer import; and a module whose weight
    quantizes the activations it meets per tensor (torchao's `act_quant_kwargs` with
    `granularity=PerTensor()`; its default, `PerRow()`, scales each token by its own values)."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith(
            ("torch.ao.nn.quantized.dynamic", "torch.nn.quantized.dynamic")
        ):
            return name or "the model"
        for weight in module.parameters(recurse=False):
            granularity = getattr(getattr(weight, "act_quant_kwargs", None), "granularity", None)
            if type(granularity).__name__ == "PerTensor":
                return name or "the model"
    return None


def own_step_loop(model: Any) -> Any:
    """The `_sample` of `model`'s class where it is not transformers' own (CSM's: a depth decoder per
    frame), else None."""
    own = type(model)._sample
    return None if own is GenerationMixin._sample else own


def check_causal_lm(config: Any, name: str, *, image_text: bool = False) -> None:
    """Refuse a checkpoint that `AutoModelForCausalLM` cannot load (an encoder-decoder such as T5, an
    encoder-only model) in one line, `name` its subject: transformers' own error lists every causal
    config class. The one rule for a model named by folder or repo id, target or draft, applied to
    its config before its weights load (`check_causal_checkpoint`). `image_text`: a model that
    reads images beside text passes too, where a loaded one is speculated for (`select`)."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or "AutoModelForCausalLM" in (
        getattr(config, "auto_map", None) or {}
    ):
        return
    if image_text and config.model_type in _IMAGE_TEXT_TYPES:
        return
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architecture named"
    raise ValueError(
        f"{name} is a {config.model_type} model ({architectures}), not a causal LM: hf-specdec "
        "speculates for and with decoder-only models that AutoModelForCausalLM loads (Llama, Qwen, "
        "Gemma, SmolLM2, ...); pass one of those."
    )


_IMAGE_TEXT_TYPES = {*MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, *MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES}


def check_causal_checkpoint(
    path: str | Path, name: str, *, trust_remote_code: bool = False, image_text: bool = False
) -> None:
    """`check_causal_lm` on the config of the checkpoint at `path` (a folder, or a Hub repo id: its
    config.json alone is fetched), read as `from_pretrained` would read it. A config whose auto_map
    names its own AutoModelForCausalLM passes unread: reading it would run that code."""
    from transformers import AutoConfig, PretrainedConfig

    raw, _ = PretrainedConfig.get_config_dict(path)
    if "AutoModelForCausalLM" in (raw.get("auto_map") or {}):
        return
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    check_causal_lm(config, name, image_text=image_text)


def check_causal_folder(folder: str | Path, *, image_text: bool = False) -> None:
    """`check_causal_checkpoint` for a local folder whose config.json names a model type transformers
    knows; one that says less (no such file, JSON that does not parse, no or an unknown model_type)
    is left to whoever reads the folder next, with their own account of it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    try:
        config = json.loads((Path(folder) / "config.json").read_bytes())
    except (OSError, ValueError):  # no file; not JSON, or not UTF-8 (UnicodeDecodeError)
        return
    if isinstance(config, dict) and config.get("model_type") in CONFIG_MAPPING_NAMES:
        check_causal_checkpoint(folder, str(folder), image_text=image_text)


def verify_refusal(model: Any) -> str | None:
    """Why speculative= cannot verify drafts on `model` at all, said after its class name; else None.
    The loop feeds decoder-only models: an encoder-decoder's decoder takes the encoder's outputs and
    a cache of two parts. An encoder given an LM head (`BertLMHeadModel`, RoBERTa's, ELECTRA's, ...)
    whose config leaves `is_decoder=False` attends both ways, so in a verify forward each token
    would see the drafts after it, where plain decoding fed it alone (encoders are the architectures
    transformers also maps for masked LM, or whose self-attention says it is not causal; a decoder's
    cross-attention is not causal either, hence `is_decoder` first). Then what cannot roll back a
    rejected draft (`rolls_back_refusal`). A class decoding each step with a `_sample` of its own
    (CSM's, Higgs Audio's, VibeVoice's, PocketTTS's: a depth decoder or an audio head per frame) runs
    that loop under plain generate, which the speculative loop replaces."""
    if (own_sample := own_step_loop(model)) is not None:
        return (
            f" decodes each step with a loop of its own ({own_sample.__qualname__}), which plain generate "
            "runs and speculative= would replace with transformers' token-by-token step"
        )
    if model.config.is_encoder_decoder:
        return (
            " is an encoder-decoder model, and speculative= verifies decoder-only models (transformers' "
            "assistant_model= drafts for some, e.g. Whisper)"
        )
    if not getattr(model.config, "is_decoder", True) and (
        model.config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        or any(getattr(module, "is_causal", True) is False for module in model.modules())
    ):
        return (
            " has is_decoder=False in its config, so its attention runs both ways and a verify forward "
            "would let each token see the drafts after it (load it with is_decoder=True, as transformers "
            "asks of a standalone causal LM of this encoder)"
        )
    return rolls_back_refusal(model)


# Architectures that cannot roll back a rejected draft, by `model_type`, with why, said after the
# model's class name (found by a sweep of transformers 5.25's causal LMs). Written for one new token
# a step, transformers' own `generate` being their only caller: CPM-Ant builds its own mask and
# positions for one token, XLM sizes its attention from a cache dict of its own, ProphetNet's
# decoder asserts one token once it has a cache. RecurrentGemma keeps its recurrent blocks' state in
# the blocks, outside the cache (whose linear-attention layers stay empty). Zaya's recurrent layers
# hand the cache the state after a forward's last token only (`kv.check_recorded` finds any other
# model that does so at its first forward of several tokens; these are refused before the call).
_ONE_TOKEN_A_STEP = (
    " is written to be fed one new token a step, so it cannot verify a draft of several in one forward"
)
_CANNOT_ROLL_BACK = {
    "cpmant": _ONE_TOKEN_A_STEP,
    "prophetnet": _ONE_TOKEN_A_STEP,
    "xlm": _ONE_TOKEN_A_STEP,
    "recurrent_gemma": " keeps its recurrent state in its own layers, outside the cache, which speculative= "
    "cannot roll back after a rejection",
    "zaya": "'s recurrent layers keep one state a forward, not one a token, so speculative= cannot roll "
    "back a rejected draft",
}


def rolls_back_refusal(model: Any) -> str | None:
    """Why `model` cannot roll back a rejected draft, said after its class name; else None: it
    decodes over no `DynamicCache`, keeps no KV cache at all (OpenAI GPT: it would swallow the
    cache passed and see only the tokens fed), or is one of `_CANNOT_ROLL_BACK`. A forward that may
    take the cache in its `**kwargs` is refused after its first forward if it drops it
    (`kv.check_kept_in`)."""
    if not takes_dynamic_cache(model):
        return (
            " keeps its state in a cache of its own, which speculative= cannot roll back after a rejection "
            "(transformers' assisted decoding refuses it too)"
        )
    why = _CANNOT_ROLL_BACK.get(getattr(model.config, "model_type", None))
    if why is not None:
        return why
    if forward_cache_argument(type(model)) is None:
        return (
            " keeps no KV cache (plain generate feeds it the whole sequence each step), so speculative= "
            "cannot feed it only the new tokens"
        )
    return None


def check_rolls_back(model: Any, fix: str, role: str = "") -> None:
    """Refuse a model that cannot roll back a rejected draft (`role` goes before its class name:
    "The draft ")."""
    if (why := rolls_back_refusal(model)) is not None:
        raise ValueError(f"{role}{type(model).__name__}{why}: {fix}.")


def check_mode(config: GenerationConfig) -> None:
    """Refuse the decoding modes other than greedy and sampling that the generation config selects,
    by transformers' own reading of it (`get_generation_mode`), naming the options that set them."""
    mode = config.get_generation_mode()
    if mode in _OTHER_MODES:  # before beam search: `_beam_search` would drop their constraints or groups
        described, options, drop = _OTHER_MODES[mode]
        given = ", ".join(
            _shown(name, getattr(config, name)) for name in options if getattr(config, name) is not None
        )
        raise ValueError(
            f"speculative= decodes greedily or by sampling, not by {described} ({given}, in generate's "
            f"arguments or the generation config). Drop {drop} for speculative decoding, or drop "
            f"speculative= for {described}."
        )
    if config.num_beams > 1:  # which plain `generate` runs as `_beam_search` (`integration`)
        raise Unsupported(
            f"speculative= cannot be combined with beam search (num_beams={config.num_beams}); "
            "use num_beams=1, or drop speculative= for beam search."
        )
    if mode is GenerationMode.ASSISTED_GENERATION:
        # These choose transformers' own assisted decoding, which speculative= replaces: refused by
        # name rather than dropped without a word. (`use_mtp=False` leaves the mode greedy or sampling.)
        for name, instead in _ASSISTED_DECODING.items():
            if (value := getattr(config, name, None)) is not None:
                raise ValueError(
                    f"`{name}` cannot be combined with `speculative=` (it is {value}, in generate's "
                    f"arguments or the generation config): both choose how to draft. {instead}"
                )


def warn_assistant_settings(given: dict[str, Any]) -> None:
    """Warn, once, about the generation settings given to a `speculative=` call (`given`: name to
    value, as passed to generate or set in the generation config passed) that only transformers'
    assisted decoding reads: the call drafts as if they were not given, as plain `generate` does
    without `assistant_model=`, but they were most likely meant for the drafting."""
    lines = [
        f"- {_shown(name, value)}: {instead}."
        for name, instead in _ASSISTANT_SETTINGS.items()
        if (value := given.get(name)) is not None
    ]
    if lines:
        warnings.warn(
            "generate() settings of transformers' assisted decoding (read only with assistant_model=), "
            "which speculative= does not read; it drafts as if they were not given:\n" + "\n".join(lines),
            stacklevel=4,
        )


def _shown(name: str, value: Any) -> str:
    """An option as an error message names it: with its value where that is short."""
    return f"{name}={value!r}" if isinstance(value, (int, float, str)) else name


def _mask_length(config: GenerationConfig, model_kwargs: dict[str, Any]) -> int | None:
    """The width of the attention mask the caller gave: `generate` drops a mask of all ones and
    keeps its width in the config."""
    mask = model_kwargs.get("attention_mask")
    return mask.shape[-1] if mask is not None else getattr(config, "_mask_length", None)


def check_continued(input_ids: torch.Tensor, cache: Any, mask_length: int | None = None) -> None:
    """A filled cache continues a conversation, as with plain `generate`: `input_ids` holds what the
    cache holds, then the new tokens. `Unsupported` where its layout cannot be continued."""
    cached, given = cache.get_seq_length(), input_ids.shape[-1]
    if mask_length is not None and mask_length > given:
        # transformers' other form: input_ids holds the new tokens alone, the mask the whole
        # conversation. Taken for the whole conversation, the first tokens would be dropped.
        raise Unsupported(
            f"speculative= continues a filled cache= from input_ids holding the whole conversation (the "
            f"{cached} cached tokens, then the new ones), as long as attention_mask ({mask_length}); got "
            f"{given} input_ids: pass torch.cat([cached_ids, new_ids], dim=1)."
        )
    if type(cache) is StaticCache:
        raise Unsupported(
            "speculative= continues a filled DynamicCache, not a filled StaticCache: pass the whole "
            "conversation without cache=, or continue a DynamicCache."
        )
    if any(type(layer) not in _CONTINUED_LAYERS for layer in cache.layers):
        raise Unsupported(
            "speculative= cannot continue a cache with sliding-window or quantized layers (they keep only "
            "their window, or lossy copies, and cannot be rolled back after a rejected draft): pass the "
            "whole conversation without cache=."
        )
    if cached >= given:
        raise ValueError(
            f"The cache holds {cached} positions and input_ids {given}: to continue a conversation, pass "
            "input_ids holding the cached tokens followed by at least one new token."
        )


def check_no_holes(cache: Any) -> None:
    """Refuse to continue, speculatively or plainly, a cache a ragged speculative batch handed back."""
    if not holds_holes(cache):
        return
    if cache.get_seq_length() == 0:  # emptied to be reused (`StaticCache.reset()`): a fresh cache
        mark_holes(cache, holds=False)
        return
    raise ValueError(
        "This cache was handed back by a speculative batch whose rows ended at different steps (an "
        "EOS, or max_new_tokens reached in fewer steps), or whose cache kept the holes of rejected "
        "drafts: rows are missing from it, shorter than others or hold holes, so it cannot be "
        "continued. Pass the whole conversation without cache=."
    )


def drafter_continues(drafter: Any, model_kwargs: dict[str, Any]) -> bool:
    """Whether `drafter` can draft for this call: not over a filled cache where it reads the target's
    hidden states, which it needs for the whole context and the cache's earlier call did not keep."""
    return not (drafter.hidden_state_layers and cached_columns(model_kwargs))


def check_drafter_continues(drafter: Any, method: str, model_kwargs: dict[str, Any]) -> None:
    """Refuse a drafter that cannot continue this call's filled cache (`drafter_continues`)."""
    if not drafter_continues(drafter, model_kwargs):
        raise ValueError(
            f"method={method!r} drafts from the target's hidden states of the whole context, which a "
            "filled cache= does not hold: pass the whole conversation without cache=, or continue it "
            "with method='ngram' or 'draft_model'."
        )


# Logits processors that keep state of their own from one call to the next: a verify scores drafts
# that may be rejected, and the state would go on from them. Classifier-free guidance runs an
# unconditional forward with a cache of its own (the greedy text left plain's after the first
# rejection); a SynthID watermark keeps the last tokens it was shown as its context.
_STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "classifier-free guidance: drop guidance_scale= "
    "(and negative_prompt_ids=)",
    "SynthIDTextWatermarkLogitsProcessor": "a SynthID watermark: drop watermarking_config=",
}


def check_processors(processors: LogitsProcessorList) -> None:
    """Refuse logits processors whose own state a rejected draft would leave advanced."""
    for processor in processors:
        for name, fix in _STATEFUL_PROCESSORS.items():
            if isinstance(processor, getattr(logits_process, name, ())):
                raise Unsupported(
                    f"speculative= cannot be combined with {type(processor).__name__}, which keeps state "
                    f"of its own from one scored position to the next that rejected drafts would leave "
                    f"advanced. For {fix}, or drop speculative=."
                )


def check_static_cache(
    model: Any, input_ids: torch.Tensor, config: GenerationConfig, cache: StaticCache
) -> None:
    """What speculation over a StaticCache (`core/static_kv.py`) needs: full-attention layers, masks
    it can pass, and room for the whole output, as plain static decoding."""
    if (refusal := layers_refusal(model, cache)) is not None:
        raise Unsupported(refusal)
    if windows_by_column(model):
        raise Unsupported(
            f"{type(model).__name__}'s local attention counts its window back from the last column of the "
            "cache, which a static cache holds empty (plain static decoding's output differs from dynamic "
            "decoding's too): use the default dynamic cache (drop cache_implementation='static')."
        )
    attention = model.config.get_text_config(decoder=True)._attn_implementation
    if attention not in ("sdpa", "eager"):
        raise Unsupported(
            f"speculative= over a static cache needs attn_implementation='sdpa' or 'eager' (got "
            f"{attention!r}: it masks rejected drafts with a 2D mask, which other attention unpads); load "
            "the model with one of those, or drop cache_implementation='static'."
        )
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        raise Unsupported(
            "speculative= does not return attentions or hidden states over a static cache; drop "
            "output_attentions= / output_hidden_states=, or cache_implementation='static'."
        )
    capacity = max(layer.max_cache_len for layer in cache.layers)
    prompt = input_ids.shape[-1]
    # The cache holds every token but the last (as plain static decoding's): drafts near the end are
    # shortened to what fits, and a ragged batch's holes are compacted away, so no more is needed.
    needed = max(config.max_length, prompt + 1) - 1
    if capacity < needed:  # as plain static decoding fails past its end: not decoded plainly
        raise ValueError(
            f"The static cache holds {capacity} positions, and this call needs {needed}: the prompt "
            f"({prompt}) + max_new_tokens ({needed + 1 - prompt}) - 1. Pass max_cache_len={needed} (or "
            f"more) to generate or to your StaticCache"
            + (f", or max_new_tokens={capacity + 1 - prompt}." if capacity >= prompt else ".")
        )


def check_fed_as_plain(model: Any) -> None:
    """Refuse a model that plain decoding would feed otherwise (`plain_feeds_otherwise`)."""
    otherwise = plain_feeds_otherwise(model)
    if otherwise is not None:
        raise Unsupported(
            f"speculative= cannot decode {type(model).__name__} as plain generate does here: {otherwise}. "
            "Drop speculative= for this call (speculative=True decodes such a call plainly)."
        )


def check_rotary(model: Any, cached: int, prompt_width: int, max_length: int) -> None:
    """Refuse a call whose verify forwards would rotate tokens otherwise than plain's (`rotary_refusal`)."""
    refusal = rotary_refusal(model, cached, prompt_width, max_length)
    if refusal is not None:
        raise Unsupported(
            f"{type(model).__name__} {refusal}: a verify forward of several tokens would rotate them "
            "otherwise than plain decoding's one-token forwards. Keep prompt + max_new_tokens within "
            "that context, or pass speculative=True (which decodes such a call plainly), or drop "
            "speculative=."
        )
