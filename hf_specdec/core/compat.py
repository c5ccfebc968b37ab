"""Names that changed between transformers 5.x releases, resolved for the installed version.

transformers renamed the KV-cache argument of a model's forward and of `generate` from
`past_key_values` to `cache` during 5.x. A model that does not know `cache=` takes it into its
`**kwargs` and silently decodes without one, so the name must be the model's own.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

_CACHE_NAMES = ("cache", "past_key_values")


@functools.cache
def forward_cache_argument(model_class: type) -> str | None:
    """The keyword under which `model_class`'s forward takes the KV cache, else None. A forward
    naming neither but taking `**kwargs` is read past, to the forward it overrides: a user's
    subclass (adding a logit bias) passes them on, the cache that plain `generate` gives among them.
    Whether it does, no signature tells: its first forward does (`kv.check_kept_in`)."""
    for owner in model_class.__mro__:
        forward = vars(owner).get("forward")
        if forward is None:
            continue
        parameters = inspect.signature(forward).parameters
        for name in _CACHE_NAMES:
            if name in parameters:
                return name
        if all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return None
    return None


def cache_argument(model: Any) -> str:
    """The keyword of `model`'s forward that takes the KV cache: `cache` or `past_key_values`."""
    return forward_cache_argument(type(model)) or "past_key_values"


def forward_takes(model: Any, argument: str) -> bool:
    """Whether `model`'s forward takes `argument` by name (`logits_to_keep`; `position_ids`, which plain
    `generate` gives only then: a Whisper decoder would read ones passed on through its `**kwargs`)."""
    return argument in inspect.signature(model.forward).parameters


def takes_dynamic_cache(model: Any) -> bool:
    """Whether transformers decodes `model` over a `DynamicCache` (its private rule, by class name:
    RWKV, xLSTM, the first MiniMax, Reformer and XLNet keep state of their own); `_is_stateful`, which
    releases before 5.2x set (on hybrid models too, so those releases refuse them), is honoured too."""
    return not getattr(model, "_is_stateful", False) and bool(type(model)._supports_default_dynamic_cache())


def generate_cache(model_kwargs: dict[str, Any]) -> Any:
    """The cache a caller passed to `generate` under either name, else None."""
    cache = model_kwargs.get("cache")
    return cache if cache is not None else model_kwargs.get("past_key_values")


def compiles_decoding(model: Any, generation_config: Any, model_kwargs: dict[str, Any]) -> bool:
    """Whether transformers' own decoding loop would compile `model`'s forward for this call: its
    private `_valid_auto_compile_criteria` (by default on cuda / xpu with a static cache, on CPU only
    with `compile_config._compile_all_devices`, never with `disable_compile=True`); False where the
    installed transformers has no such rule."""
    criteria = getattr(model, "_valid_auto_compile_criteria", None)
    if criteria is None:
        return False
    return bool(criteria({**model_kwargs, "cache": generate_cache(model_kwargs)}, generation_config))


def greedy_processors(model: Any, prompt_length: int, attention_mask: Any = None) -> Any:
    """The logits processors plain greedy `generate` builds from `model`'s generation config alone
    for a prompt of `prompt_length` columns and its `attention_mask` [B, P] (Qwen's chat models set a
    repetition penalty, which spares each row's left padding), through transformers' private
    `_prepare_special_tokens` and `_get_logits_processor`; None where it builds none, or where the
    installed transformers has no such methods."""
    if not hasattr(model, "_get_logits_processor") or getattr(model, "generation_config", None) is None:
        return None
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_length,
        device=model.device,
        model_kwargs={"attention_mask": attention_mask},
    )
    return processors or None
