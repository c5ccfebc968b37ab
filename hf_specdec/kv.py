"""A model's KV cache for rows that grow at different rates.

Each step every row feeds the same number of positions, but rows keep different numbers of them
(each accepts its own number of draft tokens). Rejected positions are not removed from the
middle of a row: they stay in the cache as holes that the attention mask hides, and only the
columns that are holes in every row are cropped off the end. With one row (or rows that agree)
nothing is ever a hole and the mask is dropped, so batch 1 runs exactly like plain decoding.

Sliding-window layers (Mistral, Gemma-2/3, Starcoder2, EXAONE-4) are the exception. transformers
caches them in `DynamicSlidingWindowLayer`s, which drop what falls out of the window and then can
no longer be cropped after a rejected draft; and the model's own window is counted in cache
columns, which holes would stretch. So their layers keep every position (plain `DynamicLayer`s)
and each forward gets attention masks built here, the window counted in real tokens: the same
attention as plain decoding, at the price of keeping the whole context in those layers' cache.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class RaggedKV:
    """A `DynamicCache` plus which of its positions hold real tokens, row by row."""

    def __init__(
        self, model: PreTrainedModel, cache: DynamicCache | None, batch_size: int, device: torch.device
    ):
        self.model = model
        self.cache = (
            cache if cache is not None else DynamicCache(config=model.config.get_text_config(decoder=True))
        )
        self.window_masks = _WindowMasks.for_model(model, self.cache)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, cache_len]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens per row
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        **inputs: Any,
    ) -> Any:
        """Run the model on `tokens` [B, T] (only `valid` [B, T] ones are real) and cache them.

        Returns the model output: `.logits` of the last `logits_to_keep` positions (all if 0),
        [B, T', V], and `.hidden_states` of every position when asked for. `inputs` go to the
        model as they are (a draft head's features).
        """
        # Real tokens continue each row's own numbering; holes get any position, they are masked.
        positions = (self.lengths[:, None] + valid.cumsum(dim=1) - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.lengths = self.lengths + valid.sum(dim=1)
        if self.window_masks is not None:
            attention_mask = self.window_masks.build(self.mask, tokens.shape[1])
        else:
            attention_mask = None if bool(self.mask.all()) else self.mask.long()
        out = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=output_hidden_states,
            **inputs,
            **({"logits_to_keep": logits_to_keep} if self.keeps_logits else {}),
        )
        if not self.keeps_logits and logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b; the rest become holes."""
        self.mask &= self.mask.cumsum(dim=1) <= lengths[:, None]
        self.lengths = self.mask.sum(dim=1)
        self._crop_unused_tail()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch), e.g. when others have finished."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.lengths = self.lengths[rows]
        self._crop_unused_tail()

    def _crop_unused_tail(self) -> None:
        """Drop the trailing cache columns that are holes in every row."""
        used = torch.nonzero(self.mask.any(dim=0))
        drop = self.width if used.numel() == 0 else self.width - 1 - int(used[-1])
        if drop:
            self.cache.crop(-drop)
            self.mask = self.mask[:, : self.width - drop]


class _WindowMasks:
    """Attention masks for a model with sliding-window layers, whose cache keeps every position.

    Query i of a forward (cache column `past + i`) sees the real tokens at columns up to its own,
    and on sliding layers only those fewer than `window` real tokens before it (transformers'
    `sliding_window_overlay`, `kv_idx > q_idx - sliding_window`, counted in tokens instead of
    columns). A hole or padding query sees only itself, so no softmax row is empty.
    """

    def __init__(self, model: PreTrainedModel, window: int, layer_types: list[str]) -> None:
        self.config = model.config.get_text_config(decoder=True)
        self.window = window
        self.types = sorted(set(layer_types))
        self.dtype = model.dtype

    @classmethod
    def for_model(cls, model: PreTrainedModel, cache: DynamicCache) -> _WindowMasks | None:
        """Masks for `model` if it has sliding-window layers (their cache layers become full ones)."""
        sliding = [isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers]
        if not any(sliding):
            return None
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "sliding_window", None) is None:  # transformers caches chunks the same way
            raise ValueError(
                f"speculative= does not support {type(model).__name__}'s chunked attention (its cache "
                "cannot be rolled back); use plain generate."
            )
        implementation = config._attn_implementation
        if implementation not in ("sdpa", "eager"):
            raise ValueError(
                "speculative= on a sliding-window model builds its own attention masks, which need "
                f"attn_implementation='sdpa' or 'eager' (got {implementation!r}); load the model with "
                "one of those."
            )
        for i, is_sliding in enumerate(sliding):  # empty: check_supported refuses a filled cache
            if is_sliding:
                cache.layers[i] = DynamicLayer()
        layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
        layer_types = [t for t in layer_types if t in ("full_attention", "sliding_attention")]
        return cls(model, config.sliding_window, layer_types)

    def build(self, mask: torch.Tensor, new: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Masks for a forward whose `new` queries are the last columns of `mask` [B, cache_len]:
        one [B, 1, new, cache_len] mask, or one per layer type for models that mix them."""
        width = mask.shape[1]
        columns = torch.arange(width, device=mask.device)
        queries = columns[width - new :]
        positions = mask.cumsum(dim=1) - 1  # [B, cache_len] real-token position of each column
        causal = mask[:, None, :] & (columns[None, None, :] <= queries[None, :, None])  # [B, new, cache_len]
        itself = columns[None, None, :] == queries[None, :, None]
        distance = positions[:, width - new :, None] - positions[:, None, :]  # [B, new, cache_len]
        allowed = {
            "full_attention": causal | itself,
            "sliding_attention": (causal & (distance < self.window)) | itself,
        }
        masks = {kind: self._format(allowed[kind][:, None]) for kind in self.types}
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def _format(self, allowed: torch.Tensor) -> torch.Tensor:
        """sdpa takes booleans (True: attend); eager adds the mask to its scores."""
        if self.config._attn_implementation == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)
