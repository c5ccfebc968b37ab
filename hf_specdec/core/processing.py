"""Applying the call's logits processors to many positions at once, exactly as `generate` would."""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

# Warpers that read only the scores, never the tokens: these can process every row and position
# in one batched call. Any other processor (repetition penalty, min length, no-repeat n-gram, ...)
# sees the exact token sequence that plain `generate` would have shown it, one row at a time.
_CONTEXT_FREE = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
    )
    if hasattr(lp, name)
)


# Processor attributes that hold one entry per row of the user's batch (transformers builds the
# repetition penalty with each row's left-padding length, so padding is never penalised).
_PER_ROW_ATTRIBUTES = ("prompt_ignore_length",)


class ScoreProcessor:
    """Turns raw logits into the processed scores `generate` would sample or argmax from."""

    def __init__(
        self, logits_processor: LogitsProcessorList | None, vocab_size: int, batch_size: int
    ) -> None:
        self.processors = logits_processor or LogitsProcessorList()
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.context_free = all(isinstance(p, _CONTEXT_FREE) for p in self.processors)
        self._row_processors: dict[int, LogitsProcessorList] = {}

    def for_row(self, row_id: int) -> LogitsProcessorList:
        """The processors as they apply to one row of the user's batch, called with that row alone."""
        if row_id not in self._row_processors:
            row = LogitsProcessorList()
            for processor in self.processors:
                sliced = {
                    name: value[row_id : row_id + 1]
                    for name in _PER_ROW_ATTRIBUTES
                    if isinstance(value := getattr(processor, name, None), torch.Tensor)
                    and value.shape[0] == self.batch_size
                }
                if sliced:
                    processor = copy.copy(processor)
                    processor.__dict__.update(sliced)
                row.append(processor)
            self._row_processors[row_id] = row
        return self._row_processors[row_id]

    def fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Bring logits [..., V'] to the target's vocabulary [..., V] in float32.

        A draft with a larger (padded) vocabulary loses ids the target cannot emit; a smaller one
        gets -inf for ids it cannot propose.
        """
        logits = logits.float()
        size = logits.shape[-1]
        if size > self.vocab_size:
            return logits[..., : self.vocab_size]
        if size < self.vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size - size), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def __call__(
        self, contexts: list[torch.Tensor], row_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """Process one position per row: row b's next-token logits given `contexts[b]` [1, L_b].

        logits: [B, V]; returns [B, V].
        """
        logits = self.fit_vocab(logits)
        if not self.processors:
            return logits
        if self.context_free:
            return self.processors(contexts[0], logits)
        rows = zip(contexts, row_ids)
        return torch.cat([self.for_row(r)(ctx, logits[b : b + 1]) for b, (ctx, r) in enumerate(rows)], dim=0)

    def positions(
        self,
        contexts: list[torch.Tensor],  # [1, L_b] per row
        row_ids: list[int],  # [B] rows of the user's batch
        draft_tokens: torch.Tensor,  # [B, k]
        draft_lengths: list[int],  # [B]
        logits: torch.Tensor,  # [B, k + 1, V]
        parents: torch.Tensor | None = None,  # [B, k] for a tree draft (`Draft.parents`)
    ) -> torch.Tensor:
        """Process the target's logits after each draft prefix: position i of row b follows
        `contexts[b]` + `draft_tokens[b, :i]` (for a tree: + the path down to node i - 1).
        Positions past a row's draft are left unprocessed."""
        logits = self.fit_vocab(logits)
        if not self.processors:
            return logits
        batch, width, vocab = logits.shape
        if self.context_free:
            return self.processors(contexts[0], logits.reshape(batch * width, vocab)).reshape(
                batch, width, vocab
            )
        scores = logits.clone()
        for b, (ctx, row_id) in enumerate(zip(contexts, row_ids)):
            processors = self.for_row(row_id)
            for i in range(draft_lengths[b] + 1):
                if parents is None:
                    prefix = draft_tokens[b : b + 1, :i]
                else:
                    prefix = path_tokens(draft_tokens[b], parents[b], i - 1)
                seq = torch.cat([ctx, prefix], dim=1)
                scores[b, i] = processors(seq, logits[b, i : i + 1])[0]
        return scores


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, node: int) -> torch.Tensor:
    """The tokens from the root of a tree draft down to `node` (none for -1), [1, depth]."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = int(parents[node])
    return tokens[nodes[::-1]][None]
