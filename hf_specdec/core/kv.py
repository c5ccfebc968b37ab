"""A model's KV cache for rows that grow at different rates.

Each step every row feeds the same number of positions, but rows keep different numbers of them
(each accepts its own number of draft tokens). Rejected positions are not removed from the
middle of a row: they stay in the cache as holes that the attention mask hides, and only the
columns that are holes in every row are cropped off the end. With one row (or rows that agree)
nothing is ever a hole and the mask is dropped, so batch 1 runs exactly like plain decoding.
A step may feed only some rows of the batch (`forward_rows`, the rows at `Slots`), the others (rows
that finished but are still cached) getting holes; `roll_back` then drops what the step rejected,
after moving a tree draft's accepted path to the front.

Sliding-window layers (Mistral, Gemma-2/3, Starcoder2, EXAONE-4) are the exception. transformers
caches them in `DynamicSlidingWindowLayer`s, which drop what falls out of the window and then can
no longer be cropped after a rejected draft; and the model's own window is counted in cache
columns, which holes would stretch. So their layers keep every position (plain `DynamicLayer`s)
and each forward after the prompt's gets attention masks built here, the window counted in the
places plain decoding's cache gives a row's tokens (the prompt's columns, its padding included,
then the real tokens; holes take none): the same attention as plain decoding, at the price of
keeping the whole context in those layers' cache. A call's cache goes back to transformers'
sliding layers at its end where its rows hold no holes.

The prompt's forward (the first) has no holes before it, so the model builds its own masks there,
as in plain decoding's prefill, and its positions are `generate`'s own, which later tokens continue.
A cache handed in filled (a conversation continued, as plain `generate` continues one) holds the
prompt's first columns already: the first forward feeds the rest, after them.

Linear-attention and state-space layers (Qwen3.5, Qwen3-Next, Falcon-H1, Mamba, Jamba, ...) hold a
state a row, not a column a token, so a rejected draft cannot be left as a hole: transformers'
`activate_past_recording` keeps the state after each token fed since the last commit, and `crop(-n)`
restores the one after the last token kept. Recording starts after the prompt's forward (it would
keep a state per prompt token), and every token of a recorded forward goes through the model's
one-token recurrence, as plain decoding's do. Rows that accept different numbers of drafts would
need a state each; such models speculate one row at a time, as transformers' assisted decoding does.

Holes do not pile up: once those past the prompt would make the cache more than `HOLES_BOUND`
wider than its widest row needs, each row's real columns move left (`compact`): a batch's cache
stays within that fraction of plain decoding's width. A call's cache is compacted at its end too: where its
rows then hold the same number of tokens, it is plain decoding's cache. A call that hands its cache
back (`hands_back`) keeps the rows that leave the batch `aside`, out of every later forward, and
joins them back at its end (`join_rows`), after the rows that stopped early are fed their padding
(`pad_steps`), as plain decoding feeds them: its rows then hold the same number of tokens. Where
they do not (layers that cannot be joined or compacted) it is handed back as it is (its layout is
not plain decoding's), and remembered (`holds_holes`) so that a call given it to continue from
refuses it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from .compat import cache_argument, forward_takes
from .masks import allowed_keys, cache_places, in_attention_format, spanning
from .tree import tree_layout
from .verify_shape import VerifyShape


class RaggedKV:
    """A `DynamicCache` plus which of its positions hold real tokens, row by row."""

    takes_tree_masks = True  # `forward(tree=...)`: the model takes the 4D masks built here
    compiling = False  # never compiled: no forward's time is a compile's (see `StaticKV`)
    compiled = False
    # Forwards fed as they come, never padded; holes past a draft (`Draft.widened`) are fed and
    # leave with `roll_back`; finished rows leave the batch (`release_rows`) unless kept.
    verify_shape = VerifyShape(widths=(), feeds_holes=True, fixed_batch=False)

    def __init__(
        self,
        model: PreTrainedModel,
        cache: DynamicCache | None,
        batch_size: int,
        device: torch.device,
        boolean_masks: bool = False,
        attention_mask: torch.Tensor | None = None,
    ):
        """`boolean_masks`: the model is one of our draft heads, which takes a boolean 4D mask
        whatever its config says (tree drafts need one). `attention_mask`: the prompt's, whose
        first columns say which of a filled `cache`'s columns hold real tokens (all, without it)."""
        self.model = model
        self.boolean_masks = boolean_masks
        self.batch_size = batch_size
        self.cache = (
            cache if cache is not None else DynamicCache(config=model.config.get_text_config(decoder=True))
        )
        # transformers' sliding window per cache layer (None: the layer attends to the whole context)
        self.layer_windows = _layer_windows(model, self.cache)
        # Cross-attention layers (Mllama's) hold an image's columns, which do not move with the text's.
        text = getattr(model.config, "text_config", None) or model.config  # our heads' configs have none
        self.cross_layers = frozenset(getattr(text, "cross_attention_layers", None) or ())
        self.window_masks = _Masks.for_sliding_window(model, self.cache)
        self.tree_masks = self.window_masks  # built on the first tree draft for other models
        cached = self.cache.get_seq_length()  # a conversation continued: the prompt's first columns
        if attention_mask is not None:
            self.mask = attention_mask[:, :cached].to(device=device, dtype=torch.bool)  # [B, cache_len]
        else:
            self.mask = torch.ones(batch_size, cached, dtype=torch.bool, device=device)
        self.lengths = self.mask.sum(dim=1)  # real tokens per row
        # Per row, the position of its next token minus `lengths`: None (0) unless the prompt was fed
        # with positions of its own (generate's, which after right padding do not count real tokens).
        self.offsets: torch.Tensor | None = None
        self.prompt_width = 0  # columns of the prompt once fed, padding included
        self.all_real = bool(self.mask.all())  # no hole: the model then needs no attention mask
        self.compactions = 0  # times `compact` moved the holes out
        # Whether the call hands its cache back (`hands_back`): the rows that leave the batch are then
        # kept `aside`, each group as a cache of its own with its user rows, for `pad_steps` to join.
        self.hands_back = False
        self.aside: list[tuple[RaggedKV, list[int]]] = []
        self.keeps_logits = forward_takes(model, "logits_to_keep")
        self.takes_positions = forward_takes(model, "position_ids")  # else generate gives none, nor do we
        self.recurrent = keeps_recurrent_state(model, self.cache)
        self.recording = False  # recurrent states recorded per token (from the forward after the prompt's)
        self.tree_refusal = tree_refusal(model, self.recurrent)  # why no tree goes through it, if so
        if self.recurrent and batch_size > 1:
            raise ValueError(
                f"{type(model).__name__} has linear-attention or state-space layers, whose recurrent state "
                "speculative= rolls back one row at a time: call generate with one sequence at a time "
                f"(batch size {batch_size} here, num_return_sequences counted), draft with a model "
                "without such layers if this one is the draft (or method='ngram'), or drop speculative=."
            )

    @property
    def attends(self) -> bool:
        """Whether a layer attends to past tokens (once the cache holds its layers). Mamba's do not:
        after the prompt plain generate feeds it no mask, and it would apply a whole one to the fed."""
        return not self.cache.layers or any(isinstance(layer, CacheLayerMixin) for layer in self.cache.layers)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def widest(self, wanted: int) -> int:
        """How many tokens a row the next forward can take, of `wanted`: all, a dynamic cache grows."""
        return wanted

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
        **inputs: Any,
    ) -> Any:
        """The contract of `drafters.decoder.DecoderCache.forward`, and for the target: `valid` None
        means all real; `positions` [B, T], for the first forward only: the tokens' own positions
        (generate's position ids of the prompt), which the row's later tokens then continue from its
        last; `.hidden_states` of every position when asked for; `inputs` go to the model as they are
        (a draft head's features, a model's extra inputs, output switches).
        """
        width = tokens.shape[1]
        if tree is not None:
            check_trees(self.model, self.tree_refusal)
        # The prompt's forward (after a filled cache's columns), or one into a cache emptied since.
        first = self.width == 0 or self.prompt_width == 0
        given = positions is not None
        if not given:
            positions = self._next_positions(width, valid, tree)
        if valid is None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], width)], dim=1)
            self.lengths = self.lengths + width
        else:
            self.mask = torch.cat([self.mask, valid], dim=1)
            self.lengths = self.lengths + valid.sum(dim=1)
            self.all_real = self.all_real and bool(valid.all())
        if first:
            self.prompt_width = self.width
        if first and given:
            offsets = positions[:, -1] + 1 - self.lengths  # generate continues from the last position
            self.offsets = offsets if bool(offsets.any()) else None
        if tree is not None:
            if self.tree_masks is None:
                self.tree_masks = _Masks.boolean() if self.boolean_masks else _Masks.for_trees(self.model)
            attention_mask = self.tree_masks.build(self.mask, width, *tree, prompt_width=self.prompt_width)
        elif self.window_masks is not None and not first:
            attention_mask = self.window_masks.build(self.mask, width, prompt_width=self.prompt_width)
        else:
            # The first forward has no holes before it: the model builds its own masks, as in plain
            # decoding's prefill (a sliding window, an image's bidirectional attention).
            attention_mask = None if self.all_real or not (first or self.attends) else self.mask.long()
        kept = kept_columns(self.cache) if first else 0
        out = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            **({"position_ids": positions} if self.takes_positions else {}),
            **{cache_argument(self.model): self.cache},
            use_cache=True,
            output_hidden_states=output_hidden_states,
            **inputs,
            **({"logits_to_keep": logits_to_keep} if self.keeps_logits else {}),
        )
        if not self.keeps_logits and logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        if first:
            check_kept_in(self.model, self.cache, out, kept)
        elif self.recording:
            check_recorded(self.model, self.cache, width)
        if first and self.recurrent:  # a state per token from now on: each may be rolled back to
            self.cache.activate_past_recording(recurrent_states_to_keep=EVERY_TOKEN)
            self.recording = True
        return out

    def forward_rows(
        self,
        slots: Slots,
        tokens: torch.Tensor,  # [B, T] for the rows at `slots`
        valid: torch.Tensor | None,  # [B, T] which are real; None: all
        parents: torch.Tensor | None = None,  # [B, T - 1] a tree after each row's first token
        **inputs: Any,
    ) -> Any:
        """`forward` for the batch's rows at `slots` only: every other row is fed T holes.

        With `parents` (node i's parent node, -1 for a child of the row's first fed token), the
        tokens after the first form a tree below it, each seeing its ancestors and itself
        (`tree_layout`). Returns the model's output over the whole batch, logits of all T positions.
        """
        batch, width = self.mask.shape[0], tokens.shape[1]
        if self.recording:  # the last step's tokens are kept for good: drop the states recorded for them
            self.cache.crop(0)
        tree = None if parents is None else tree_layout(parents)
        tokens, valid = slots.fed(tokens, valid)
        if tree is not None and not slots.whole:  # a hole sees only itself
            visible = torch.eye(width, dtype=torch.bool, device=tokens.device).repeat(batch, 1, 1)
            depths = torch.arange(width, device=tokens.device).repeat(batch, 1)
            tree = slots.scatter(tree[0], visible), slots.scatter(tree[1], depths)
        return self.forward(tokens, valid, logits_to_keep=width, tree=tree, **inputs)

    def roll_back(
        self,
        slots: Slots,
        width: int,
        rejected: list[int],
        paths: list[list[int]] | None = None,
        widened: bool = False,
    ) -> None:
        """Undo what the last forward of `width` tokens a row fed and the step rejected: the last
        `rejected[b]` real tokens of row `slots.rows[b]`. For a tree, the accepted path `paths[b]`
        (nodes after the first fed token, root first) moves to the front of the fed columns first,
        so that what is rejected comes last. `widened`: holes were fed past every row's draft
        (`Draft.widened`); they leave the cache too."""
        device = self.mask.device
        if paths is not None:
            order = torch.arange(width, device=device).repeat(self.mask.shape[0], 1)
            for b, path in enumerate(paths):
                order[slots.rows[b], 1 : 1 + len(path)] = torch.tensor(path, device=device) + 1
            self.reorder_tail(order)
        if any(rejected):  # decided on the host: a step that kept its whole draft rolls nothing back
            self.truncate(slots.less(self.lengths, rejected))
        elif widened:  # trailing holes kept would make every later forward take an attention mask
            self._give_back_holes()

    def _next_positions(
        self, width: int, valid: torch.Tensor | None, tree: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """The positions of `width` tokens fed next, [B, width]: each row's numbering continued."""
        start = self.lengths if self.offsets is None else self.lengths + self.offsets
        if tree is not None:
            return start[:, None] + tree[1]
        if valid is None:  # every fed token is real: the common step, kept cheap
            return start[:, None] + torch.arange(width, device=start.device)
        # Real tokens continue each row's own numbering; holes get any position, they are masked.
        return (start[:, None] + valid.cumsum(dim=1) - 1).clamp_min(0)

    def finished_cache(self) -> DynamicCache:
        """The cache to hand back at the end of a call: where every row holds just its sequence (no
        holes, no row dropped), sliding-window layers go back to transformers' own, cut to their
        window as plain decoding leaves them; a ragged cache keeps its full layers."""
        for layer in self.cache.layers if self.recording else ():
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.record_past = False  # as transformers hands a cache back: its states stop growing
        tail = self.mask[:, self.prompt_width :]
        every_row = self.mask.shape[0] == self.batch_size
        if every_row and not bool(tail.all()) and bool((tail.sum(dim=1) == tail.sum(dim=1)[0]).all()):
            self.compact()  # rows that kept as many tokens: compacted, plain decoding's layout
        whole = every_row and bool(self.mask[:, self.prompt_width :].all())
        if not whole:
            mark_holes(self.cache)
            return self.cache
        for i, window in enumerate(self.layer_windows):
            layer = self.cache.layers[i]
            if window is not None and type(layer) is DynamicLayer and layer.is_initialized:
                sliding = DynamicSlidingWindowLayer(sliding_window=window)
                sliding.update(layer.keys, layer.values)  # keeps the last window - 1 columns
                self.cache.layers[i] = sliding
        return self.cache

    def sequence_columns(self, row: int, end: int) -> torch.Tensor:
        """Row `row`'s columns among the first `end` that plain decoding's cache would hold, in order:
        the prompt's, its padding included, and the real tokens after it (no holes)."""
        after = torch.nonzero(self.mask[row, self.prompt_width : end]).flatten() + self.prompt_width
        return torch.cat([torch.arange(min(self.prompt_width, end), device=self.mask.device), after])

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b; the rest become holes."""
        self.mask &= self.mask.cumsum(dim=1) <= lengths[:, None]
        self.lengths = self.mask.sum(dim=1)
        self._give_back_holes()

    def reorder_tail(self, order: torch.Tensor) -> None:
        """Permute the last `order.shape[1]` cache columns of each row: column i of row b takes
        what column `order[b, i]` of that tail held (the accepted path of a tree draft moves to
        its front, after which the row is truncated like a chain). A sparse-attention indexer's keys
        (`DynamicIndexedLayer`: DeepSeek-V3.2, GLM-MoE-DSA) move with them: it scores each column
        by its own key to choose the columns attention reads."""
        width = order.shape[1]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                states = getattr(layer, name, None)  # [B, heads, cache_len, head_dim]
                if states is None or states.dim() != 4:
                    continue
                states[:, :, -width:] = gather_columns(states[:, :, -width:], order)
            indexer = getattr(layer, "indexer_keys", None)  # [B, cache_len, index_head_dim]
            if indexer is not None and indexer.dim() == 3 and indexer.shape[1] >= width:
                index = order[:, :, None].expand(-1, -1, indexer.shape[2])
                indexer[:, -width:] = indexer[:, -width:].gather(1, index)
            positions = getattr(layer, "indexer_position_ids", None)  # [position_dims, B, cache_len]
            if positions is not None and positions.shape[-1] >= width:
                index = order[None].expand(positions.shape[0], -1, -1)
                positions[..., -width:] = positions[..., -width:].gather(2, index)

    def release_rows(self, cached_rows: list[int], active: list[int], keep_shape: bool = False) -> list[int]:
        """The rows of `cached_rows` (the user's rows, one per cache row) not in `active` are no
        longer read (finished, and not padded at the end: `rows_apart`); returns the user rows the
        cache holds after, in order.

        They leave the batch only once half of it has finished: removing rows copies the whole cache,
        and on CPU an odd batch of 15 runs slower than 16, so dropping rows one at a time costs more
        than it saves. Until then, or always with `keep_shape` (the policy's call: a device that
        pays a one-off per new shape), the steps feed them holes (`forward_rows`)."""
        if keep_shape or len(active) > len(cached_rows) // 2:
            return cached_rows
        if self.hands_back and self.rejoins:  # out of the verify forward, not out of the cache handed back
            staying = set(active)
            leaving = [i for i, row in enumerate(cached_rows) if row not in staying]
            self.aside.append((self.rows_apart(leaving), [cached_rows[i] for i in leaving]))
        self.select_rows(torch.tensor(positions(cached_rows, active), device=self.mask.device))
        return active

    def plain_layout(self) -> bool:
        """Whether the columns are laid out as plain decoding's: no hole past the prompt."""
        return bool(self.mask[:, self.prompt_width :].all())

    @property
    def rejoins(self) -> bool:
        """Whether rows taken apart from this cache can be joined back (`join_rows`): every layer
        holding columns holds a plain layer's keys and values, a column per mask column."""
        return all(self._moves_with_mask(layer) for layer in self.cache.layers if _holds_columns(layer))

    def held_rows(self, cached_rows: list[int]) -> list[tuple[RaggedKV, list[int]]]:
        """Every row the call keeps, as caches with the user row at each of their rows: this one
        (`cached_rows`), and the rows set `aside` as they left the batch."""
        return [(self, cached_rows), *self.aside]

    def hand_back(self, whole: RaggedKV) -> None:
        """Hold `whole`'s rows (every user row, in order: `join_rows`) in this cache's own layers,
        so that a cache the user passed in holds them too."""
        for layer, joined in zip(self.cache.layers, whole.cache.layers):
            if _holds_columns(layer):
                layer.keys, layer.values = joined.keys, joined.values
        self.mask, self.lengths, self.offsets = whole.mask, whole.lengths, whole.offsets
        self.all_real, self.aside = whole.all_real, []

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch), e.g. when others have finished."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.lengths = self.lengths[rows]
        self.offsets = None if self.offsets is None else self.offsets[rows]
        self._give_back_holes()

    def rows_apart(self, rows: list[int]) -> RaggedKV:
        """Cache rows `rows` (indices into the current batch) alone, over a copy of their keys and
        values: what is fed through it leaves this cache as it is."""
        apart = copy.copy(self)
        apart.cache = copy.copy(self.cache)
        apart.cache.layers = [copy.copy(layer) for layer in self.cache.layers]  # each selects a copy
        apart.batch_size = len(rows)
        apart.select_rows(torch.tensor(rows, device=self.mask.device))
        return apart

    def compact(self) -> None:
        """Move each row's real columns past the prompt's to the left, in order, and drop the columns
        that frees: the cache as wide as its widest row needs. A copy of every layer's keys and values.

        Nothing a token sees or is numbered by moves with them: positions count a row's real tokens
        (`_next_positions`), not its columns (models that count columns are refused for batches:
        `counts_columns`); a query sees the real columns before its own, which keep their order; a
        sliding window counts places that holes take none of (`masks.cache_places`). The prompt's
        columns stay, padding included, as plain decoding's cache holds them. A cache with layers
        holding columns other than keys and values (a sparse-attention indexer's keys, a recurrent
        state) or other columns than the text's is left as it is: what they hold is not known to move;
        cross-attention layers (`cross_layers`, an image's columns) are left out."""
        start = self.prompt_width
        layers = [
            layer
            for i, layer in enumerate(self.cache.layers)
            if i not in self.cross_layers and _holds_columns(layer)
        ]
        if not all(self._moves_with_mask(layer) for layer in layers):
            return
        tail = self.mask[:, start:]  # [B, W - start]
        kept = int(tail.sum(dim=1).max()) if len(tail) else 0
        # Each row's real columns first, in their order, then its holes; the columns past the widest go.
        order = real_first(tail)[:, :kept]  # [B, kept]
        for layer in layers:
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, heads, W, head_dim]
                setattr(
                    layer,
                    name,
                    torch.cat([states[:, :, :start], gather_columns(states, order + start)], dim=2),
                )
        self.mask = torch.cat([self.mask[:, :start], tail.gather(1, order)], dim=1)
        self.all_real = bool(self.mask.all())
        self.compactions += 1

    def lay_out(self, prompt_mask: torch.Tensor) -> None:
        """Move each row's real columns to where plain decoding's cache holds them: the prompt's
        (`prompt_mask` [B, P], 0 at its padding, which keeps its own columns' contents), then the
        row's tokens, one a column. The rows must hold as many tokens past their prompts (`rejoins`:
        layers that move with the mask), as plain's do; else nothing moves."""
        prompt = prompt_mask.to(device=self.mask.device, dtype=torch.bool)
        generated = self.lengths - prompt.sum(dim=1)
        if not bool((generated == generated[0]).all()):
            return
        placed = torch.cat([prompt, prompt.new_ones(len(prompt), int(generated[0]))], dim=1)  # [B, W']
        if placed.shape == self.mask.shape and bool((placed == self.mask).all()):
            return  # laid out so already: no copy
        source = real_first(self.mask).gather(1, (placed.cumsum(dim=1) - 1).clamp_min(0))
        own = torch.arange(prompt.shape[1], device=prompt.device).clamp_max(self.width - 1)
        source[:, : prompt.shape[1]] = torch.where(prompt, source[:, : prompt.shape[1]], own)
        for layer in self.cache.layers:
            if _holds_columns(layer):
                layer.keys = gather_columns(layer.keys, source)
                layer.values = gather_columns(layer.values, source)
        self.mask, self.prompt_width, self.all_real = placed, prompt.shape[1], bool(placed.all())

    def _moves_with_mask(self, layer: Any) -> bool:
        """Whether `layer` holds nothing but a plain layer's keys and values, a column per mask column."""
        return type(layer) is DynamicLayer and all(
            states.dim() == 4 and states.shape[2] == self.width for states in (layer.keys, layer.values)
        )

    def _give_back_holes(self) -> None:
        """Drop the trailing columns that are holes in every row, and compact the cache once the holes
        left past the prompt make it more than `HOLES_BOUND` wider than its widest row needs."""
        self._crop_unused_tail()
        if self.all_real or not len(self.mask):
            return
        needed = self.prompt_width + int(self.mask[:, self.prompt_width :].sum(dim=1).max())
        if self.width - needed > HOLES_BOUND * needed:
            self.compact()

    def _crop_unused_tail(self) -> None:
        """Drop the trailing cache columns that are holes in every row."""
        used = torch.nonzero(self.mask.any(dim=0))
        drop = self.width if used.numel() == 0 else self.width - 1 - int(used[-1])
        if drop or self.recording:  # crop(0) commits the recurrent states kept so far
            self.cache.crop(-drop)
            self.mask = self.mask[:, : self.width - drop]
        self.all_real = bool(self.mask.all())


# A batch's cache is compacted (`RaggedKV.compact`) once the holes past its prompt exceed this fraction
# of the columns its widest row needs: a compaction copies the cache, about what one forward's
# `DynamicLayer.update` copies (it concatenates), while the holes cost every forward their share of
# that copy and of attention; a bound relative to the width spaces the copies out as the cache grows
# (benchmarks/micro/compaction.py counts them).
HOLES_BOUND = 0.25

# Recorded recurrent states a forward keeps: all of its tokens' (a forward's last n tokens, where n
# is fewer, would go through the chunked kernel, whose states are not kept but the last).
EVERY_TOKEN = 1 << 20

# Set on a cache handed back ragged; an attribute of the cache itself, so that its copies
# (`copy.deepcopy`, to branch a conversation) carry it too.
_HOLES_MARK = "_hf_specdec_holds_holes"


def join_rows(parts: list[tuple[RaggedKV, list[int]]], batch: int) -> RaggedKV:
    """One cache over user rows 0..batch-1, in order, from `parts`: caches of one call (`rejoins`)
    with the user row at each of their rows (one outside 0..batch-1 is left out). Narrower parts
    are widened with holes; each row keeps its columns, which `RaggedKV.lay_out` then places as plain's."""
    first, rows = parts[0]
    if len(parts) == 1 and rows == list(range(batch)):
        return first
    width = max(kv.width for kv, _ in parts)
    at = {row: i for i, row in enumerate(r for _, held in parts for r in held)}
    order = torch.tensor([at[row] for row in range(batch)], device=first.mask.device)

    def joined(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        widened = [
            torch.cat([t, t.new_zeros(*t.shape[:dim], width - t.shape[dim], *t.shape[dim + 1 :])], dim)
            for t in tensors
        ]
        return torch.cat(widened)[order]

    whole = copy.copy(first)
    whole.cache = copy.copy(first.cache)
    whole.cache.layers = [copy.copy(layer) for layer in first.cache.layers]
    for i, layer in enumerate(whole.cache.layers):
        if _holds_columns(layer):
            layer.keys = joined([kv.cache.layers[i].keys for kv, _ in parts], 2)
            layer.values = joined([kv.cache.layers[i].values for kv, _ in parts], 2)
    whole.mask = joined([kv.mask for kv, _ in parts], 1)
    whole.lengths = whole.mask.sum(dim=1)
    whole.offsets = None if first.offsets is None else torch.cat([kv.offsets for kv, _ in parts])[order]
    whole.all_real, whole.aside = bool(whole.mask.all()), []
    return whole


def real_first(mask: torch.Tensor) -> torch.Tensor:
    """Per row of `mask` [B, W], the column order that puts its real columns first, in their order,
    then its holes: what compacting a cache gathers."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


def gather_columns(states: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`states` [B, heads, W, head_dim] with row b's columns taken as `order[b]` lists them."""
    return states.gather(2, order[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))


def _holds_columns(layer: Any) -> bool:
    """Whether a cache layer holds any columns: not a `DummyLayer` (a layer reading another's), nor
    one never written (Mllama's cross-attention layers without an image)."""
    return not isinstance(layer, DummyLayer) and layer.is_initialized


def check_recorded(model: PreTrainedModel, cache: DynamicCache, width: int) -> None:
    """Refuse a model whose recurrent layers recorded fewer states than the `width` tokens just fed
    (the state before them, then one after each but the last): Zaya hands its cache only the state
    after a forward's last token, and a rejected draft rolled back to a recorded state would take
    another token's, or none at all."""
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for state, kept in layer.is_recurrent_states_initialized.items():
            if kept and len(layer.recurrent_states_history[state]) < width:
                raise ValueError(
                    f"{type(model).__name__}'s recurrent layers keep one state a forward, not one a token, "
                    "so speculative= cannot roll back a rejected draft: drop speculative= for this model "
                    "(or draft with another model, if this one is the draft)."
                )


class PastNotKept(ValueError):
    """A model's first forward left the cache it was given as it was (`check_kept_in`). Raised for
    the target at the prompt's forward, before any token is decided: `method="auto"` then decodes
    the call plainly, as for a model that keeps no KV cache."""

    def __init__(self, model: Any, message: str) -> None:
        super().__init__(message)
        self.model = model


def kept_columns(cache: Any) -> int:
    """The most positions any layer of `cache` holds (a recurrent layer: the tokens it has read)."""
    return max(
        (int(layer.get_seq_length()) for layer in cache.layers if not isinstance(layer, DummyLayer)),
        default=0,
    )


def check_kept_in(model: PreTrainedModel, cache: Any, output: Any, kept: int) -> None:
    """Refuse a model whose first forward left the cache it was given holding no more than the
    `kept` positions it held before (`PastNotKept`): a forward that takes the cache in its `**kwargs`
    (`compat.forward_cache_argument`) may drop it, and it then keeps no KV cache. Or one that keeps
    its past in a cache other than the one passed (BLT wraps it in an `EncoderDecoderCache` of its
    own each forward): what it keeps there would be lost at every step."""
    if kept_columns(cache) <= kept:
        name, argument = type(model).__name__, cache_argument(model)
        raise PastNotKept(
            model,
            f"{name} did not keep its first forward's tokens in the cache it was given ({argument}=): "
            "it keeps no KV cache, so speculative= cannot feed it only the new tokens. If its forward "
            "takes the cache among its **kwargs and calls another forward, pass them on to it, the cache "
            "among them; else drop speculative= for this model (speculative=True decodes it plainly; or "
            "draft with another model, if this one is the draft).",
        )
    # By the name the output holds it under, among its own keys: asking a transformers 5 output for
    # the old name warns that it is deprecated, and a draft head's output holds neither name.
    held = [name for name in ("cache", "past_key_values") if name in output.keys()]  # noqa: SIM118 (`in` renames)
    returned = output[held[0]] if held else None
    if returned is not None and returned is not cache:
        raise ValueError(
            f"{type(model).__name__} keeps its past in a cache of its own ({type(returned).__name__}) rather "
            "than in the one it is given, which speculative= cannot roll back: drop speculative= for this "
            "model (or draft with another model, if this one is the draft)."
        )


def keeps_recurrent_state(model: Any, cache: Any = None) -> bool:
    """Whether `model` keeps a state a row (linear-attention or state-space layers), as `cache`'s
    layers say, else (None) as a cache built from its config would."""
    if cache is None:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in getattr(cache, "layers", ()))


def windows_by_column(model: Any) -> bool:
    """Whether `model` has layers that attend in a window of their own, counted back from the cache's
    last column whatever the mask says (GPT-Neo's local layers)."""
    config = model.config.get_text_config(decoder=True)
    return config.model_type == "gpt_neo" and "local" in getattr(config, "attention_layers", ())


def counts_columns(model: Any) -> str | None:
    """What `model` counts in cache columns, said for an error, else None: its positions where it takes
    no `position_ids` and counts from the cache's length (TrOCR, the BART family's and Whisper's
    decoders; MPT, whose ALiBi biases are cut from the cache's last columns), or its attention window
    where it applies one of its own past the mask given (GPT-Neo's local layers). A hole left by a
    rejected draft, or a tree's sibling fed beside its brother, would then move the position or window
    of every token after it. BLOOM takes no `position_ids` either, but builds its ALiBi biases from the
    attention mask, which skips holes; recurrent layers hold no columns."""
    if not isinstance(model, PreTrainedModel):
        return None
    if windows_by_column(model):
        return "counts its local attention window (window_size) in cache columns"
    config = model.config.get_text_config(decoder=True)
    if forward_takes(model, "position_ids"):
        return None
    alibi = config.model_type == "bloom" or getattr(config, "alibi", False)
    if alibi or keeps_recurrent_state(model):
        return None
    return "numbers its tokens by their place in the cache (its forward takes no position_ids)"


def rotary_refusal(model: Any, cached: int, prompt_width: int, max_length: int) -> str | None:
    """Why a call cannot speculate through `model`'s rotary frequencies, else None. transformers sets
    "dynamic" (NTK) and "longrope" frequencies from each forward's last position
    (`dynamic_rope_update`): past the model's original context, "dynamic" recomputes them at every
    position and "longrope" takes its long factors (and Phi-3's generate then recomputes the whole
    cache once). Plain decoding feeds one token a forward, so a verify forward of several would
    rotate its tokens otherwise; that holds only where the call's forwards stay on one side of the
    context: all within it, or, for "longrope", all past it (`cached` columns of a filled cache
    included). Columns bound positions, so `prompt_width` and `max_length` count the padding."""
    if not isinstance(model, PreTrainedModel):
        return None
    config = model.config.get_text_config(decoder=True)
    parameters = getattr(config, "rope_parameters", None) or {}
    for rope in [p for p in parameters.values() if isinstance(p, dict)] or [parameters]:  # per layer type
        kind = rope.get("rope_type", "")
        longrope = kind == "longrope"
        if not longrope and "dynamic" not in kind:
            continue
        original = rope.get("original_max_position_embeddings") if longrope else None
        context = int(original or config.max_position_embeddings)
        within = max_length - 1 <= context  # the last forward's length: its last token's position + 1
        past = prompt_width > context and (cached == 0 or cached > context)  # no forward within it
        if within or (longrope and past):
            continue
        return (
            f"sets its {kind!r} rotary frequencies from each forward's length, which change past its "
            f"original context of {context} positions, and this call runs to {max_length} tokens"
        )
    return None


def tree_refusal(model: Any, recurrent: bool | None = None) -> str | None:
    """Why tree drafts cannot go through `model`, else None: recurrent states (`recurrent`, as its
    cache's layers say; None: as a cache built from its config would), attention biases built from
    a 2D padding mask (ALiBi: BLOOM, Falcon with `alibi`), which a tree's 4D mask cannot reach, or
    positions or a window counted in cache columns (`counts_columns`)."""
    if not isinstance(model, PreTrainedModel):
        return None  # our draft heads: trees are what they grow
    config = model.config.get_text_config(decoder=True)
    if recurrent if recurrent is not None else keeps_recurrent_state(model):
        return (
            "has linear-attention or state-space layers, which read a sequence in order and cannot "
            "take a tree's branches side by side"
        )
    if config.model_type == "bloom" or getattr(config, "alibi", False):
        return (
            "builds its ALiBi position biases from a 2D attention mask, which cannot say which of a "
            "tree's branches a token sees"
        )
    counted = counts_columns(model)
    if counted is not None:
        return f"{counted}, so a tree's branches, fed side by side, would be counted as a chain"
    if masks_refusal(model) is not None:
        return (
            f"attends with attn_implementation={config._attn_implementation!r}, which takes no tree "
            "mask (trees need 'sdpa' or 'eager')"
        )
    return None


def check_trees(model: Any, refusal: str | None) -> None:
    """Refuse tree drafts through `model` for `refusal` (`tree_refusal`)."""
    if refusal is not None:
        raise ValueError(f"{type(model).__name__} {refusal}: drop tree=True.")


def mark_holes(cache: Any, holds: bool = True) -> None:
    """Mark `cache`, handed back in a layout other than plain decoding's, so that no call continues it
    (`holds=False`: emptied since, it holds no holes)."""
    setattr(cache, _HOLES_MARK, holds)


def holds_holes(cache: Any) -> bool:
    """Whether `cache` was handed back by a call whose rows ended ragged (`RaggedKV.finished_cache`,
    `StaticKV.finished_cache`): holes in its rows (rows shorter than others), or rows missing."""
    return bool(getattr(cache, _HOLES_MARK, False))


def positions(held: list[int], rows: list[int]) -> list[int]:
    """Where each of `rows` sits in `held` (a dict, not `list.index` per row: batches of thousands)."""
    where = {r: i for i, r in enumerate(held)}
    return [where[r] for r in rows]


class Slots:
    """Where a step's rows sit in a cache's batch: row b of the step is cache row `rows[b]`. The
    batch's other rows (finished rows it still holds) take no part in the step."""

    def __init__(self, rows: list[int], batch_size: int, device: torch.device) -> None:
        self.rows, self.batch_size = rows, batch_size
        # Known on the host, so the common step skips the work: whether the step's rows are the
        # whole batch, in order (then row b is cache row b).
        self.whole = len(rows) == batch_size
        self.index = slice(None) if self.whole else torch.tensor(rows, device=device)

    def gather(self, batched: torch.Tensor) -> torch.Tensor:
        """The step's rows of `batched` [batch_size, ...], in the step's order."""
        return batched if self.whole else batched[self.index]

    def scatter(self, rows: torch.Tensor, batched: torch.Tensor) -> torch.Tensor:
        """`batched` [batch_size, ...] with the step's rows replaced by `rows` [B, ...], in place."""
        return rows if self.whole else batched.index_copy_(0, self.index, rows)

    def placed(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [B, ...] laid into the whole batch [batch_size, ...], zeros in the other rows."""
        return self.scatter(rows, rows.new_zeros(self.batch_size, *rows.shape[1:]))

    def fed(
        self, tokens: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's `tokens` [B, T] and which are real (None: all) as the whole batch is fed them:
        every other row gets T holes."""
        if self.whole:
            return tokens, valid
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
        return self.placed(tokens), self.placed(valid)

    def less(self, batched: torch.Tensor, amounts: list[int]) -> torch.Tensor:
        """A copy of `batched` [batch_size] with the step's row b lower by `amounts[b]` (each row's
        real tokens kept once a step rejected some)."""
        out = batched.clone()
        out[self.index] -= torch.tensor(amounts, device=batched.device)
        return out


def masks_refusal(model: PreTrainedModel) -> str | None:
    """Why the loop cannot hand `model` attention masks of its own (a sliding window kept whole, a
    tree draft's), else None: they are 4D masks, which only sdpa and eager attention take."""
    implementation = model.config.get_text_config(decoder=True)._attn_implementation
    if implementation in ("sdpa", "eager"):
        return None
    return (
        f"speculative= builds its own attention masks for {type(model).__name__} (a sliding window or a "
        f"tree draft), which need attn_implementation='sdpa' or 'eager' (got {implementation!r}); load "
        "the model with one of those, or use chain drafts."
    )


def sliding_refusal(model: PreTrainedModel, cache: DynamicCache | None) -> str | None:
    """Why the loop cannot keep `model`'s sliding-window layers whole in `cache` and mask their window
    itself (`_Masks.for_sliding_window`), else None."""
    layers = cache.layers if cache is not None else []
    sliding = [isinstance(layer, DynamicSlidingWindowLayer) for layer in layers]
    if any(isinstance(layer, LinearAttentionCacheLayerMixin) and s for layer, s in zip(layers, sliding)):
        return (
            f"speculative= does not support {type(model).__name__}'s layers that keep both a sliding "
            "window and a recurrent state (their window cannot be kept whole); use plain generate."
        )
    # The model attends in a window as its config says, whatever the cache's layers: a cache
    # built without the config (`DynamicCache()`) has full layers only, yet holes in them
    # would still be counted in the model's own window.
    if not any(sliding) and not _slides_by_config(model):
        return None
    if getattr(model.config.get_text_config(decoder=True), "sliding_window", None) is None:
        # transformers caches chunks the same way
        return (
            f"speculative= does not support {type(model).__name__}'s chunked attention (its cache "
            "cannot be rolled back); use plain generate."
        )
    return masks_refusal(model)


def _slides_by_config(model: PreTrainedModel) -> bool:
    """Whether `model`'s config gives any of its layers a sliding window (our draft heads' configs
    are not transformers' and give none)."""
    text_config = getattr(model.config, "get_text_config", None)
    if text_config is None:
        return False
    config = text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
    return getattr(config, "sliding_window", None) is not None and "sliding_attention" in layer_types


def _layer_windows(model: PreTrainedModel, cache: DynamicCache) -> list[int | None]:
    """Per cache layer, the window transformers' cache would keep it to (None: the whole context). A
    layer reading another's keys and values (Gemma 3n's last ones: a `DummyLayer` in the cache) has
    the window of the layers of its type that keep their own."""
    windows = [
        layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
        for layer in cache.layers
    ]
    if not any(isinstance(layer, DummyLayer) for layer in cache.layers):
        return windows
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    kinds = [*types, *[None] * (len(windows) - len(types))]
    own = {
        kind: w for kind, w, layer in zip(kinds, windows, cache.layers) if not isinstance(layer, DummyLayer)
    }
    return [
        own.get(kind) if isinstance(layer, DummyLayer) else w
        for kind, w, layer in zip(kinds, windows, cache.layers)
    ]


class _Masks:
    """4D attention masks built here rather than by the model, for what its own masks cannot say.

    - Sliding-window layers whose cache keeps every position: query i of a forward (cache column
      `past + i`) sees the real tokens at columns up to its own, and on sliding layers only those
      fewer than `window` places before it (transformers' `sliding_window_overlay`,
      `kv_idx > q_idx - sliding_window`, counted in places of plain decoding's cache instead of
      columns of this one, which holds holes).
    - Tree drafts: among the tokens of a forward, each sees only its ancestors and itself.
    A hole or padding query sees only itself, so no softmax row is empty (`masks.allowed_keys`).
    """

    def __init__(self, model: PreTrainedModel | None, window: int | None, layer_types: list[str]) -> None:
        """Masks in the format of `model`'s attention; None: boolean masks (our draft heads)."""
        self.implementation, self.dtype = "sdpa", None
        if model is not None:
            self.implementation = model.config.get_text_config(decoder=True)._attn_implementation
            self.dtype = model.dtype
            if (refusal := masks_refusal(model)) is not None:
                raise ValueError(refusal)
        self.window = window
        self.types = sorted(set(layer_types))

    @classmethod
    def for_sliding_window(cls, model: PreTrainedModel, cache: DynamicCache) -> _Masks | None:
        """Masks for `model` if it has sliding-window layers (their cache layers become full ones)."""
        if (refusal := sliding_refusal(model, cache)) is not None:
            raise ValueError(refusal)
        sliding = [isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers]
        if not any(sliding) and not _slides_by_config(model):
            return None
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
        layer_types = [t for t in layer_types if t in ("full_attention", "sliding_attention")]
        masks = cls(model, config.sliding_window, layer_types)
        # Empty, where any is sliding: `check_continued` refuses a filled cache with sliding layers.
        for i, is_sliding in enumerate(sliding):
            if is_sliding:
                cache.layers[i] = DynamicLayer()
        return masks

    @classmethod
    def for_trees(cls, model: PreTrainedModel) -> _Masks:
        """Masks for tree drafts on a model whose layers all attend to the whole context."""
        return cls(model, None, ["full_attention"])

    @classmethod
    def boolean(cls) -> _Masks:
        """Boolean tree masks for our draft heads (`heads/`), whose attention takes them as they are."""
        return cls(None, None, ["full_attention"])

    def build(
        self,
        mask: torch.Tensor,  # [B, cache_len], the new queries are its last columns
        new: int,
        visible: torch.Tensor | None = None,  # [B, new, W] for a tree draft: the last W columns
        new_depths: torch.Tensor | None = None,  # [B, new] for a tree draft: depth below the last token
        prompt_width: int = 0,  # the first columns: a row's prompt, its padding included
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """One [B, 1, new, cache_len] mask, or one per layer type for models that mix them."""
        width = mask.shape[1]
        past = width - new
        visible = None if visible is None else spanning(visible, width)
        allowed = allowed_keys(mask, torch.arange(past, width, device=mask.device), visible)
        masks = {}
        for kind in self.types:
            seen = allowed
            if kind == "sliding_attention":
                places = cache_places(mask, prompt_width)  # [B, cache_len]
                if new_depths is not None:  # tree nodes: siblings share a place
                    before = places[:, past - 1 : past] if past else places.new_full((len(mask), 1), -1)
                    places[:, past:] = before + 1 + new_depths
                distance = places[:, past:, None] - places[:, None, :]  # [B, new, cache_len]
                seen = allowed & (distance < self.window)  # a query is 0 places from itself: still seen
            masks[kind] = in_attention_format(seen, self.implementation, self.dtype)
        return masks if len(masks) > 1 else next(iter(masks.values()))
