"""Collecting emitted tokens row by row: stopping criteria, streaming and the returned output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .stats import SpeculativeStats


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the acceptance statistics of the call."""

    speculative_stats: SpeculativeStats | None = None


# transformers renamed the output's `past_key_values` to `cache` (5.2x); generate's own field either way.
_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


class OutputCollector:
    """Every row's sequence so far, in the layout plain `generate` would have produced it."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        generation_config: GenerationConfig,
        streamer: Any,
    ) -> None:
        batch, self.prompt_len = input_ids.shape
        self.config = generation_config
        self.capacity = max(generation_config.max_length, self.prompt_len)
        self.tokens = input_ids.new_zeros(batch, self.capacity)
        self.tokens[:, : self.prompt_len] = input_ids
        self.mask = torch.ones(batch, self.capacity, dtype=torch.long, device=input_ids.device)
        if attention_mask is not None:
            self.mask[:, : self.prompt_len] = attention_mask
        self.attention_mask = self.mask[:, : self.prompt_len]
        self.lengths = [self.prompt_len] * batch
        self.finished = [self.prompt_len >= self.capacity] * batch
        self.streamer = streamer
        self.keep_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.keep_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # per row, [1, V] a token
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.emitted = 0

    @property
    def active_rows(self) -> list[int]:
        return [r for r, done in enumerate(self.finished) if not done]

    def room(self, row: int) -> int:
        """Tokens row `row` may still emit before `max_length`."""
        return self.capacity - self.lengths[row]

    def row(self, row: int) -> torch.Tensor:
        return self.tokens[row : row + 1, : self.lengths[row]]

    def emit(
        self,
        row: int,
        tokens: torch.Tensor,  # [n] accepted drafts then the target's token
        scores: torch.Tensor | None,  # [n, V] processed target scores they were chosen from
        logits: torch.Tensor | None,  # [n, V] raw target logits (each needed only when returned)
        stopping_criteria: StoppingCriteriaList,
    ) -> None:
        """Append tokens to a row one at a time, stopping at the first that ends the row."""
        start = self.lengths[row]
        tokens = tokens[: self.capacity - start]  # what fits before max_length
        # Written at once (positions past the row's length are not part of it yet), then shown
        # to the criteria one token at a time, as plain generate would have.
        self.tokens[row, start : start + len(tokens)] = tokens
        n = 0
        for i in range(len(tokens)):
            self.lengths[row] += 1
            n += 1
            if self.keep_scores:
                self.scores[row].append(scores[i : i + 1])  # [1, V]: this row as a batch of one
            # Criteria are called on this row's exact sequence, as plain generate calls them: with
            # every step's scores so far when output_scores keeps them, else None.
            step_scores = tuple(self.scores[row]) if self.keep_scores else None
            if bool(stopping_criteria(self.row(row), step_scores)[0]):
                self.finished[row] = True
                break
        if self.lengths[row] >= self.capacity:
            self.finished[row] = True
        self.emitted += n
        if self.keep_logits:
            self.logits[row].extend(logits[:n].float()[:, None])
        if self.streamer is not None and n:
            self.streamer.put(tokens[:n].cpu())

    def finish(self, stats: SpeculativeStats, cache: Any) -> Any:
        """Build what `generate` returns: padded sequences, or the output dataclass."""
        if self.streamer is not None:
            self.streamer.end()
        length = max(self.lengths)
        sequences = self.tokens[:, :length].clone()
        pad = self.config._pad_token_tensor
        for row, row_length in enumerate(self.lengths):
            if row_length < length:
                # Rows that stopped early are padded, as plain generate pads finished rows.
                sequences[row, row_length:] = pad if pad is not None else 0
        if not self.config.return_dict_in_generate:
            return sequences
        return SpeculativeGenerateOutput(
            sequences=sequences,
            scores=self._per_step(self.scores, length) if self.keep_scores else None,
            logits=self._per_step(self.logits, length) if self.keep_logits else None,
            **{_CACHE_FIELD: cache},
            speculative_stats=stats,
        )

    def _per_step(self, per_row: list[list[torch.Tensor]], length: int) -> tuple[torch.Tensor, ...]:
        """Rows' per-token tensors [1, V] regrouped per generation step, [B, V] each, as generate
        returns them; a row that had already finished gets -inf there (plain generate scored a pad token)."""
        steps = length - self.prompt_len
        first = next(t for row in per_row for t in row)
        finished = torch.full_like(first, float("-inf"))
        return tuple(
            torch.cat([row[step] if step < len(row) else finished for row in per_row])
            for step in range(steps)
        )
