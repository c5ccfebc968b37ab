"""Capabilities checked before generating, each with an error that says what to do instead."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from .compat import generate_cache
from .inputs import check_forwarded


def check_supported(
    model: Any, input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict[str, Any], streamer: Any
) -> None:
    """Raise a clear error for anything speculative decoding here cannot reproduce losslessly."""
    # Before the empty-prompt check: given inputs_embeds alone, `generate` passes empty input_ids.
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "speculative= needs input_ids; inputs_embeds is not supported: pass the prompt's token ids "
            "as input_ids instead, or drop speculative=."
        )
    if input_ids.shape[-1] == 0:
        raise ValueError(
            f"The prompt is empty (input_ids of shape {list(input_ids.shape)}); generation needs at least "
            "one token to continue from, e.g. the tokenizer's BOS token."
        )
    if model.config.is_encoder_decoder:
        raise ValueError(
            "speculative= supports decoder-only models; encoder-decoder models are not supported yet."
        )
    if getattr(model, "_is_stateful", False):
        raise ValueError(
            f"{type(model).__name__} keeps a recurrent state that cannot be rolled back after a rejection; "
            "speculative decoding needs an attention KV cache."
        )
    if config.num_beams > 1:
        raise ValueError(
            f"speculative= cannot be combined with beam search (num_beams={config.num_beams}); "
            "use num_beams=1, or drop speculative= for beam search."
        )
    if not config.use_cache:
        raise ValueError("speculative= needs the KV cache; remove use_cache=False.")
    cache = generate_cache(model_kwargs)
    if cache is not None and (type(cache) is not DynamicCache or not getattr(cache, "is_croppable", True)):
        raise ValueError(
            f"speculative= needs a DynamicCache it can roll back, got {type(cache).__name__} "
            "(a static, compiled or quantized cache). Drop cache_implementation= / cache=."
        )
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("A streamer takes one sequence: stream with batch size 1, or drop streamer=.")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "speculative= starts from an empty cache; pass the whole prompt without a filled cache=."
        )
    check_forwarded(input_ids, model_kwargs)
