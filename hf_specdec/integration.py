"""Teaching `GenerationMixin.generate` the `speculative=` argument.

`generate` still does all of its own preparation (generation config, logits processors, stopping
criteria, KV cache); with `speculative=` it hands the prepared state to our loop through its
`custom_generate` hook instead of running its own token-by-token loop. Without `speculative=`
the original `generate` runs untouched.

Everything the loop is given is decided here, before it starts: the inputs are checked, `"auto"` is
resolved to a drafter (the Hub choice, in `selection`), the drafter is built and the draft-length
policy chosen, so that `core` never reaches up into the drafters or the Hub.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StaticCache,
    StoppingCriteriaList,
)
from transformers.generation.continuous_batching import ContinuousMixin
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin
from transformers.pipelines.any_to_any import AnyToAnyPipeline
from transformers.pipelines.image_text_to_text import ImageTextToTextPipeline
from transformers.pipelines.text_generation import TextGenerationPipeline

from .config import Drafting, SpeculativeConfig, check_tokenizer
from .core.checks import (
    Unsupported,
    check_drafter_continues,
    check_fed_as_plain,
    check_mode,
    check_no_holes,
    check_processors,
    check_rotary,
    check_supported,
    drafter_continues,
    own_step_loop,
    warn_assistant_settings,
)
from .core.compat import compiles_decoding, generate_cache
from .core.draft import Draft, Drafter
from .core.draws import PrivateDraws
from .core.inputs import cached_columns
from .core.kv import PastNotKept, tree_refusal
from .core.loop import speculative_decode
from .core.output import SpeculativeGenerateOutput
from .core.policy import DEVICE_COSTS, DraftLengthPolicy, FixedDraftLength
from .core.stats import SpeculativeStats
from .drafters import DRAFTERS, build_drafter
from .selection.method import draft_free_instead, plain_instead, plainly_because, resolve_method


def _kept_original(cls: type, name: str) -> Any:
    """transformers' own `cls.name`, kept on the class the first time this module runs: a reload of
    this module (notebook autoreload, `importlib.reload`) would otherwise read back our wrapper as
    "the original", and every call in the process would call itself."""
    kept = f"_hf_specdec_original_{name}"
    if kept not in vars(cls):
        setattr(cls, kept, vars(cls)[name])
    return getattr(cls, kept)


_ORIGINAL_GENERATE = _kept_original(GenerationMixin, "generate")
_ORIGINAL_VALIDATE_MODEL_KWARGS = _kept_original(GenerationMixin, "_validate_model_kwargs")
_ORIGINAL_GENERATE_BATCH = _kept_original(ContinuousMixin, "generate_batch")
_GENERATE_SIGNATURE = inspect.signature(_ORIGINAL_GENERATE)
# What transformers' `generate` sets a generation field to where neither the model nor the call did.
_DEFAULTS: dict[str, Any] = getattr(GenerationConfig, "_get_default_generation_params", dict)()
# What generate takes that is no generation field: its own parameters, and what it sets aside for the
# decoding mode before it builds the generation config.
_NOT_GENERATION_FIELDS = frozenset([*_GENERATE_SIGNATURE.parameters, "tokenizer", "assistant_tokenizer"])


# The statistics of the `generate` calls a text-generation pipeline's forward makes (None outside one).
_PIPELINE_STATS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "hf_specdec_pipeline_stats", default=None
)


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self: Any, *args: Any, speculative: Any = None, **kwargs: Any) -> Any:
    by_name = _by_name(self, args, kwargs)
    _check_no_speculative_field(self, by_name.get("generation_config"))
    config = SpeculativeConfig.from_user(speculative)
    # Plain decoding, ours where auto decodes plainly included, would read the holes as tokens.
    check_no_holes(generate_cache(kwargs))
    if config is None:
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    with _ended_if_raised(by_name.get("streamer")):
        out = _speculative_generate(self, by_name, config)
    seen = _PIPELINE_STATS.get()
    if seen is not None and hasattr(out, "speculative_stats"):
        seen.append(out.speculative_stats)
    return out


@functools.wraps(_ORIGINAL_VALIDATE_MODEL_KWARGS)
def _validate_model_kwargs(self: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> None:
    """A model class whose own `generate` runs a loop of its own (MusicGen, Dia, RAG-Token, CLVP,
    Janus's image mode) never calls the `generate` hooked here: `speculative=` reaches its model
    arguments, where transformers' check would name it only as an argument "not used by the model"."""
    if model_kwargs.get("speculative") is not None:
        raise ValueError(
            f"{type(self).__name__}.generate decodes with a loop of its own, not with transformers' "
            "GenerationMixin.generate that speculative= extends: it can neither speculate nor be decoded "
            "plainly under speculative=. Drop speculative= for this model."
        )
    _ORIGINAL_VALIDATE_MODEL_KWARGS(self, model_kwargs, *args, **kwargs)


@functools.wraps(_ORIGINAL_GENERATE_BATCH)
def _generate_batch(self: Any, *args: Any, speculative: Any = None, **kwargs: Any) -> Any:
    """transformers' `generate_batch` takes any keyword and reads only `max_new_tokens`: unrefused,
    speculative= would be dropped without a word (as `generate` refuses it beside
    `cache_implementation="paged"`, which routes here)."""
    if speculative is not None and speculative is not False:  # refused unread: nothing here drafts
        raise ValueError(
            "speculative= cannot be passed to generate_batch: it runs continuous batching, which does not "
            "draft. Call generate(..., speculative=...) on a left-padded batch for speculative decoding, or "
            "drop speculative= for continuous batching."
        )
    return _ORIGINAL_GENERATE_BATCH(self, *args, **kwargs)


def _check_no_speculative_field(model: Any, given: GenerationConfig | None) -> None:
    """`speculative` is an argument of generate, not a generation field: transformers keeps it in a
    generation config as an entry no one reads. In the config given to this call, the call would
    decode plainly without a word where speculation was asked for: refused. In the model's, which a
    checkpoint may bring, plain calls must still run: a warning (a pipeline passes a copy of it)."""
    carried = getattr(getattr(model, "generation_config", None), "speculative", None)
    if (value := getattr(given, "speculative", None)) not in (None, False, carried):
        raise ValueError(
            f"speculative={value!r} in the generation config passed to generate is not read: generate "
            "takes it as an argument only. Pass speculative= to generate() or to the pipeline, and remove "
            "it from the config (del config.speculative)."
        )
    if carried not in (None, False):
        warnings.warn(
            f"speculative={carried!r} in {type(model).__name__}.generation_config is not read: generate "
            "takes it as an argument only. Pass speculative= to generate() or to the pipeline, and remove "
            "it from the model's generation config (del model.generation_config.speculative).",
            stacklevel=3,
        )


@contextlib.contextmanager
def _ended_if_raised(streamer: Any) -> Iterator[None]:
    """A call that raises (a refusal, mostly, after generate put the prompt) ends its stream: a
    consumer iterating it on another thread, as chat apps do, would otherwise wait forever."""
    try:
        yield
    except BaseException:
        if streamer is not None:
            with contextlib.suppress(Exception):  # the call's own error is the one to see
                streamer.end()
        raise


def _by_name(model: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """generate's arguments all by name, those given by position (the streamer is its 8th) included,
    bound as generate binds them; a call generate would refuse gets its TypeError here."""
    if not args:
        return kwargs
    bound = dict(_GENERATE_SIGNATURE.bind_partial(model, *args, **kwargs).arguments)
    for name, parameter in _GENERATE_SIGNATURE.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    bound.pop(next(iter(_GENERATE_SIGNATURE.parameters)))  # the model itself
    return bound


def _speculative_generate(model: Any, kwargs: dict[str, Any], config: SpeculativeConfig) -> Any:
    # Arguments of generate only; those a generation config holds are checked with it (`check_supported`).
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            "`assistant_model` cannot be combined with `speculative=`: both choose how to draft. "
            "Use speculative=SpeculativeConfig(method='draft_model', draft=<your assistant>) instead."
        )
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "`custom_generate` cannot be combined with `speculative=`: both replace generate's decoding "
            "loop (speculative= runs as a custom_generate loop of its own). Drop custom_generate= for "
            "speculative decoding, or drop speculative= to run it."
        )
    if kwargs.get("cache_implementation") == "paged":
        # generate hands this argument to continuous batching (`generate_batch`) before it reaches
        # its `custom_generate` hook: unrefused, speculative= would be dropped without a word.
        raise ValueError(
            "speculative= cannot be combined with cache_implementation='paged': generate switches to "
            "continuous batching, which does not draft. Drop cache_implementation='paged' for speculative "
            "decoding, or drop speculative= for continuous batching."
        )
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is not None:
        check_tokenizer(tokenizer, "generate(tokenizer=...)")
    streamer = kwargs.get("streamer")
    warn_assistant_settings(_given_fields(kwargs))
    fields = _generation_config(model, kwargs)
    _take_stop_strings(model, kwargs, tokenizer, fields)
    _heal_prompt(model, kwargs, tokenizer, fields)
    cache_given = generate_cache(kwargs) is not None  # the user's own, which holds what the call leaves

    # `custom_generate` callables receive (model, input_ids, logits_processor, stopping_criteria,
    # generation_config, **model_kwargs): generate's prepared state, handed on to the loop.
    def custom_generate(
        model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
    ):
        call = (input_ids, logits_processor, generation_config, model_kwargs, streamer)
        plainly = _why_plain(config, model, *call)
        if plainly is not None:
            return _decode_plainly(model, stopping_criteria, plainly, *call)
        # Torch's default generators left as plain leaves them, on this thread and on others:
        # building a drafter can initialise modules before their weights load.
        with PrivateDraws():
            resolved, reason = resolve_method(config, model)
            drafter = build_drafter(resolved, model, tokenizer)
            chosen = config.method == "auto" and config.draft is None  # by auto, not given
            if chosen and not drafter_continues(drafter, model_kwargs):
                resolved, reason = draft_free_instead(config, resolved.method, model)
                drafter = build_drafter(resolved, model, tokenizer)
        check_drafter_continues(drafter, resolved.method, model_kwargs)
        if generation_config.do_sample and not drafter.supports_sampling:
            raise ValueError(
                f"method={resolved.method!r} supports greedy decoding only{_with_this_draft(drafter)}; "
                "pass do_sample=False."
            )
        static = isinstance(generate_cache(model_kwargs), StaticCache)
        tree = _drafts_trees(resolved, drafter, static, model)
        drafting = Drafting(
            do_sample=bool(generation_config.do_sample),
            tree=tree,
            compiled=static and compiles_decoding(model, generation_config, model_kwargs),
            translated=bool(drafter.translation),
            loads_draft_code=_loads_draft_code(config, resolved),
        )
        config.warn_unused(resolved, DRAFTERS[resolved.method].options_class, drafting)
        try:
            out = speculative_decode(
                model,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                drafter=drafter,
                policy=_policy(resolved, model),
                tree=tree,
                max_tree_nodes=resolved.max_tree_nodes,
                streamer=streamer,
                cache_given=cache_given,
                **model_kwargs,
            )
        except PastNotKept as refusal:
            # The target's prompt forward, which left the cache as it was: no token decided or
            # streamed yet, so "auto" decodes the call plainly, as for any target keeping no cache.
            if config.method != "auto" or refusal.model is not model:
                raise
            return _decode_plainly(model, stopping_criteria, plainly_because(str(refusal)), *call)
        if hasattr(out, "speculative_stats"):
            out.speculative_stats.selection = reason
        return out

    return _ORIGINAL_GENERATE(model, custom_generate=custom_generate, **kwargs)


def _decode_plainly(
    model: Any,
    stopping_criteria: StoppingCriteriaList,
    plainly: str,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    streamer: Any,
) -> Any:
    """generate's own loop, as without speculative=, for the mode the generation config selects;
    `plainly` says why (`speculative_stats.selection`, where the output is generate's decoder-only
    one, not an encoder-decoder's or that of a model with a step loop of its own)."""
    decode = functools.partial(type(model)._sample, streamer=streamer)
    if generation_config.num_beams > 1:
        if streamer is not None:  # as plain generate, which checks it before a loop of its own
            raise ValueError(
                "`streamer` cannot be used with beam search (as in plain generate): stream with "
                "num_beams=1, or drop streamer=."
            )
        decode = type(model)._beam_search
    out = decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
    if not isinstance(out, GenerateDecoderOnlyOutput) or own_step_loop(model) is not None:
        # A model with a step loop of its own (CSM) rebuilds its output from this one's fields.
        return out
    return SpeculativeGenerateOutput(
        **out, speculative_stats=SpeculativeStats(method="plain", selection=plainly)
    )


def _why_plain(
    config: SpeculativeConfig,
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    streamer: Any,
) -> str | None:
    """Why `"auto"` decodes this call plainly, else None: a target or batch no method serves
    (`plain_instead`), or what the checks find `Unsupported`, which a named method raises. Modes
    neither decodes (DoLa, contrastive search, transformers' assisted decoding) raise first."""
    try:
        check_mode(generation_config)
        reason = plain_instead(config, model, input_ids, model_kwargs, generation_config.max_length)
        if reason is not None:
            return reason
        check_supported(model, input_ids, generation_config, model_kwargs, streamer)
        check_processors(logits_processor)
        check_fed_as_plain(model)  # what "auto" decodes plainly, a named method refuses
        check_rotary(model, cached_columns(model_kwargs), input_ids.shape[1], generation_config.max_length)
    except Unsupported as refusal:
        if config.method != "auto":
            raise
        return plainly_because(str(refusal))
    return None


def _drafts_trees(config: SpeculativeConfig, drafter: Drafter, static_cache: bool, model: Any) -> bool:
    """`tree="auto"`: a tree where the drafter grows them (the policy sizes it) and the cache and the
    target take them (a static cache does not yet: `StaticKV.takes_tree_masks`; nor do models with
    recurrent states or ALiBi: `kv.tree_refusal`), else a chain."""
    if config.tree == "auto":
        return drafter.supports_tree and not static_cache and tree_refusal(model) is None
    if config.tree and static_cache:
        raise ValueError(
            "Tree drafts over a static cache are not built yet; drop tree=True (chains then), or "
            "cache_implementation='static' / the StaticCache for trees."
        )
    if config.tree and not drafter.supports_tree:
        growers = ", ".join(repr(name) for name, cls in DRAFTERS.items() if cls.supports_tree)
        raise ValueError(
            f"method={config.method!r} drafts chains only{_with_this_draft(drafter)}; tree=True needs "
            f"a drafter that grows trees (method={growers}), or drop tree=."
        )
    return config.tree


def _loads_draft_code(config: SpeculativeConfig, resolved: SpeculativeConfig) -> bool:
    """Whether this call reads `trust_remote_code`: the automatic choice of a draft (it skips drafts
    with code unless trusted), or a draft named by folder or repo to a drafter that loads it through
    transformers' Auto classes (`takes_trust_remote_code`)."""
    if config.method == "auto" and config.draft is None:
        return True
    named = isinstance(resolved.draft, (str, os.PathLike))
    return named and DRAFTERS[resolved.method].takes_trust_remote_code


def _with_this_draft(drafter: Drafter) -> str:
    """Why a drafter of a method that can do more cannot here: its translation (a draft model of
    another tokenizer drafting through text), for a refusal's message."""
    return f" with this draft: {drafter.translation}" if drafter.translation else ""


def _policy(config: SpeculativeConfig, model: Any) -> DraftLengthPolicy:
    if isinstance(config.policy, DraftLengthPolicy):
        return config.policy  # the user's own policy object, kept across their calls
    if config.policy is not None:
        return _Adopted(config.policy)
    if config.num_draft_tokens == "auto":
        # A fresh one per call: what was accepted never leaks into the next; what verifying costs
        # on this model and device is carried (`DEVICE_COSTS`).
        return DEVICE_COSTS.policy(model)
    return FixedDraftLength(config.num_draft_tokens)


class _Adopted(DraftLengthPolicy):
    """A policy object that does not subclass `DraftLengthPolicy` (it has the four methods
    `SpeculativeConfig` checks), with the base class's defaults for the others."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def draft_length(self, batch_size: int) -> int:
        return self.policy.draft_length(batch_size)

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return self.policy.trim(draft, batch_size, remaining)

    def update(self, batch_size, draft, accepted, draft_seconds, verify_seconds, paths=None) -> None:
        trees = {} if paths is None else {"paths": paths}  # one written for chains may take no paths=
        self.policy.update(batch_size, draft, accepted, draft_seconds, verify_seconds, **trees)

    def expect_draft_cost(self, seconds_per_token: float) -> None:
        self.policy.expect_draft_cost(seconds_per_token)


def _generation_config(model: Any, kwargs: dict[str, Any]) -> GenerationConfig:
    """The generation config `generate` builds from these arguments, by transformers' own
    `_prepare_generation_config`: the config given (else a new one), the model's where it sets
    nothing, and the generation fields given to generate over both. A copy, read only here; what
    this module does in generate's place (stop strings, token healing) it reads from it."""
    fields = {name: value for name, value in kwargs.items() if name not in _NOT_GENERATION_FIELDS}
    return model._prepare_generation_config(kwargs.get("generation_config"), **fields)[0]


def _given_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generation fields this call sets: those of the generation config passed that it sets
    (neither None nor transformers' default, which a config prepared by a model's own `generate`
    holds for every field, as Whisper's passes it on), and those passed to generate over them. The
    model's own config is not the call's."""
    given = {} if kwargs.get("generation_config") is None else vars(kwargs["generation_config"])
    fields = {name: value for name, value in given.items() if _set(name, value)}
    return {**fields, **{name: value for name, value in kwargs.items() if name not in _NOT_GENERATION_FIELDS}}


def _set(name: str, value: Any) -> bool:
    """Whether a generation config's field holds a setting: neither None nor transformers' default
    (compared only with a value of the default's own type: arrays and tensors do not compare to a bool)."""
    default = _DEFAULTS.get(name)
    return value is not None and not (type(value) is type(default) and value == default)


def _take_over(model: Any, kwargs: dict[str, Any], name: str, value: Any) -> None:
    """Set the generation field `name` to `value` for `generate`, where this module does its work:
    as an argument where it was given as one or no config was given, else in a copy of the caller's
    config (an argument beside a config would draw transformers' deprecation warning). Not None in a
    copy where the model's generation config sets the field: generate reads a config's None as unset
    and fills it from the model's; only an argument's None overrides it."""
    given = kwargs.get("generation_config")
    revived = value is None and getattr(model.generation_config, name, None) is not None
    if name in kwargs or given is None or revived:
        kwargs[name] = value
    else:
        kwargs["generation_config"] = GenerationConfig.from_dict({**given.to_dict(), name: value})


def _take_stop_strings(model: Any, kwargs: dict[str, Any], tokenizer: Any, config: GenerationConfig) -> None:
    """Build stop-string criteria here: `generate` drops the tokenizer before a custom loop sees it."""
    if not config.stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=<your tokenizer> to generate().")
    _take_over(model, kwargs, "stop_strings", None)
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config.stop_strings))
    kwargs["stopping_criteria"] = criteria


def _heal_prompt(model: Any, kwargs: dict[str, Any], tokenizer: Any, config: GenerationConfig) -> None:
    """`token_healing`: heal the prompt here, with transformers' own `heal_tokens`, and give
    `generate` the healed prompt: `generate` heals only after dropping the tokenizer, which a custom
    loop such as ours is not handed. Plain `generate` heals the prompt it has prepared and keeps the
    attention mask it had: the one given, or the one it inferred from the pad tokens of the prompt
    before healing (healing writes the tokenizer's pad over BOS). That mask goes with it here too."""
    if not config.token_healing:
        return
    if model.config.is_encoder_decoder:  # the prompt is the encoder's: generate heals the decoder's ids
        raise ValueError(
            f"token_healing heals the last token of the ids generate continues, which for "
            f"{type(model).__name__}, an encoder-decoder, are its decoder's start ids, not the prompt "
            "(transformers' own healing fails on them): drop token_healing=."
        )
    _take_over(model, kwargs, "token_healing", False)
    key = "input_ids" if kwargs.get("input_ids") is not None else "inputs"
    prompt = kwargs.get(key)
    if prompt is None:
        raise ValueError("token_healing heals the prompt's last token: pass the prompt as input_ids.")
    healed = model.heal_tokens(prompt, tokenizer)  # transformers' own error where tokenizer is None
    mask = kwargs.get("attention_mask")
    pad, eos = config.pad_token_id, config.eos_token_id
    if mask is None and pad is not None and pad not in (eos if isinstance(eos, list) else [eos]):
        mask = prompt.ne(pad).long()  # generate infers a mask from a pad token that is not an EOS token
    if mask is not None and mask.shape != healed.shape:
        # Healing re-tokenizes the prompt's text (special tokens left out), which can change its
        # width. Plain generate drops a mask of all ones; another it would lay over other tokens.
        if not bool(mask.all()):
            raise ValueError(
                f"token_healing re-tokenized the padded prompt to {healed.shape[-1]} columns from "
                f"{mask.shape[-1]}: plain generate would lay its attention mask over other tokens. Heal the "
                "prompts one at a time, or heal them first (model.heal_tokens(input_ids, tokenizer)) and "
                "pass the healed ids with their own attention mask."
            )
        mask = torch.ones_like(healed, dtype=mask.dtype)
    kwargs[key] = healed
    if mask is not None:
        kwargs["attention_mask"] = mask


# A text-generation pipeline keeps only the tensors of generate's dict output: with
# `return_dict_in_generate=True` its records would lose `speculative_stats` without a word, so they
# are carried from the pipeline's forward to each record it returns (a batch's records share the
# statistics of the one call that generated them).
_ORIGINAL_PIPELINE_FORWARD = _kept_original(TextGenerationPipeline, "_forward")
_ORIGINAL_PIPELINE_POSTPROCESS = _kept_original(TextGenerationPipeline, "postprocess")
_STATS_KEY = "speculative_stats"


@functools.wraps(_ORIGINAL_PIPELINE_FORWARD)
def _pipeline_forward(self: Any, model_inputs: Any, **generate_kwargs: Any) -> Any:
    if (
        generate_kwargs.get("speculative") is not None
        and generate_kwargs.get("tokenizer") is None
        and isinstance(self.tokenizer, PreTrainedTokenizerBase)
    ):
        # The target's tokenizer, which a draft of another tokenizer translates through (as the
        # pipeline passes it for transformers' `assistant_tokenizer=`); generate reads it for no more.
        generate_kwargs["tokenizer"] = self.tokenizer
    seen: list[Any] = []
    token = _PIPELINE_STATS.set(seen)
    try:
        model_outputs = _ORIGINAL_PIPELINE_FORWARD(self, model_inputs, **generate_kwargs)
    finally:
        _PIPELINE_STATS.reset(token)
    if seen:  # one entry per row, as the pipeline unbatches its outputs row by row
        model_outputs[_STATS_KEY] = [seen[-1]] * model_outputs["generated_sequence"].shape[0]
    return model_outputs


@functools.wraps(_ORIGINAL_PIPELINE_POSTPROCESS)
def _pipeline_postprocess(self: Any, model_outputs: Any, *args: Any, **kwargs: Any) -> Any:
    stats = model_outputs.pop(_STATS_KEY, None)
    records = _ORIGINAL_PIPELINE_POSTPROCESS(self, model_outputs, *args, **kwargs)
    if stats is not None:
        for record in records:
            record[_STATS_KEY] = stats[0] if isinstance(stats, list) else stats
    return records


# The image-text pipelines (image-text-to-text, any-to-any) hand the keyword arguments they do not
# know to the processor, not to generate, which would drop `speculative=` without a word. It is taken
# as a forward parameter of its own (kept from the pipeline's construction across calls, as
# text-generation keeps it) and put into the generate arguments there.
_PROCESSOR_PIPELINES = (ImageTextToTextPipeline, AnyToAnyPipeline)
_ORIGINAL_SANITIZE = {cls: _kept_original(cls, "_sanitize_parameters") for cls in _PROCESSOR_PIPELINES}
_ORIGINAL_FORWARD = {cls: _kept_original(cls, "_forward") for cls in _PROCESSOR_PIPELINES}


_NOT_GIVEN = object()


def _takes_speculative(cls: type) -> tuple[Any, Any]:
    """`cls`'s `_sanitize_parameters` and `_forward`, taking `speculative=` to generate."""
    original_sanitize, original_forward = _ORIGINAL_SANITIZE[cls], _ORIGINAL_FORWARD[cls]

    @functools.wraps(original_sanitize)
    def sanitize(self: Any, *args: Any, speculative: Any = _NOT_GIVEN, **kwargs: Any) -> Any:
        preprocess, forward, postprocess = original_sanitize(self, *args, **kwargs)
        # One setting by either route: taken out of generate_kwargs, it overrides the one given at
        # construction as transformers' call-time generate_kwargs do, and stays through calls whose
        # own generate_kwargs replace construction's.
        given = forward.get("generate_kwargs")
        if given is not None and "speculative" in given:
            if speculative is not _NOT_GIVEN:
                raise ValueError(
                    "speculative= is given twice, as a pipeline argument and in generate_kwargs: pass one."
                )
            forward["generate_kwargs"] = given = dict(given)
            speculative = given.pop("speculative")
        if speculative is not _NOT_GIVEN:  # None or False at call time overrides one at construction
            forward["speculative"] = speculative
        return preprocess, forward, postprocess

    @functools.wraps(original_forward)
    def forward(self: Any, model_inputs: Any, speculative: Any = None, **forward_params: Any) -> Any:
        if speculative is not None:
            given = dict(forward_params.get("generate_kwargs") or {})
            tokenizer = getattr(self.processor, "tokenizer", None)
            if given.get("tokenizer") is None and isinstance(tokenizer, PreTrainedTokenizerBase):
                given["tokenizer"] = tokenizer  # what a draft of another tokenizer translates through
            forward_params["generate_kwargs"] = {**given, "speculative": speculative}
        return original_forward(self, model_inputs, **forward_params)

    return sanitize, forward


def install() -> None:
    """Add `speculative=` to every model's `generate` and to the pipelines that generate, and carry its
    statistics through text-generation pipelines (done on `import hf_specdec`; idempotent)."""
    GenerationMixin.generate = generate
    GenerationMixin._validate_model_kwargs = _validate_model_kwargs
    ContinuousMixin.generate_batch = _generate_batch
    TextGenerationPipeline._forward = _pipeline_forward
    TextGenerationPipeline.postprocess = _pipeline_postprocess
    for cls in _PROCESSOR_PIPELINES:
        cls._sanitize_parameters, cls._forward = _takes_speculative(cls)


def uninstall() -> None:
    """Restore transformers' own `generate`, `generate_batch` and pipelines."""
    GenerationMixin.generate = _ORIGINAL_GENERATE
    GenerationMixin._validate_model_kwargs = _ORIGINAL_VALIDATE_MODEL_KWARGS
    ContinuousMixin.generate_batch = _ORIGINAL_GENERATE_BATCH
    TextGenerationPipeline._forward = _ORIGINAL_PIPELINE_FORWARD
    TextGenerationPipeline.postprocess = _ORIGINAL_PIPELINE_POSTPROCESS
    for cls in _PROCESSOR_PIPELINES:
        cls._sanitize_parameters, cls._forward = _ORIGINAL_SANITIZE[cls], _ORIGINAL_FORWARD[cls]
