"""Applying the call's logits processors to many positions at once, exactly as `generate` would."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from .own_state import StateGuard, own_state
from .tree import tree_layout

# Processors that read only the scores, never the tokens: these can process every row and position
# in one batched call. Set-based and length-based processors (below) batch too; any other processor
# (no-repeat n-gram, bad words, ...) sees the exact token sequence that plain `generate` would have
# shown it, one row at a time.
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
        "TopHLogitsWarper",
        "SuppressTokensLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
        "LogitNormalization",
    )
    if hasattr(lp, name)
)


# Processors that read the context only as the set of token ids in it (past their optional
# `prompt_ignore_length`), and that ignore the id V of a V-token vocabulary (they clamp ids to V and
# drop that column): many rows and positions can be processed in one call, each context
# right-padded with V, and every row gets bit for bit what it would alone. Exact types only: a
# subclass may read the context otherwise.
_SET_BASED = tuple(getattr(lp, name) for name in ("RepetitionPenaltyLogitsProcessor",) if hasattr(lp, name))


# Processors that read the context only as its length, `input_ids.shape[-1]` (the prompt's left
# padding included, as plain `generate` shows it), against lengths that are the same for every row
# (`min_length`; the padded prompt's length for `min_new_tokens` and the decay's start): positions
# whose sequences have one length are processed in one call, shown those sequences, unpadded
# (`_by_length`). Exact types only, as above.
_LENGTH_BASED = tuple(
    getattr(lp, name)
    for name in (
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ExponentialDecayLengthPenalty",
    )
    if hasattr(lp, name)
)


# What context-free warpers are shown as the tokens: they never read them.
_NO_TOKENS = torch.zeros(1, 0, dtype=torch.long)


# Processor attributes that hold one entry per row of the user's batch (transformers builds the
# repetition penalty with each row's left-padding length, so padding is never penalised).
_PER_ROW_ATTRIBUTES = ("prompt_ignore_length",)


def _prefix_constrained_row(processor: Any, row: int, batch_size: int) -> dict[str, Any]:
    """`prefix_allowed_tokens_fn` asked about row `row` only, by its `batch_id` (a prompt's
    `num_beams` rows share one), never about another row's sequence."""
    allowed, batch_id = processor._prefix_allowed_tokens_fn, row // processor._num_beams
    return {"_prefix_allowed_tokens_fn": lambda _, sent: allowed(batch_id, sent), "_num_beams": 1}


def _encoder_ids_row(processor: Any, row: int, batch_size: int) -> dict[str, Any]:
    """The encoder's ids of row `row`'s prompt."""
    ids = processor.encoder_input_ids
    index = _prompt_of(row, batch_size, ids.shape[0])
    return {"encoder_input_ids": ids[index : index + 1]}


def _encoder_ngrams_row(processor: Any, row: int, batch_size: int) -> dict[str, Any]:
    """The n-grams of row `row`'s prompt, for a batch of that row alone."""
    index = _prompt_of(row, batch_size, processor.batch_size)
    return {"generated_ngrams": [processor.generated_ngrams[index]], "batch_size": 1}


def _prompt_of(row: int, batch_size: int, prompts: int) -> int:
    """The prompt row `row` of `batch_size` rows answers, of `prompts` (rows of one prompt follow each
    other: num_return_sequences)."""
    return row // max(1, batch_size // prompts)


# transformers' processors that treat a row by its index in the batch (`prefix_allowed_tokens_fn`
# gets it as `batch_id`, the encoder's ids are one row per row of the batch), each with the
# attributes that make a copy of it treat a batch of one row as it treats row `row` of the batch:
# each row is processed alone, at the cost of one row.
_ROW_INDEXED: dict[str, Callable[[Any, int, int], dict[str, Any]]] = {
    "PrefixConstrainedLogitsProcessor": _prefix_constrained_row,
    "EncoderRepetitionPenaltyLogitsProcessor": _encoder_ids_row,
    "EncoderNoRepeatNGramLogitsProcessor": _encoder_ngrams_row,
}


def indexes_rows(callable_: object) -> bool:
    """Whether a logits processor or stopping criterion may treat a row by its index in the batch:
    transformers' own do not (but `_ROW_INDEXED`); a user's own may (a bias per row, a budget per
    row), so it is shown the whole batch (`as_row`)."""
    kind = type(callable_)
    return not kind.__module__.startswith("transformers.") or kind.__name__ in _ROW_INDEXED


def as_row(call: Callable[..., Any], row: int, batch_size: int, ids: torch.Tensor, scores: Any) -> Any:
    """`call(ids, scores)` for row `row` of a batch of `batch_size` rows, called with the whole batch
    as plain `generate` calls it: every row this row's ids [1, L] and scores ([1, V], or None), and
    row `row` of what it returns taken. Rows verified apart sit at different lengths, so no one
    batch holds them all; a callable that reads other rows than its own cannot be shown theirs. A
    processor's scores are its own copy (it may write them in place). A criterion's tuple of every
    step's scores comes batched already, [batch_size, V] views, read-only as criteria read them,
    and is shown as it is: the caller keeps them (`OutputCollector`), for a copy, or even a view,
    of each step's made here would cost the whole tuple again per token and row."""

    def batch(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.expand(batch_size, *x.shape[1:]).clone()
        return x

    return call(batch(ids), batch(scores))[row : row + 1]


class _AsRow(lp.LogitsProcessor):
    """A processor that may index rows, called for one row of the user's batch (`as_row`)."""

    def __init__(self, processor: lp.LogitsProcessor, row: int, batch_size: int) -> None:
        self.processor, self.row, self.batch_size = processor, row, batch_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return as_row(self.processor, self.row, self.batch_size, input_ids, scores)


def _one_row(processor: lp.LogitsProcessor, row: int, batch_size: int) -> lp.LogitsProcessor:
    """A processor that may index rows, as it treats row `row` of a batch of `batch_size` rows,
    called with that row alone: transformers' own (`_ROW_INDEXED`) narrowed to the row, any
    other shown the whole batch (`_AsRow`)."""
    kind = type(processor)
    if kind.__module__.startswith("transformers.") and kind.__name__ in _ROW_INDEXED:
        narrowed = copy.copy(processor)
        narrowed.__dict__.update(_ROW_INDEXED[kind.__name__](processor, row, batch_size))
        return narrowed
    return _AsRow(processor, row, batch_size)


_VERIFIED_AT_DRAFTS = (
    "Speculation calls it at every draft position, rejected ones too, and once per row of a batch, "
    "where plain generate calls it once a step for the whole batch."
)


class _Checked(lp.LogitsProcessor):
    """A processor of one's own, its state checked after every call (`StateGuard`)."""

    def __init__(self, processor: lp.LogitsProcessor, guard: StateGuard) -> None:
        self.processor, self.guard = processor, guard

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = self.processor(input_ids, scores)
        self.guard.check()
        return scores


class ScoreProcessor:
    """Turns raw logits into the processed scores `generate` would sample or argmax from."""

    def __init__(
        self, logits_processor: LogitsProcessorList | None, vocab_size: int, batch_size: int
    ) -> None:
        self.processors = logits_processor or LogitsProcessorList()
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.context_free = all(isinstance(p, _CONTEXT_FREE) for p in self.processors)
        self.batched = all(
            isinstance(p, _CONTEXT_FREE)
            or (type(p) in _SET_BASED and self._rows_known(p))
            or type(p) in _LENGTH_BASED
            for p in self.processors
        )
        self._row_processors: dict[int, LogitsProcessorList] = {}
        self._guards = [
            None if (watched := own_state(p)) is None else StateGuard(p, watched, _VERIFIED_AT_DRAFTS)
            for p in self.processors
        ]

    @property
    def reads_context(self) -> bool:
        """Whether any processor reads the tokens: callers pass each row's context only then."""
        return not self.context_free

    def _rows_known(self, processor) -> bool:
        """Whether each per-row attribute of `processor` is a tensor of one entry per row of the
        batch, or of one entry for all, or no tensor (anything else: row by row, as given)."""
        return all(
            not isinstance(value := getattr(processor, name, None), torch.Tensor)
            or value.shape[:1] in ((self.batch_size,), (1,))
            for name in _PER_ROW_ATTRIBUTES
        )

    def for_rows(self, row_ids: torch.Tensor) -> LogitsProcessorList:
        """The processors as they apply to rows `row_ids` [N] of the user's batch (repeats allowed),
        called with those rows as one batch; only for `batched` processors."""
        rows = LogitsProcessorList()
        for processor in self.processors:
            spread = {}
            for name in _PER_ROW_ATTRIBUTES:
                value = getattr(processor, name, None)
                if isinstance(value, torch.Tensor):
                    if value.shape[0] == self.batch_size:
                        spread[name] = value[row_ids.to(value.device)]
                    else:  # one entry for every row
                        spread[name] = value.expand(row_ids.shape[0])
            if spread:
                processor = copy.copy(processor)
                processor.__dict__.update(spread)
            rows.append(processor)
        return rows

    def for_row(self, row_id: int) -> LogitsProcessorList:
        """The processors as they apply to one row of the user's batch, called with that row alone."""
        if row_id not in self._row_processors:
            row = LogitsProcessorList()
            for processor, guard in zip(self.processors, self._guards):
                sliced = {
                    name: value[row_id : row_id + 1]
                    for name in _PER_ROW_ATTRIBUTES
                    if isinstance(value := getattr(processor, name, None), torch.Tensor)
                    and value.shape[0] == self.batch_size
                }
                if sliced:
                    processor = copy.copy(processor)
                    processor.__dict__.update(sliced)
                if indexes_rows(processor) and self.batch_size > 1:
                    processor = _one_row(processor, row_id, self.batch_size)
                row.append(processor if guard is None else _Checked(processor, guard))
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
        """Process one position per row: row b's next-token logits given `contexts[b]` [1, L_b]
        (none needed unless `reads_context`).

        logits: [B, V]; returns [B, V].
        """
        logits = self.fit_vocab(logits)
        if not self.processors:
            return logits
        if self.context_free:
            return self.processors(_NO_TOKENS, logits)
        if self.batched:
            ids = pad_sequence([ctx[0] for ctx in contexts], batch_first=True, padding_value=logits.shape[-1])
            lengths = torch.tensor([ctx.shape[1] for ctx in contexts])
            return _apply(self.for_rows(torch.tensor(row_ids)), ids, lengths, logits)
        return self.row_by_row(contexts, row_ids, logits)

    def row_by_row(
        self, contexts: list[torch.Tensor], row_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        """`__call__` for any processors: each row alone, as plain `generate` would call them. [B, V]"""
        logits = self.fit_vocab(logits)
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
            flat = logits.reshape(batch * width, vocab)
            return self.processors(_NO_TOKENS, flat).reshape(batch, width, vocab)
        if self.batched:
            return self._positions_batched(contexts, row_ids, draft_tokens, draft_lengths, logits, parents)
        if not any(draft_lengths) and self._whole_batch(contexts, row_ids):
            return self._plain_step(contexts, logits)
        return self.positions_row_by_row(contexts, row_ids, draft_tokens, draft_lengths, logits, parents)

    def _whole_batch(self, contexts: list[torch.Tensor], row_ids: list[int]) -> bool:
        """Whether `contexts` are every row of the user's batch, in order, at one length: what plain
        `generate` shows its processors at a step."""
        return row_ids == list(range(self.batch_size)) and len({ctx.shape[1] for ctx in contexts}) == 1

    def _plain_step(self, contexts: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """`positions` where no row has a draft and the batch is whole: the processors called once on
        the batch, as plain `generate` calls them (a processor of one's own may set itself up from
        every row's prompt at its first call; row by row it would be shown one row's in each). What
        its state is then is what later calls are held to (`StateGuard`). [B, k + 1, V]"""
        scores = logits.clone()
        scores[:, 0] = self.processors(torch.cat(contexts), logits[:, 0].clone())
        for guard in filter(None, self._guards):
            guard.check()
        return scores

    def _positions_batched(self, contexts, row_ids, draft_tokens, draft_lengths, logits, parents):
        """`positions` for `batched` processors: every (row, position) in one call."""
        batch, width, vocab = logits.shape
        lengths = torch.tensor(draft_lengths, device=logits.device)
        processed = torch.arange(width, device=logits.device)[None] <= lengths[:, None]  # [B, k + 1]
        ids, shown = prefixes(contexts, draft_tokens, parents, filler=vocab)  # [B, k + 1, W], [B, k + 1]
        rows = torch.tensor(row_ids)[:, None].expand(batch, width)[processed.cpu()]  # [N]
        scores = logits.clone()
        scores[processed] = _apply(self.for_rows(rows), ids[processed], shown[processed], logits[processed])
        return scores

    def positions_row_by_row(
        self,
        contexts: list[torch.Tensor],
        row_ids: list[int],
        draft_tokens: torch.Tensor,
        draft_lengths: list[int],
        logits: torch.Tensor,
        parents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions` for any processors: each row and position alone, with the sequence plain
        `generate` would show them there. [B, k + 1, V]"""
        logits = self.fit_vocab(logits)
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


def _apply(
    processors: LogitsProcessorList,
    ids: torch.Tensor,  # [N, W] each sequence right-padded
    lengths: torch.Tensor,  # [N] each sequence's length
    scores: torch.Tensor,  # [N, V]
) -> torch.Tensor:
    """`processors(ids, scores)` for `batched` processors, in their order, a length-based one called
    per length (`_by_length`). [N, V]"""
    for processor in processors:
        if type(processor) in _LENGTH_BASED:
            lengths = lengths.cpu()  # grouped on the host: one wait for the device, not one a group
            scores = _by_length(processor, ids, lengths, scores)
        else:
            scores = processor(ids, scores)
    return scores


def _by_length(
    processor: lp.LogitsProcessor, ids: torch.Tensor, lengths: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """A length-based processor applied to N sequences: once per distinct length, with the scores
    of the sequences of that length and those sequences, `ids[:, :length]`, exactly. [N, V]"""
    distinct = lengths.unique().tolist()
    if len(distinct) == 1:
        return processor(ids[:, : distinct[0]], scores)
    processed = torch.empty_like(scores)
    for length in distinct:
        group = (lengths == length).nonzero()[:, 0]
        processed[group] = processor(ids[group, :length], scores[group])
    return processed


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, node: int) -> torch.Tensor:
    """The tokens from the root of a tree draft down to `node` (none for -1), [1, depth]."""
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = int(parents[node])
    return tokens[nodes[::-1]][None]


def prefixes(
    contexts: list[torch.Tensor],  # [1, L_b] per row
    draft_tokens: torch.Tensor,  # [B, k]
    parents: torch.Tensor | None,  # [B, k] for a tree draft, None for a chain
    filler: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences `positions` shows, [B, k + 1, W], and their lengths, [B, k + 1]: at [b, i],
    `contexts[b]` then the draft's path down to node i - 1 (a chain: `draft_tokens[b, :i]`), each
    token at the column it has in that sequence, right-padded with `filler`."""
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    context = pad_sequence([ctx[0] for ctx in contexts], batch_first=True, padding_value=filler)  # [B, L]
    context_lengths = torch.tensor([ctx.shape[1] for ctx in contexts], device=device)
    width = context.shape[1] + k
    # on_path[b, n, j]: node j lies on the path from the root down to node n (n included)
    if parents is None:  # a chain: nodes 0..n
        on_path = torch.ones(k, k, dtype=torch.bool, device=device).tril().expand(batch, k, k)
    else:  # the tree's ancestors, the row's last token (column 0) left out
        on_path = tree_layout(parents.to(device))[0][:, 1:, 1:]
    depth = on_path.sum(-1)  # [B, k] nodes on the path to each node, itself included
    # [B, k + 1, k] what position i shows: the path to node i - 1 (none at position 0)
    shown = torch.cat([on_path.new_zeros(batch, 1, k), on_path], dim=1)
    column = (context_lengths[:, None] + depth - 1)[:, None, :].expand(batch, k + 1, k)
    column = torch.where(shown, column, width)  # nodes off the path go to a spare column, dropped
    ids = draft_tokens.new_full((batch, k + 1, width + 1), filler)
    ids[:, :, : context.shape[1]] = context[:, None]
    ids.scatter_(2, column, draft_tokens[:, None, :].expand(batch, k + 1, k))
    lengths = context_lengths[:, None] + torch.cat([depth.new_zeros(batch, 1), depth], dim=1)
    return ids[..., :width], lengths
