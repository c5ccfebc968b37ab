"""A transformers `StaticCache` for speculative decoding: rolling back is bookkeeping, never a copy.

transformers 5.24's `StaticLayer` preallocates its keys and values, [B, heads, max_cache_len,
head_dim], and writes each forward's states at its own write position, `cumulative_length` (a 0-dim
tensor with a static address, so compiled graphs and CUDA graphs read it in place), then advances
it by the forward's width. The causal mask is built from that position over all `max_cache_len`
columns. A forward no longer takes `cache_position=` (a model swallows it into `**kwargs` and
ignores it), so rejected drafts are rolled back by setting the write position back: their columns
are overwritten by later forwards and, until then, lie after every query's own column, where the
causal mask hides them.

Rows share the columns (one write position for the batch), so a ragged batch keeps holes as
`RaggedKV` does: a row's rejected positions stay as holes, only the columns that are holes in
every row are given back, and the model is handed the [B, max_cache_len] mask of real columns as
its 2D attention mask (its causal mask still hides the unused columns). With one row and no hole
there is no mask, as in plain static-cache decoding; a batch of several rows always passes it, so
that a compiled forward has one graph per width rather than one with and one without a mask (the
model builds the same mask either way: a static cache's steps never skip it).

For a compiled forward, each forward after the prompt's is padded to the next of a few fixed
`widths` with masked positions, so the model sees one shape per width; the padding's columns are
holes in every row and given back at once.

A cache has a fixed number of columns, and holes use them up. When a forward does not fit, the
real columns of the rows still decoding are moved to the front of each row (`compact`), and if
that is not enough the forward is refused with an error naming the length needed: never a silent
truncation. `widest` says how wide a forward fits now, so a caller can shorten its draft instead.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from .compat import cache_argument, compiles_decoding, forward_takes, generate_cache
from .kv import RaggedKV, Slots, check_kept_in, counts_columns, gather_columns, mark_holes, real_first
from .verify_shape import VerifyShape

# The verify widths a compiled forward is padded to: one graph each (dynamo's recompile limit is 8),
# so a draft is at most 15 tokens.
COMPILED_WIDTHS = (1, 2, 4, 8, 16)

# Dynamo compiles at most `recompile_limit` graphs per function (8 by default; it counts per code
# object, and every transformers model's forward goes through one wrapper), then runs new shapes
# eagerly, or fails under `fullgraph=True`. A static-cache shape here is compiled at every padded
# width, so the limit is raised by that many graphs the first time each shape is compiled, up to:
MAX_RECOMPILE_LIMIT = 64
# Dynamo keeps a code object's graphs for every thread but reads its settings per thread (context
# variables, torch 2.13): the process counts the graphs its shapes take (`_GRAPHS`), and each
# context raises its own limit by those it has not made room for yet (`_ROOM_MADE`). Shapes are
# keyed by model object, so a process loading models again and again stops recording them once the
# count is at the most the limit is raised to.
_SHAPES_COMPILED: set[tuple[Any, ...]] = set()
_GRAPHS = 0
_SHAPES_LOCK = threading.Lock()
_ROOM_MADE: contextvars.ContextVar[int] = contextvars.ContextVar("hf_specdec_room_made", default=0)


def allow_graphs(shape: tuple[Any, ...], graphs: int) -> None:
    """Make room in dynamo's recompile limit for the `graphs` a new compiled `shape` (its forward's
    owner, batch size and cache length) takes, and, on a thread that has not yet, for those of the
    shapes compiled before on other threads; once per shape and thread, up to MAX_RECOMPILE_LIMIT."""
    import torch._dynamo

    global _GRAPHS
    with _SHAPES_LOCK:
        if shape not in _SHAPES_COMPILED and _GRAPHS < MAX_RECOMPILE_LIMIT:
            _SHAPES_COMPILED.add(shape)
            _GRAPHS = min(_GRAPHS + graphs, MAX_RECOMPILE_LIMIT)
        owed = _GRAPHS - _ROOM_MADE.get()
        _ROOM_MADE.set(_GRAPHS)
    if owed <= 0:
        return
    # Read from a copy of dynamo's settings, not as an attribute: a `del` on the config module (as
    # pytest's monkeypatch undoes a setattr since 9.2) hides the attribute but not its value.
    limit = torch._dynamo.config.get_config_copy()["recompile_limit"]
    torch._dynamo.config.recompile_limit = max(limit, min(limit + owed, MAX_RECOMPILE_LIMIT))


class StaticKV:
    """A `StaticCache` plus which of its columns hold real tokens, row by row."""

    takes_tree_masks = False  # tree drafts need 4D masks, not built here yet
    tree_refusal = None  # trees over a static cache are refused before (`integration._drafts_trees`)

    def __init__(
        self,
        model: PreTrainedModel,
        cache: StaticCache,
        batch_size: int,
        device: torch.device,
        widths: tuple[int, ...] = (),
        decode: Callable[..., Any] | None = None,
        compile_config: CompileConfig | None = None,
    ):
        """`widths`: the forwards after the prompt's are padded to the next of these (none: fed as
        they come). `decode`: what runs those forwards, e.g. the model compiled (`compile_config`
        says how, for a drafter to compile its own model alike); the prompt's forward, and any
        wider than the widest of `widths` (a draft's catch-up after plain steps), always run the
        model itself, as `generate` runs the prompt's: a shape seen once."""
        check_layers(model, cache)
        if any(width < 1 for width in widths):
            raise ValueError(f"widths must be positive, got {widths}")
        self.model = model
        self.cache = cache
        self.decode = decode if decode is not None else model
        self.compiled = decode is not None
        self.compile_config = compile_config
        self.fed_widths: set[int] = set()  # the padded widths `decode` has run
        self.compiling = False  # whether the last forward was `decode`'s first at its width
        self.widths = tuple(sorted(set(widths)))
        # Holes past a draft are not fed: widths are padded here, and a mask over a batch of one
        # would be a new compiled graph at every width. Rows are retired, never dropped.
        self.verify_shape = VerifyShape(widths=self.widths, feeds_holes=False, fixed_batch=True)
        self.capacity = max(layer.max_cache_len for layer in cache.layers)
        if self.compiled:  # a new shape for each width, beside any other model's (a target's, a draft's)
            allow_graphs((id(model), batch_size, self.capacity), len(self.widths))
        self.mask = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=device)  # real columns
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens per row
        self.active = torch.ones(batch_size, dtype=torch.bool, device=device)  # rows still decoding
        # Per row, the position of its next token minus `lengths` (None: 0), as in RaggedKV.
        self.offsets: torch.Tensor | None = None
        self.end = 0  # columns [0, end) are in use; the next forward writes at `end`
        self.prompt_width = 0  # columns of the first forward (the prompt's), padding included
        self.all_real = True  # whether `mask[:, :end]` has no hole
        self.needs_mask = batch_size > 1  # else only once a hole appears
        self.compactions = 0
        # Whether the call hands its cache back: retired rows' columns, which `compact` gives away,
        # are then kept `aside` first (each group a cache of its own, with its rows), as in `RaggedKV`.
        self.hands_back = False
        self.aside: list[tuple[RaggedKV, list[int]]] = []
        self.rejoins = True  # StaticLayers only (`check_layers`): rows taken apart join back
        self.laid_out = False  # whether `hand_back` laid the columns out as plain decoding's
        self.keeps_logits = forward_takes(model, "logits_to_keep")
        self.takes_positions = forward_takes(model, "position_ids")  # else generate gives none, nor do we

    @classmethod
    def for_generate(
        cls,
        model: PreTrainedModel,
        cache: StaticCache,
        batch_size: int,
        device: torch.device,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
    ) -> StaticKV:
        """Over the cache `generate` prepared, its forwards after the prompt's compiled (padded to
        `COMPILED_WIDTHS`) exactly where transformers' own decoding would compile them: opt-in on
        CPU, by default on a GPU. `compile_config`'s `dynamic=None` becomes False: one graph per
        width, where dynamo would otherwise recompile the second width with a dynamic length."""
        if not compiles_decoding(model, generation_config, model_kwargs):
            return cls(model, cache, batch_size, device)
        # As transformers compiles: its default per device (TPU and Neuron take their own backends).
        config = (
            generation_config.compile_config or getattr(model, "_default_compile_config", CompileConfig)()
        )
        if config.dynamic is None:
            config = dataclasses.replace(config, dynamic=False)
        return cls(model, cache, batch_size, device, COMPILED_WIDTHS, model.get_compiled_call(config), config)

    @property
    def width(self) -> int:
        return self.end

    def padded_width(self, width: int) -> int:
        """The width a forward of `width` tokens after the prompt's is fed at."""
        return self.verify_shape.padded(width)

    def widest(self, wanted: int) -> int:
        """The most tokens, up to `wanted` (at most the widest of `widths`, if any), that the next
        forward can take padded, compacting first if that makes room; 0 if not even one fits."""
        if self.widths:
            wanted = min(wanted, self.widths[-1])
        if self.end + self.padded_width(wanted) > self.capacity and not self.all_real:
            self.compact()
        room = self.capacity - self.end
        if not self.widths:
            return min(wanted, room)
        if self.padded_width(wanted) <= room:
            return wanted
        return max((w for w in self.widths if w <= room), default=0)

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None,
        logits_to_keep: int = 0,
        positions: torch.Tensor | None = None,
        **inputs: Any,
    ) -> Any:
        """Run the model on `tokens` [B, T] (only `valid` [B, T] ones are real; None: all) and cache them.

        `positions` [B, T], for the first forward only: the prompt's own positions (generate's),
        which each row's later tokens continue. `inputs`: more arguments of the model's forward;
        a tensor [B, T, ...] of them is per position (an EAGLE head's `features`) and padded alike.
        Returns the model output with `.logits` of the last `logits_to_keep` of the T positions
        (all if 0) and `.hidden_states` of the T positions, padding cut off.
        """
        width = tokens.shape[1]
        # The prompt's forward, or one wider than any compiled width: run as it comes, eagerly.
        first = self.end == 0 or (bool(self.widths) and width > self.widths[-1])
        padded = width if first else self.padded_width(width)
        self._make_room(padded)
        given = positions is not None
        if not given:
            positions = self._next_positions(width, valid)
        real = valid if valid is not None else torch.ones_like(tokens, dtype=torch.bool)
        start = self.end
        self.mask[:, start : start + width] = real
        self.lengths += real.sum(dim=1)
        self.all_real = self.all_real and (valid is None or bool(valid.all()))
        if first and given:
            offsets = positions[:, -1] + 1 - self.lengths  # generate continues from the last position
            self.offsets = offsets if bool(offsets.any()) else None
        if padded > width:  # masked positions: any input (the last one's), positions continuing the row's
            extra = padded - width
            tokens = _pad_positions(tokens, extra)
            after = torch.arange(1, extra + 1, device=positions.device)
            positions = torch.cat([positions, positions[:, -1:] + after], dim=1)
            inputs = {
                name: _pad_positions(value, extra) if _per_position(value, tokens.shape[0], width) else value
                for name, value in inputs.items()
            }
        keep = 0 if logits_to_keep == 0 else logits_to_keep + padded - width
        if self.compiled and not first and keep:
            keep = padded  # one value per padded width: a compiled graph specializes on it
        call = self.model if first else self.decode
        self.compiling = self.compiled and not first and padded not in self.fed_widths
        if not first:
            self.fed_widths.add(padded)
        out = call(
            input_ids=tokens,
            attention_mask=self.mask if self.needs_mask or not self.all_real else None,
            **({"position_ids": positions} if self.takes_positions else {}),
            **{cache_argument(self.model): self.cache},
            use_cache=True,
            **inputs,
            **({"logits_to_keep": keep} if self.keeps_logits else {}),
        )
        self.end = start + width
        if start == 0:
            self.prompt_width = width
            check_kept_in(self.model, self.cache, out, 0)  # never handed in filled (`check_continued`)
        if padded > width:  # the model advanced its write position past the padding
            self._set_write_position(self.end)
        logits = out.logits if self.keeps_logits or not keep else out.logits[:, -keep:]
        logits = logits[:, : logits.shape[1] - (padded - width)]
        if self.compiled and not first and logits.is_cuda:
            # A CUDA graph's outputs are overwritten by its next replay: logits a caller keeps (fp32
            # ones returned as logits or scores, which `.float()` does not copy) must be their own.
            logits = logits.clone()
        out.logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        hidden = out.get("hidden_states")
        if padded > width and hidden is not None:  # a tuple per layer (a target's) or one tensor (a head's)
            out.hidden_states = (
                hidden[:, :width] if torch.is_tensor(hidden) else tuple(h[:, :width] for h in hidden)
            )
        return out

    def forward_rows(
        self,
        slots: Slots,
        tokens: torch.Tensor,  # [B, T] for the rows at `slots`
        valid: torch.Tensor | None,  # [B, T] which are real; None: all
        parents: torch.Tensor | None = None,
        **inputs: Any,
    ) -> Any:
        """`RaggedKV.forward_rows` for chains: every row not at `slots` is fed T holes. Returns the
        model's output over the whole batch, logits of all T positions."""
        if parents is not None:
            raise ValueError("tree drafts over a static cache are not built; check_supported refuses them")
        return self.forward(*slots.fed(tokens, valid), logits_to_keep=tokens.shape[1], **inputs)

    def roll_back(
        self,
        slots: Slots,
        width: int,
        rejected: list[int],
        paths: list[list[int]] | None = None,
        widened: bool = False,
    ) -> None:
        """Undo what the last forward rejected: the last `rejected[b]` real tokens of row
        `slots.rows[b]` (`widened` never holds here: see `verify_shape`)."""
        if any(rejected):
            self.truncate(slots.less(self.lengths, rejected))

    def release_rows(self, cached_rows: list[int], active: list[int], keep_shape: bool = False) -> list[int]:
        """The rows of `cached_rows` (the user's rows, one per cache row) not in `active` are no
        longer read: they are retired, not dropped (the batch is the compiled shape, and a
        StaticCache cannot drop rows: its shape is always kept). Rows kept `active` after they
        finished (read at the end: `rows_apart`) keep their columns through `compact`. Returns the
        user rows the cache holds, unchanged."""
        finished = [i for i, row in enumerate(cached_rows) if row not in active]
        if finished:
            self.retire(torch.tensor(finished, device=self.mask.device))
        return cached_rows

    def _next_positions(self, width: int, valid: torch.Tensor | None) -> torch.Tensor:
        """The positions of `width` tokens fed next, [B, width]: each row's numbering continued."""
        start = self.lengths if self.offsets is None else self.lengths + self.offsets
        if valid is None:
            return start[:, None] + torch.arange(width, device=start.device)
        # Real tokens continue each row's own numbering; holes get any position, they are masked.
        return (start[:, None] + valid.cumsum(dim=1) - 1).clamp_min(0)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b; the rest become holes, and
        the columns that are holes in every row are given back (the write position moves back)."""
        self.mask &= self.mask.cumsum(dim=1) <= lengths[:, None]
        self.lengths = self.mask.sum(dim=1)
        used = torch.nonzero(self.mask.any(dim=0))
        self.end = 0 if used.numel() == 0 else int(used[-1]) + 1
        self._set_write_position(self.end)
        self.all_real = bool(self.mask[:, : self.end].all())

    def retire(self, rows: torch.Tensor) -> None:
        """Rows `rows` have finished: they stay in the batch (its shape is the compiled one), fed
        masked tokens, but their columns are free for `compact` to reuse."""
        self.active[rows] = False

    def compact(self) -> None:
        """Move the real columns of the rows still decoding to the front of each row, in order.

        A copy of the whole cache, made only when a forward would not fit otherwise. The keys carry
        their positions (rotary embeddings are applied before caching), so moving columns keeps
        attention as it was, up to the rounding of sums taken in another order.
        """
        if self.hands_back:
            apart = {row for _, rows in self.aside for row in rows}
            leaving = [row for row in torch.nonzero(~self.active).flatten().tolist() if row not in apart]
            if leaving:
                self.aside.append((self.rows_apart(leaving), leaving))
        keep = self.mask & self.active[:, None]
        # Finished rows keep one column visible, so their (ignored) queries never see an empty row.
        keep[~self.active, 0] = True
        order = real_first(keep)  # [B, capacity]
        for layer in self.cache.layers:
            if not layer.is_initialized:  # never written: Mllama's cross-attention layers without an image
                continue
            for states in (layer.keys, layer.values):  # [B, heads, capacity, head_dim]
                states.copy_(gather_columns(states, order))
        self.mask.copy_(keep.gather(1, order))
        self.lengths = self.mask.sum(dim=1)  # unchanged for the rows still decoding
        self.end = int(keep[self.active].sum(dim=1).max()) if bool(self.active.any()) else 1
        self._set_write_position(self.end)
        self.all_real = bool(self.mask[:, : self.end].all())
        self.compactions += 1

    def rows_apart(self, rows: list[int]) -> RaggedKV:
        """Cache rows `rows` alone, as a dynamic cache over a copy of their columns in use (room for
        more past them, which this cache may lack): what is fed through it leaves this cache as it is."""
        index = torch.tensor(rows, device=self.mask.device)
        cache = DynamicCache()
        for i, layer in enumerate(self.cache.layers):
            cache.update(layer.keys[index, :, : self.end], layer.values[index, :, : self.end], i)
        mask = self.mask[index, : self.end]
        apart = RaggedKV(self.model, cache, len(rows), self.mask.device, attention_mask=mask)
        apart.offsets = None if self.offsets is None else self.offsets[index]
        return apart

    def held_rows(self, cached_rows: list[int]) -> list[tuple[RaggedKV, list[int]]]:
        """Every row the call keeps (`cached_rows`: all, in order), as dynamic caches over copies of
        their columns, with the user row at each of their rows: those in this cache, and those set
        `aside` before a compaction gave their columns away."""
        apart = {row for _, rows in self.aside for row in rows}
        here = [row for row in cached_rows if row not in apart]
        return [(self.rows_apart(here), here), *self.aside]

    def hand_back(self, whole: RaggedKV) -> None:
        """Hold `whole`'s columns (every row, in order, without holes: plain decoding's layout) from
        column 0, the write position after them, the columns past them zero as plain's are."""
        width = whole.width  # at most plain's, which `check_static_cache` made room for
        for layer, joined in zip(self.cache.layers, whole.cache.layers):
            for states, new in ((layer.keys, joined.keys), (layer.values, joined.values)):
                states[:, :, :width].copy_(new)
                states[:, :, width:].zero_()
        self.mask.zero_()
        self.mask[:, :width] = whole.mask
        self.lengths = self.mask.sum(dim=1)
        self.end, self.all_real, self.aside, self.laid_out = width, bool(whole.mask.all()), [], True
        self._set_write_position(width)

    def finished_cache(self) -> StaticCache:
        """The cache to hand back at the end of a call, its write position after the last real column.
        Where its layout is not plain decoding's (holes of rejected drafts or of rows that finished
        early, or columns `compact` moved that `hand_back` did not lay out again), it is marked so
        that no call continues it (`holds_holes`): plain decoding would read its holes as tokens and
        its columns at the wrong positions."""
        moved = self.compactions and not self.laid_out
        if moved or not bool(self.mask[:, self.prompt_width : self.end].all()):
            mark_holes(self.cache)
        return self.cache

    def plain_layout(self) -> bool:
        """Whether the columns are laid out as plain decoding's: none moved, no hole past the prompt."""
        return not self.compactions and bool(self.mask[:, self.prompt_width : self.end].all())

    def _make_room(self, width: int) -> None:
        if self.end + width > self.capacity and not self.all_real:
            self.compact()
        if self.end + width > self.capacity:
            raise ValueError(
                f"The static cache holds {self.capacity} positions, and this forward needs "
                f"{self.end + width} ({self.end} in use, {width} fed). Give the cache more room: "
                f"generate(..., max_cache_len={self.end + width}) or a StaticCache with that max_cache_len."
            )

    def _set_write_position(self, column: int) -> None:
        """Where every layer writes next; in place, so compiled graphs keep reading the same tensor."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(column)


class DraftRows:
    """A drafter's static cache (`StaticKV`) seen as a `drafters.decoder.DecoderCache` over the rows
    its requests hold. The batch is the compiled shape, so a row that finished is not dropped, as a
    dynamic cache drops it (`select_rows`), but retired: fed holes from then on, its columns free
    for `compact` to reuse. Only a request's rows are fed, taken and returned, in its order."""

    takes_tree_masks = False  # as StaticKV: trees are not drafted over a static cache

    def __init__(self, kv: StaticKV) -> None:
        self.kv = kv
        self.batch_size = kv.mask.shape[0]
        self.slots = Slots(list(range(self.batch_size)), self.batch_size, kv.mask.device)

    @staticmethod
    def room(capacity: int, widths: tuple[int, ...]) -> int:
        """The positions a draft's static cache needs beside a target's of `capacity`: what the
        target holds, a padded catch-up and a chain beyond it (a batch's rows advance unevenly:
        `compact` gives back the holes, never the room a row's own tokens need)."""
        return capacity + 2 * max(widths)

    @classmethod
    def compiled(
        cls, kv: StaticKV, inputs: Callable[[int], dict[str, torch.Tensor]] = lambda width: {}
    ) -> DraftRows:
        """`kv`, a draft's compiled static cache, with every width compiled now: its first forward
        runs eagerly, then one at each width, fed as drafting feeds them (contiguous: a graph is
        specialized on strides), with `inputs(width)` beside the tokens. Each width's first call
        is its compile: made here, it is no cost the policy could take for drafting's. The cache
        holds one dummy token a row, which the first draft truncates away."""
        batch_size, device = kv.mask.shape[0], kv.mask.device
        for width in (1, *kv.widths):
            tokens = torch.zeros(batch_size, width, dtype=torch.long, device=device)
            kv.forward(tokens, torch.ones_like(tokens, dtype=torch.bool), logits_to_keep=1, **inputs(width))
            kv.truncate(torch.ones(batch_size, dtype=torch.long, device=device))
        return cls(kv)

    def forward(
        self, tokens: torch.Tensor, valid: torch.Tensor | None, logits_to_keep: int = 0, **inputs: Any
    ):
        """`DecoderCache.forward` for the request's rows; the others are fed holes. Per-position
        tensors of `inputs` ([B, T, ...], an EAGLE head's features) are placed alike."""
        if self.slots.whole:
            return self.kv.forward(tokens, valid, logits_to_keep, **inputs)
        rows, width = tokens.shape
        inputs = {
            name: self.slots.placed(value) if _per_position(value, rows, width) else value
            for name, value in inputs.items()
        }
        out = self.kv.forward(*self.slots.fed(tokens, valid), logits_to_keep, **inputs)
        out.logits = self.slots.gather(out.logits)
        hidden = out.get("hidden_states")
        if torch.is_tensor(hidden):
            out.hidden_states = self.slots.gather(hidden)
        return out

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep the first `lengths[b]` real tokens of the request's row b; the others keep theirs."""
        self.kv.truncate(self.slots.scatter(lengths, self.kv.lengths.clone()))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep the request's `rows`, in that order; the rows left out have finished and are
        retired. A row cannot be copied (its columns are its own in the compiled batch)."""
        chosen = [self.slots.rows[i] for i in rows.tolist()]
        if len(set(chosen)) < len(chosen):
            raise ValueError(f"A static draft cache cannot copy rows (asked for {rows.tolist()}).")
        left = sorted(set(self.slots.rows) - set(chosen))
        if left:
            self.kv.retire(torch.tensor(left, device=self.kv.mask.device))
        self.slots = Slots(chosen, self.batch_size, self.kv.mask.device)


def _pad_positions(values: torch.Tensor, extra: int) -> torch.Tensor:
    """`values` [B, T, ...] followed by `extra` copies of its last position (contiguous: a compiled
    graph is specialized on strides)."""
    return torch.cat([values, values[:, -1:].expand(-1, extra, *values.shape[2:])], dim=1)


def _per_position(value: Any, batch: int, width: int) -> bool:
    return torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, width)


def check_layers(model: PreTrainedModel, cache: StaticCache) -> None:
    """Refuse a cache whose layers cannot be rolled back by moving their write position."""
    if (refusal := layers_refusal(model, cache)) is not None:
        raise ValueError(refusal)


def layers_refusal(model: PreTrainedModel, cache: StaticCache) -> str | None:
    """Why a cache's layers cannot be rolled back by moving their write position, else None."""
    for layer in cache.layers:
        if type(layer) is not StaticLayer:
            return (
                f"speculative= rolls a static cache back by moving its write position, which needs "
                f"full-attention StaticLayers; {type(model).__name__}'s cache has a {type(layer).__name__} "
                "(a sliding window kept as a ring buffer, or a recurrent state: moving a write position "
                "cannot restore them). "
                "Use the default dynamic cache (drop cache_implementation='static')."
            )
    lengths = sorted({layer.max_cache_len for layer in cache.layers})
    if len(lengths) > 1:
        # Mllama sizes its cross-attention layers by its images' patches, not by the text: one write
        # position and one capacity for all layers would write past the shorter ones.
        return (
            f"speculative= over a static cache needs every layer to hold the same positions; "
            f"{type(model).__name__}'s holds {' and '.join(map(str, lengths))} (cross-attention layers sized "
            "for its images). Use the default dynamic cache (drop cache_implementation='static')."
        )
    return None


def target_cache(
    model: Any,
    batch: int,
    device: torch.device,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
) -> RaggedKV | StaticKV:
    """The target's cache as `generate` prepared it: a StaticCache (`cache_implementation="static"`
    or one passed in) rolled back by its write position, compiled where transformers would compile it;
    else a DynamicCache with holes."""
    counted = counts_columns(model) if batch > 1 else None
    if counted is not None:
        raise ValueError(
            f"{type(model).__name__} {counted}, and the rows of a batch keep different numbers of draft "
            "tokens, whose holes would be counted too: call generate with one sequence at a time (batch "
            f"size {batch} here, num_return_sequences counted), or drop speculative=."
        )
    cache = generate_cache(model_kwargs)
    if isinstance(cache, StaticCache):
        return StaticKV.for_generate(model, cache, batch, device, generation_config, model_kwargs)
    return RaggedKV(model, cache, batch, device, attention_mask=model_kwargs.get("attention_mask"))
