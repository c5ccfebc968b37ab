"""Collecting emitted tokens row by row: stopping criteria, streaming and the returned output.

The collector holds every row's sequence, so it also says what a drafter is shown of them
(`draft_request`); `ReturnedStates` slices the attentions and hidden states a call returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .draft import DraftRequest
from .own_state import StateGuard, own_state
from .processing import as_row, indexes_rows
from .stats import SpeculativeStats

if TYPE_CHECKING:
    from .kv import RaggedKV
    from .processing import ScoreProcessor
    from .verify import Verdict


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
        # Token ids as plain generate returns them, whatever the prompt's integer type: it appends
        # each step's int64 tokens to the prompt, and `torch.cat` promotes the whole sequence.
        self.tokens = input_ids.new_zeros(batch, self.capacity, dtype=torch.long)
        self.tokens[:, : self.prompt_len] = input_ids
        self.mask = torch.ones(batch, self.capacity, dtype=torch.long, device=input_ids.device)
        if attention_mask is not None:
            self.mask[:, : self.prompt_len] = attention_mask
        self.attention_mask = self.mask[:, : self.prompt_len]
        self.lengths = [self.prompt_len] * batch
        self.finished = [self.prompt_len >= self.capacity] * batch
        # Per row, its length when a stopping criterion ended it; and the length every row ends at:
        # max_length, or, where plain generate keeps decoding stopped rows, where the last one stopped.
        self.stopped: list[int | None] = [None] * batch
        self.limit = self.capacity
        # A batch's criteria of one's own, called per row and token (`_stops`): their state checked.
        self._guards: dict[int, StateGuard] = {}
        self.streamer = streamer
        pad = generation_config._pad_token_tensor  # what plain generate writes after a row's end
        self.pad = pad if pad is not None else 0
        returned = bool(generation_config.return_dict_in_generate)
        self.keep_scores = returned and bool(generation_config.output_scores)
        self.keep_logits = returned and bool(generation_config.output_logits)
        self.keep_attentions = returned and bool(generation_config.output_attentions)
        self.keep_hidden_states = returned and bool(generation_config.output_hidden_states)
        self.keeps_per_token = any(
            (self.keep_scores, self.keep_logits, self.keep_attentions, self.keep_hidden_states)
        )
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]  # per row, [1, V] a token
        # The same as the batch a criterion of one's own is shown (`as_row`), [B, V] views a token,
        # each made once its token comes: made again at every token, they cost the call the square
        # of its tokens.
        self._scores_shown: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        # Per row, per token: a tuple over layers, as plain generate's step for it (see `TokenOutputs`).
        self.attentions: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(batch)]
        self.hidden_states: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in range(batch)]
        self.emitted = 0

    @property
    def active_rows(self) -> list[int]:
        return [r for r, done in enumerate(self.finished) if not done]

    def rows_cached(self) -> list[int]:
        """The rows whose cache the call still reads: those decoding and, where per-token outputs
        are returned, those that stopped before the length every row ends at, which `pad_steps`
        feeds their padding at the end. A row that reached that length is never padded (the limit
        only ever moves down to the longest row), so its cache is free."""
        return [
            row
            for row, done in enumerate(self.finished)
            if not done or (self.keeps_per_token and self.room(row) > 0)
        ]

    def room(self, row: int) -> int:
        """Tokens row `row` may still emit before `max_length` (or the length every row ends at)."""
        return self.limit - self.lengths[row]

    def row(self, row: int) -> torch.Tensor:
        return self.tokens[row : row + 1, : self.lengths[row]]

    def draft_request(
        self,
        rows: list[int],
        k: int,
        do_sample: bool,
        processor: ScoreProcessor,
        hidden_states: list[torch.Tensor] | None,
        tree: bool,
    ) -> DraftRequest:
        """What a drafter is told about the active `rows` when asked for up to `k` tokens each."""
        # While every row is active the drafter reads the collector's own tensors (no copy per step).
        select = slice(None) if len(rows) == len(self.lengths) else rows
        return DraftRequest(
            tokens=self.tokens[select],
            attention_mask=self.mask[select],
            lengths=[self.lengths[r] for r in rows],
            max_tokens=[min(k, self.room(r) - 1) for r in rows],
            do_sample=do_sample,
            processor=processor,
            row_ids=rows,
            hidden_states=hidden_states,
            tree=tree,
        )

    def emit(
        self,
        row: int,
        tokens: torch.Tensor,  # [n] accepted drafts then the target's token
        scores: torch.Tensor | None,  # [n, V] processed target scores they were chosen from
        logits: torch.Tensor | None,  # [n, V] raw target logits (each needed only when returned)
        stopping_criteria: StoppingCriteriaList,
        extras: TokenOutputs | None = None,  # attentions and hidden states, when returned
    ) -> None:
        """Append tokens to a row one at a time, stopping at the first that ends the row."""
        if self.finished[row]:  # cut back to where the batch's last row stopped, earlier in this step
            return
        start = self.lengths[row]
        tokens = tokens[: self.limit - start]  # what fits before max_length
        if self.keep_scores:  # the kept tokens' own, not a view holding the step's every row and draft
            scores = scores[: len(tokens)].clone()
        # Written at once (positions past the row's length are not part of it yet), then shown
        # to the criteria one token at a time, as plain generate would have.
        self.tokens[row, start : start + len(tokens)] = tokens
        n, ended = 0, False
        for i in range(len(tokens)):
            self.lengths[row] += 1
            n += 1
            if self.keep_scores:
                self.scores[row].append(scores[i : i + 1])  # [1, V]: this row as a batch of one
            # Criteria are called on this row's exact sequence, as plain generate calls them: with
            # every step's scores so far when output_scores keeps them, else None.
            step_scores = tuple(self.scores[row]) if self.keep_scores else None
            if self.stopped[row] is None and self._stops(row, stopping_criteria, step_scores):
                self.stopped[row] = self.lengths[row]
                if _pads_stopped_rows(stopping_criteria):
                    self.finished[row] = True
                    break
                if None not in self.stopped:  # the last row to stop: every row ends at the last stop
                    self.limit, ended = max(self.stopped), True
            if self.lengths[row] >= self.limit:
                break
        if self.lengths[row] >= self.limit:
            self.finished[row] = True
        self.emitted += n
        self._keep(row, n, logits, extras)
        if self.streamer is not None and n:
            self.streamer.put(tokens[:n].cpu())
        if ended:
            self._end_at(self.limit)

    def _keep(self, row: int, n: int, logits: torch.Tensor | None, extras: TokenOutputs | None) -> None:
        """Keep the logits, attentions and hidden states of row `row`'s next `n` tokens, as returned."""
        if self.keep_logits:
            self.logits[row].extend(logits[:n].to(torch.float32, copy=True)[:, None])  # as `scores`
        if extras is not None:
            self.attentions[row].extend(extras.attentions[:n])
            self.hidden_states[row].extend(extras.hidden_states[:n])

    def keep_padded(
        self,
        row: int,
        n: int,
        scores: torch.Tensor | None,  # [n, V] processed scores of the row's next n steps
        logits: torch.Tensor,  # [n, V] raw logits
        extras: TokenOutputs | None,
    ) -> None:
        """Keep what plain generate returns for a finished row's next `n` steps, at which it is
        padded (`pad_steps`): its sequence is not extended, `finish` pads it."""
        if self.keep_scores:
            self.scores[row].extend(scores[:, None])
        self._keep(row, n, logits, extras)

    def _end_at(self, limit: int) -> None:
        """Every row ends at `limit` tokens, where the last row stopped: plain generate, which keeps
        decoding stopped rows, stops the batch there. Rows decoded past it earlier in the step are cut
        back to it (the row that stopped last emitted no token past it)."""
        self.limit = limit
        for row, length in enumerate(self.lengths):
            if length >= limit:
                self.emitted -= length - limit
                self.lengths[row] = limit
                for per_token in (self.scores, self.logits, self.attentions, self.hidden_states):
                    del per_token[row][limit - self.prompt_len :]
                self.finished[row] = True

    def _stops(
        self, row: int, criteria: StoppingCriteriaList, scores: tuple[torch.Tensor, ...] | None
    ) -> bool:
        """Whether a criterion ends the row (each called, as `StoppingCriteriaList` calls them all)."""
        ids, batch = self.row(row), self.tokens.shape[0]
        as_batch = [indexes_rows(c) and batch > 1 for c in criteria]
        shown = self._batch_scores(row) if any(as_batch) and scores is not None else scores
        done = [
            as_row(lambda i, s, c=c: _per_row(c(i, s), batch), row, batch, ids, shown)
            if whole
            else _per_row(c(ids, scores), 1)
            for c, whole in zip(criteria, as_batch)
        ]
        if batch > 1:  # one row is shown each of its tokens once, in order, as plain shows them
            for c in criteria:
                if (watched := own_state(c)) is not None:
                    self._guard(c, watched).check()
        return any(bool(d[0]) for d in done)

    def _batch_scores(self, row: int) -> tuple[torch.Tensor, ...]:
        """Row `row`'s scores of every step so far, each [B, V] as a batch of that row (views):
        those of the tokens added since the last call are made, the others kept."""
        kept, shown = self.scores[row], self._scores_shown[row]
        del shown[len(kept) :]  # steps cut back (`_end_at`)
        shown.extend(s.expand(self.tokens.shape[0], *s.shape[1:]) for s in kept[len(shown) :])
        return tuple(shown)

    def _guard(self, criterion: object, watched: object) -> StateGuard:
        if id(criterion) not in self._guards:
            self._guards[id(criterion)] = StateGuard(criterion, watched, _ROWS_APART)
        return self._guards[id(criterion)]

    def emit_verdict(
        self,
        row: int,
        verdict: Verdict,
        b: int,  # the row's index in the step
        extras: TokenOutputs | None,
        stopping_criteria: StoppingCriteriaList,
    ) -> None:
        """`emit` a step's tokens for user row `row`: its accepted drafts and the target's own token."""
        n = verdict.accepted[b] + 1
        at = slice(0, n) if verdict.paths is None else verdict.fed(b)
        scores = verdict.scores[b, at] if self.keep_scores else None  # sliced only when returned
        logits = verdict.logits[b, at] if self.keep_logits else None
        self.emit(row, verdict.tokens[b, :n], scores, logits, stopping_criteria, extras)

    def cached_lengths(self, rows: list[int]) -> torch.Tensor:
        """Per row of `rows`, the real tokens plain decoding's cache holds at the end of the call:
        the prompt's (padding left out) and every generated token but the last (never fed)."""
        prompt = self.attention_mask.sum(dim=1)[rows]
        fed = [max(self.lengths[row] - self.prompt_len - 1, 0) for row in rows]
        return prompt + torch.tensor(fed, device=prompt.device)

    def sequences(self) -> tuple[list[torch.Tensor], list[int]]:
        """Each row's sequence so far without its padding [n_b], and how many of its tokens are its
        prompt's (what `Drafter.finish` is shown)."""
        real = self.mask.bool()
        rows = [self.tokens[row, :length][real[row, :length]] for row, length in enumerate(self.lengths)]
        prompts = self.attention_mask.sum(dim=1).tolist()
        return rows, prompts

    def finish(self, stats: SpeculativeStats, cache: Any) -> Any:
        """Build what `generate` returns: padded sequences, or the output dataclass."""
        if self.streamer is not None:
            self.streamer.end()
        length = max(self.lengths)
        sequences = self.tokens[:, :length].clone()
        for row, row_length in enumerate(self.lengths):
            if row_length < length:
                # Rows that stopped early are padded, as plain generate pads finished rows.
                sequences[row, row_length:] = self.pad
        if not self.config.return_dict_in_generate:
            return sequences
        steps = length - self.prompt_len
        return SpeculativeGenerateOutput(
            sequences=sequences,
            scores=_per_step(self.scores, steps) if self.keep_scores else None,
            logits=_per_step(self.logits, steps) if self.keep_logits else None,
            attentions=_per_step_layers(self.attentions, steps, 0) if self.keep_attentions else None,
            hidden_states=(
                _per_step_layers(self.hidden_states, steps, _ROWS) if self.keep_hidden_states else None
            ),
            **{_CACHE_FIELD: cache},
            speculative_stats=stats,
        )


def _per_step(per_row: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...]:
    """Rows' per-token tensors [1, V] regrouped per generation step, [B, V] each, as generate
    returns them (a finished row's steps included: `pad_steps`)."""
    _check_steps(per_row, steps)
    return tuple(torch.cat([row[step] for row in per_row]) for step in range(steps))


def _check_steps(per_row: list[list[Any]], steps: int) -> None:
    """Every row holds one entry per step: a missing one would shift every later step's rows."""
    if any(len(row) != steps for row in per_row):
        raise RuntimeError(f"rows kept {[len(row) for row in per_row]} steps of outputs, not {steps} each")


_ROWS_APART = (
    "A batch's rows are verified apart, so speculation calls it once per row and token, where plain "
    "generate calls it once a step for the whole batch (a batch of one row it calls as plain does)."
)


def _per_row(answer: Any, rows: int) -> torch.Tensor:
    """A stopping criterion's answer for a batch of `rows` rows, one entry a row. Plain generate
    reads it as `is_done | answer`, broadcast: a bool or a tensor of one element (what criteria
    written for older transformers return) answers for every row."""
    answer = torch.as_tensor(answer)
    return answer.reshape(1).expand(rows) if answer.numel() == 1 else answer


def _pads_stopped_rows(criteria: StoppingCriteriaList) -> bool:
    """Whether plain generate pads a row once a criterion has stopped it, as it does only where an EOS
    criterion is among them (its `has_eos_stopping_criteria`); else it keeps decoding the row."""
    return any(hasattr(criterion, "eos_token_id") for criterion in criteria)


# A hidden state's row and position are its last dimensions but one and two: [rows, positions, hidden],
# or with model streams before them (Gemma 3n: [altup streams, rows, positions, hidden]).
_ROWS, _POSITIONS = -3, -2


def _per_step_layers(
    per_row: list[list[tuple[torch.Tensor, ...]]], steps: int, rows: int
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Rows' per-token layer tuples regrouped per generation step, each layer's tensors joined over
    rows (their dimension `rows`), as generate returns attentions and hidden states."""
    _check_steps(per_row, steps)
    return tuple(
        tuple(torch.cat(layer, dim=rows) for layer in zip(*(row[step] for row in per_row)))
        for step in range(steps)
    )


@dataclass
class TokenOutputs:
    """What plain generate returns per generated token beside its scores, for the tokens of one row's
    step: `attentions[j]` / `hidden_states[j]` are token j's tuples over layers, each tensor sliced
    to that row ([1, ...]) and to the positions plain decoding would have run for it."""

    attentions: list[tuple[torch.Tensor, ...]]
    hidden_states: list[tuple[torch.Tensor, ...]]


class ReturnedStates:
    """The attentions and hidden states a call returns, sliced from the target's forwards."""

    def __init__(self, out: OutputCollector, target: RaggedKV, drafter_hidden_states: bool) -> None:
        self.out = out
        self.target = target
        self.wanted = out.keep_attentions or out.keep_hidden_states
        self.switches = {}  # asked of every target forward: only then does the model compute them
        if out.keep_attentions:
            self.switches["output_attentions"] = True
        if out.keep_hidden_states or drafter_hidden_states:
            self.switches["output_hidden_states"] = True

    def prompt(self, output: Any, rows: list[int]) -> list[TokenOutputs] | None:
        """The first token's of each of `rows`, from the prompt's forward `output`."""
        if not self.wanted:
            return None
        keep = self.out.keep_attentions, self.out.keep_hidden_states
        chunk = self.out.config.prefill_chunk_size
        windows = self.target.layer_windows if chunk else None
        return [prompt_outputs(output, row, *keep, chunk, windows) for row in rows]

    def step(self, output: Any, slots: list[int], verdict: Verdict, width: int) -> list[TokenOutputs] | None:
        """The emitted tokens' of a verify forward `output` of `width` tokens a row, request row b
        at cache row `slots[b]`; read before the cache is rolled back (the columns each attended to)."""
        if not self.wanted:
            return None
        return self._sliced(output, self.target, slots, [verdict.fed(b) for b in range(len(slots))], width)

    def padded(self, output: Any, kv: RaggedKV, widths: list[int]) -> list[TokenOutputs] | None:
        """A finished row's padded steps' (`pad_steps`), from a forward `output` through `kv` (the
        rows apart) of `widths[b]` tokens for row b."""
        fed = [list(range(n)) for n in widths]
        return self._sliced(output, kv, list(range(len(widths))), fed, max(widths))

    def _sliced(
        self, output: Any, kv: RaggedKV, slots: list[int], fed: list[list[int]], width: int
    ) -> list[TokenOutputs] | None:
        if not self.wanted:
            return None
        past = kv.width - width
        return [
            step_outputs(
                output,
                slot,
                kv.sequence_columns(slot, past),
                past,
                fed[b],
                kv.layer_windows,
                self.out.keep_attentions,
                self.out.keep_hidden_states,
            )
            for b, slot in enumerate(slots)
        ]


def prompt_outputs(
    output: Any,
    row: int,
    keep_attentions: bool,
    keep_hidden_states: bool,
    chunk_size: int | None = None,
    layer_windows: list[int | None] | None = None,
) -> TokenOutputs:
    """The first token's: plain decoding's first forward is the whole prompt, every position of it.
    With `prefill_chunk_size` (`chunk_size`) plain prefills chunk by chunk and returns its last
    forward's: the last chunk's queries, over every key before them (a sliding-window layer, of
    `layer_windows`, only over the keys its cache kept: its window's last but one, then the chunk)."""
    attentions = tuple(a[row : row + 1] for a in _attentions(output)) if keep_attentions else ()
    hidden = tuple(h.narrow(_ROWS, row, 1) for h in output.hidden_states) if keep_hidden_states else ()
    if chunk_size:
        windows = layer_windows or [None] * len(attentions)
        hidden = tuple(_last_chunk(h, chunk_size) for h in hidden)
        attentions = tuple(_last_chunk(a, chunk_size, window) for a, window in zip(attentions, windows))
    return TokenOutputs([attentions], [hidden])


def _last_chunk(states: torch.Tensor, chunk_size: int, window: int | None = None) -> torch.Tensor:
    """The prompt's `states` ([..., queries, keys or hidden size]) as plain's last prefill chunk has
    them: its queries; an attention layer's with a sliding `window`, over the keys its cache kept
    (the window's last but one before the chunk, then the chunk)."""
    last = (states.shape[_POSITIONS] - 1) % chunk_size + 1
    states = states[..., -last:, :]
    return states if window is None else states[..., -min(states.shape[-1], window - 1 + last) :]


def _attentions(output: Any) -> tuple[torch.Tensor, ...]:
    """A forward's attention weights per layer; none from a model that cannot return them (sdpa),
    which plain generate returns as they come, an empty tuple a step."""
    weights = tuple(output.attentions or ())
    return weights if weights and weights[0] is not None else ()


def step_outputs(
    output: Any,
    slot: int,
    columns: torch.Tensor,  # [n] the row's cache columns before this forward, in plain's layout
    past: int,  # cache columns before this forward (the fed tokens' keys follow them)
    fed: list[int],  # the fed positions the row's emitted tokens were chosen at
    layer_windows: list[int | None],
    keep_attentions: bool,
    keep_hidden_states: bool,
) -> TokenOutputs:
    """A verify forward's outputs for the tokens it emitted for cache row `slot`, as plain decoding
    would have returned them token by token: each token's query alone, attending to the row's
    sequence so far (its columns before this forward, then the fed tokens of the accepted path up to
    itself). The columns left out, holes of rejected drafts and other branches of a tree, had
    attention weight zero, so nothing is lost. A sliding-window layer keeps only its window's last
    keys, as transformers' sliding cache gives them to a decoding step."""
    weights = _attentions(output) if keep_attentions else ()
    # The emitted tokens' hidden states copied out of the forward's (a view of a token's would hold
    # every row's every fed position, rejected drafts included, until the call's end).
    states = output.hidden_states if keep_hidden_states else ()
    if states:
        emitted = torch.tensor(fed, device=states[0].device)
        states = tuple(h.narrow(_ROWS, slot, 1).index_select(_POSITIONS, emitted) for h in states)
    attentions, hidden = [], []
    for j, query in enumerate(fed):
        keys = torch.cat([columns, past + torch.tensor(fed[: j + 1], device=columns.device)])
        attentions.append(
            tuple(
                layer[slot : slot + 1, :, query : query + 1].index_select(
                    -1, keys[-window:] if window else keys
                )
                for layer, window in zip(weights, layer_windows)
            )
        )
        hidden.append(tuple(h.narrow(_POSITIONS, j, 1) for h in states))
    return TokenOutputs(attentions, hidden)
