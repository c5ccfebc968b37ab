"""The model inputs `generate` prepared besides the prompt: forwarded as plain decoding would, or refused.

`generate` hands a custom loop every keyword the model accepts (`model_kwargs`). The loop builds the
tokens, attention mask, positions and cache of each forward itself; anything else is either one of
the inputs below, forwarded to the forwards plain decoding would give it to, or refused with an
error naming it. Nothing is dropped silently: a model given an input it was meant to see and
decoding without it would still produce fluent, wrong text.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import generate_cache

# Read by the loop itself: the prompt's mask and positions, the cache, and output switches.
_CONSUMED = (
    "attention_mask",
    "position_ids",
    "cache",
    "past_key_values",
    "use_cache",
    "logits_to_keep",
    "output_attentions",
    "output_hidden_states",
)
# Forwarded to the model where its `prepare_inputs_for_generation` passes them in plain decoding:
# per-token types (GPT-2's token types; multimodal models' text / image token types), and images,
# as pixels or as the features `generate` encodes them into (`mm_encoder_outputs`), usually given
# to the prefill alone.
FORWARDED = ("token_type_ids", "mm_token_type_ids", "pixel_values", "mm_encoder_outputs")
# Models that count positions from 1, not 0: PaliGemma's `prepare_inputs_for_generation` adds 1 to
# generate's position ids (and its forward does without them). RoPE would give the same attention up
# to rounding from positions one off, but not the same scores.
_FIRST_POSITION = {"PaliGemmaForConditionalGeneration": 1}
# Per-token inputs: what each generated token takes (`_update_model_kwargs_for_generation`).
_GENERATED_TOKENS_TAKE = {
    "token_type_ids": lambda prompt: prompt[:, -1],  # the row's last prompt token's type
    "mm_token_type_ids": lambda prompt: torch.zeros_like(prompt[:, -1]),  # text
}


# What plain decoding's loop asks of the model to build each forward's inputs, which the loop does itself.
_PLAIN_LOOP_CALLS = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")


def plain_feeds_otherwise(model: Any) -> str | None:
    """Why plain decoding of this call feeds `model` otherwise than the loop's forwards would, else None.

    PEFT rewires a model for the length of its own `generate` call, and the loop, which builds every
    forward itself, would decode as if it had not. Prompt learning (prompt tuning's virtual tokens,
    prefix tuning's cache) replaces the model's `prepare_inputs_for_generation` on the model itself;
    the loop does not call it. Other methods hook arguments fixed for the call into their layers'
    forwards, written for plain decoding's batch and its one token a step: a mixed batch's adapter
    per row (`adapter_names`) stops matching the rows once a finished row leaves the batch, and
    aLoRA's offsets apply the adapter to the last few tokens of each forward, which a verify forward
    of several tokens would run partly without it (so too Poly's task ids, X-LoRA's scalings).
    A model class of a user's or of remote code may prepare its inputs its own way
    (`prepare_inputs_for_generation` or `_update_model_kwargs_for_generation` defined outside
    transformers): the loop builds each step's inputs without them."""
    own = type(model).prepare_inputs_for_generation
    prepare = vars(model).get("prepare_inputs_for_generation")  # PEFT puts the model's own back after
    if prepare is not None and getattr(prepare, "__func__", None) is not own:
        return (
            "its prepare_inputs_for_generation is replaced on the model itself (as PEFT's prompt tuning and "
            "prefix tuning do, to add their virtual tokens), and speculative= builds each forward itself"
        )
    # transformers' own classes prepare their inputs as the loop knows (`FORWARDED`, `_FIRST_POSITION`);
    # a subclass's or remote code's may feed the model anything (ChatGLM's positions of two axes), and
    # the loop builds every step's inputs itself: even a copy of transformers' is not taken on trust.
    for name in _PLAIN_LOOP_CALLS:
        method = getattr(type(model), name)
        where = getattr(method, "__module__", None) or ""
        if not where.startswith("transformers."):
            return (
                f"its {name} ({getattr(method, '__qualname__', name)}, in {where or 'an unnamed module'}) is "
                "not transformers' own (a subclass's or remote code's, even a copy of transformers'), and "
                "speculative= builds each step's inputs itself without it"
            )
    # A copy of each module's hooks: a call on another thread (PEFT's mixed batch) adds and removes its own.
    hooks = (
        getattr(hook, "func", hook) for m in model.modules() for hook in list(m._forward_pre_hooks.values())
    )
    if any((getattr(hook, "__module__", None) or "").startswith("peft.") for hook in hooks):
        return (
            "PEFT hooks arguments of this call into its layers' forwards (a mixed batch's adapter_names, "
            "aLoRA's offsets, ...), set for plain decoding's rows and its one token a step (a LoRA adapter "
            "speculates once it is the model's active one, set_adapter, or merged)"
        )
    return None


def given_inputs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model inputs that carry something: neither None nor an empty dict (`generate` sets
    `mm_encoder_outputs={}` for every image-text model, whether or not the call holds an image)."""
    return {key: value for key, value in model_kwargs.items() if value is not None and not _empty(value)}


def _empty(value: Any) -> bool:
    return isinstance(value, dict) and not value


def forwarded_refusal(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> str | None:
    """Why speculative decoding would not pass on a model input it was given, else None: nothing is
    silently dropped."""
    given = given_inputs(model_kwargs)
    unknown = sorted(key for key in given if key not in _CONSUMED and key not in FORWARDED)
    cached = cached_columns(model_kwargs)
    if "cache_position" in unknown and _is_default_cache_position(given["cache_position"], input_ids, cached):
        unknown.remove("cache_position")  # what older 5.x `generate` derives from the cache's length
    if cached and (extras := sorted(key for key in given if key in FORWARDED)):
        return (
            f"speculative= continues a filled cache= with a text prompt only, without {', '.join(extras)}: "
            "pass the whole prompt without cache=, or use plain generate."
        )
    if unknown:
        return (
            f"speculative= would not pass {', '.join(map(repr, unknown))} to the model: drop "
            f"{'them' if len(unknown) > 1 else 'it'}, or use plain generate for "
            f"{'them' if len(unknown) > 1 else 'it'} (besides the prompt, its attention_mask and "
            f"position_ids, speculative= forwards {', '.join(FORWARDED)})."
        )
    return None


def cached_columns(model_kwargs: dict[str, Any]) -> int:
    """How many of the prompt's columns a cache handed in already holds (a conversation continued):
    0 for none or an empty one."""
    cache = generate_cache(model_kwargs)
    return 0 if cache is None else cache.get_seq_length()


class ModelInputs:
    """What each target forward of a call gets besides its tokens, mask, positions and cache."""

    def __init__(self, model: Any, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
        """`model_kwargs` as `forwarded_refusal` accepted them."""
        given = given_inputs(model_kwargs)
        # The prompt's forward feeds its columns a filled cache does not hold yet.
        self.uncached = slice(cached_columns(model_kwargs), None)
        positions = _prompt_positions(given.get("position_ids"), input_ids)
        if positions is not None:  # later positions continue from the prompt's
            positions = positions + next(
                (_FIRST_POSITION[c.__name__] for c in type(model).__mro__ if c.__name__ in _FIRST_POSITION), 0
            )
        self.prompt_positions = None if positions is None else positions[:, self.uncached]
        extras = {key: given[key] for key in FORWARDED if key in given}
        self._prefill = _passed_by_generate(model, input_ids, extras, first=True)
        self._step = _passed_by_generate(model, input_ids, extras, first=False)
        # Per row, the value of each per-token input that every generated token takes.
        self._last = {
            key: take(extras[key]) for key, take in _GENERATED_TOKENS_TAKE.items() if key in self._step
        }

    def prefill(self) -> dict[str, Any]:
        """The extra inputs of the prompt's forward."""
        return self._prefill

    def step(self, width: int, rows: list[int]) -> dict[str, Any]:
        """The extra inputs of a forward of `width` generated tokens per row, for cache rows that hold
        the user's rows `rows`."""
        inputs = {key: value for key, value in self._step.items() if key not in self._last}
        for key, last in self._last.items():
            select = slice(None) if len(rows) == len(last) else torch.tensor(rows, device=last.device)
            inputs[key] = last[select][:, None].expand(-1, width)
        return inputs


def positions_refusal(position_ids: torch.Tensor | None, input_ids: torch.Tensor) -> str | None:
    """Why the loop cannot continue generate's position ids of the prompt, else None.

    Models whose rotary positions span several axes (Qwen-VL and kin: [axes, B, prompt_len]) give
    text every axis the same position; the loop counts positions along one axis, which such a
    model spreads over its axes again, so only text prompts can be taken."""
    if position_ids is None:
        return None
    if position_ids.dim() == 3 and not bool((position_ids == position_ids[:1]).all()):
        return (
            "speculative= cannot continue rotary positions that differ between axes (an image or video in "
            f"a {list(position_ids.shape)} position_ids of a Qwen-VL-style model); use plain generate "
            "for it (speculative=True decodes such a call plainly), or speculate on text-only prompts."
        )
    if position_ids.dim() == 3:
        position_ids = position_ids[0]
    if position_ids.dim() != 2 or position_ids.shape[-1] != input_ids.shape[-1]:
        return (
            f"speculative= takes position_ids of shape [batch, prompt_length] = {list(input_ids.shape)}, got "
            f"{list(position_ids.shape)}; drop position_ids or use plain generate."
        )
    return None


def _prompt_positions(position_ids: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """generate's position ids of the prompt ([B, prompt_len]), or None where it made none; ones
    `positions_refusal` refuses are refused before the call (`check_supported`)."""
    if (refusal := positions_refusal(position_ids, input_ids)) is not None:
        raise ValueError(refusal)
    if position_ids is None:
        return None
    if position_ids.dim() == 3:
        position_ids = position_ids[0]  # text alone: the same positions on every axis
    return position_ids.expand(input_ids.shape[0], -1).to(input_ids.device)


def _is_default_cache_position(cache_position: Any, input_ids: torch.Tensor, cached: int) -> bool:
    expected = torch.arange(cached, input_ids.shape[-1], device=input_ids.device)
    return isinstance(cache_position, torch.Tensor) and torch.equal(cache_position.to(expected), expected)


def _passed_by_generate(
    model: Any, input_ids: torch.Tensor, extras: dict[str, Any], first: bool
) -> dict[str, Any]:
    """Which of `extras` plain decoding passes to the prefill (`first`) or to a later step, asked of
    the model's own `prepare_inputs_for_generation` (models differ: Gemma 3 passes token_type_ids
    to the prefill alone, GPT-2 to every step)."""
    if not extras:
        return {}
    try:
        prepared = model.prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=None if first else 1,
            is_first_iteration=first,
            use_cache=True,
            **extras,
        )
    except Exception as error:  # a model whose input preparation needs more than we can give it
        raise ValueError(
            f"speculative= could not tell how {type(model).__name__} takes {', '.join(extras)} during "
            f"generation ({type(error).__name__}: {error}); drop them or use plain generate."
        ) from error
    return {key: prepared[key] for key in extras if prepared.get(key) is not None}
