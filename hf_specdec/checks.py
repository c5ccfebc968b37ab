"""Capabilities checked before generating, each with an error that says what to do instead."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from .compat import generate_cache
from .config import SpeculativeConfig
from .ort.layout import is_onnx_folder
from .selection import speculative_draft


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


def resolve_method(config: SpeculativeConfig, model: Any) -> SpeculativeConfig:
    """Turn `method="auto"` into a concrete drafter, and a draft folder that only ONNX Runtime can
    load into `method="onnx"`, without touching the user's config object."""
    if config.method == "auto":
        config = _choose_method(config, model)
    if config.method == "draft_model" and is_onnx_folder(config.draft):  # an export, no PyTorch weights
        return dataclasses.replace(config, method="onnx")
    return config


def _choose_method(config: SpeculativeConfig, model: Any) -> SpeculativeConfig:
    if config.draft is not None:
        return dataclasses.replace(config, method="draft_model")
    # A chosen draft that cannot be loaded safely comes back as "ngram", with a warning.
    choice, draft, draft_tokenizer = speculative_draft(model, trust_remote_code=config.trust_remote_code)
    if draft is None:
        return dataclasses.replace(config, method=choice.method)
    # The selection compared the tokenizers already (or the registry pair was reviewed).
    options = {**config.options, "tokenizer_verified": True}
    return dataclasses.replace(
        config, method=choice.method, draft=draft, draft_tokenizer=draft_tokenizer, options=options
    )
