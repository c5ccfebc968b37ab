"""Teaching `GenerationMixin.generate` the `speculative=` argument.

`generate` still does all of its own preparation (generation config, logits processors, stopping
criteria, KV cache); with `speculative=` it hands the prepared state to our loop through its
`custom_generate` hook instead of running its own token-by-token loop. Without `speculative=`
the original `generate` runs untouched.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin

from .config import SpeculativeConfig
from .loop import speculative_decode

# transformers' own `generate`, kept on the class the first time this module runs: a reload of this
# module (notebook autoreload, `importlib.reload`) would otherwise read back our wrapper as "the
# original", and every `generate` in the process would call itself.
_KEPT_ORIGINAL = "_hf_specdec_original_generate"
if _KEPT_ORIGINAL not in vars(GenerationMixin):
    setattr(GenerationMixin, _KEPT_ORIGINAL, GenerationMixin.generate)
_ORIGINAL_GENERATE = getattr(GenerationMixin, _KEPT_ORIGINAL)


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self: Any, *args: Any, speculative: Any = None, **kwargs: Any) -> Any:
    config = SpeculativeConfig.from_user(speculative)
    if config is None:
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    return _speculative_generate(self, args, kwargs, config)


def _speculative_generate(model: Any, args: tuple, kwargs: dict[str, Any], config: SpeculativeConfig) -> Any:
    for conflicting in ("assistant_model", "prompt_lookup_num_tokens", "custom_generate"):
        if kwargs.get(conflicting) is not None:
            raise ValueError(
                f"`{conflicting}` cannot be combined with `speculative=`: both choose how to draft. "
                "Use speculative=SpeculativeConfig(method='draft_model', draft=<your assistant>) instead."
            )
    tokenizer = kwargs.get("tokenizer")
    streamer = kwargs.get("streamer")
    if len(args) > 7 and args[7] is not None:  # generate's 8th positional parameter is the streamer
        streamer = args[7]
    _take_stop_strings(model, kwargs, tokenizer)
    decode = functools.partial(speculative_decode, speculative=config, streamer=streamer, tokenizer=tokenizer)
    # `custom_generate` callables receive (model, input_ids, logits_processor, stopping_criteria,
    # generation_config, **model_kwargs); keyword-only extras we bind here ourselves.
    return _ORIGINAL_GENERATE(model, *args, custom_generate=_as_callable(decode), **kwargs)


def _as_callable(decode: functools.partial) -> Any:
    def custom_generate(
        model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
    ):
        return decode(
            model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
        )

    return custom_generate


def _take_stop_strings(model: Any, kwargs: dict[str, Any], tokenizer: Any) -> None:
    """Build stop-string criteria here: `generate` drops the tokenizer before a custom loop sees it."""
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=<your tokenizer> to generate().")
    if getattr(config, "stop_strings", None):
        config = GenerationConfig.from_dict(config.to_dict())
        config.stop_strings = None
        kwargs["generation_config"] = config
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


def install() -> None:
    """Add `speculative=` to every model's `generate` (done on `import hf_specdec`; idempotent)."""
    GenerationMixin.generate = generate


def uninstall() -> None:
    """Restore transformers' own `generate`."""
    GenerationMixin.generate = _ORIGINAL_GENERATE
