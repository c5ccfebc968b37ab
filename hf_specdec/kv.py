"""A model's KV cache for rows that grow at different rates.

Each step every row feeds the same number of positions, but rows keep different numbers of them
(each accepts its own number of draft tokens). Rejected positions are not removed from the
middle of a row: they stay in the cache as holes that the attention mask hides, and only the
columns that are holes in every row are cropped off the end. With one row (or rows that agree)
nothing is ever a hole and the mask is dropped, so batch 1 runs exactly like plain decoding.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel


class RaggedKV:
    """A `DynamicCache` plus which of its positions hold real tokens, row by row."""

    def __init__(
        self, model: PreTrainedModel, cache: DynamicCache | None, batch_size: int, device: torch.device
    ):
        self.model = model
        self.cache = (
            cache if cache is not None else DynamicCache(config=model.config.get_text_config(decoder=True))
        )
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
