"""Drafting with a decoder that keeps its own KV cache, whatever runs it: a PyTorch model
(`draft_model`) or an ONNX Runtime session (`onnx`, `quantized`). The drafters differ only in how
they load their decoder; drafting is this module's, token for token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ..core.checks import check_rolls_back
from ..core.devices import execution_device
from ..core.draft import DraftCost
from ..core.kv import RaggedKV
from ..core.static_kv import DraftRows, StaticKV
from ..core.timing import clock
from .base import Drafter, RowState, elapsed
from .chain import chain, real_tokens, right_aligned
from .tree import Level, grow_tree
from .vocabulary import DraftVocabulary, SharedVocabulary, Translated, shared_prefix

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..core.draft import Draft, DraftRequest


class DecoderCache(Protocol):
    """A decoder's KV cache for rows that grow at different rates (`kv.RaggedKV`, `ort.kv.OrtKV`)."""

    # Whether `forward` takes `tree=(visible, depths)`: a tree level fed as one row's tokens under a
    # tree mask (`RaggedKV`; `OrtKV` of our exports). Without it (an ONNX graph that builds its own
    # causal mask) trees are grown by `BranchRows`, a batch row per node.
    takes_tree_masks: bool

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 0,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """Run the decoder on `tokens` [B, T] (only `valid` [B, T] ones are real) and cache them.

        The one statement of this contract; `RaggedKV.forward` and `OrtKV.forward` keep it.
        `tree` (only where `takes_tree_masks`), for a tree draft: `visible` [B, T, W] and `depths`
        [B, T]; without it the tokens follow each other. Token i attends to the last W >= T cache
        columns (this forward's T among them) only where `visible` is true: its ancestors and
        itself, so a tree can also be fed one level at a time (W then spans the levels fed before).
        Token i's position is the row's real-token count before this forward plus `depths[b, i]`
        (negative when earlier levels, counted there, are not all its ancestors).
        Returns an output whose `.logits` are those of the last `logits_to_keep` positions (all if
        0), [B, T', V].
        """
        ...

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b."""
        ...

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep `rows` (indices into the current batch, in that order; repeats copy a row)."""
        ...


class DraftDecoder(Protocol):
    """A causal LM a drafter runs token by token: `TorchDecoder` or `ort.session.OnnxDecoder`."""

    device: torch.device  # where its cache lives and its tokens go
    config: Any  # its model config: the compatibility check reads the vocabulary size

    def new_cache(self, batch_size: int) -> DecoderCache:
        """An empty KV cache for `batch_size` rows."""
        ...


class TorchDecoder:
    """A PyTorch causal LM as a `DraftDecoder`; once `compile`d, its caches are static ones whose
    forwards after the first run compiled, as a compiled target's do (`StaticKV`)."""

    def __init__(self, model: PreTrainedModel, compile_with_target: bool = True) -> None:
        check_rolls_back(model, "use a draft model with an attention or linear-attention cache", "The draft ")
        self.model = model  # in the mode it was given: plain's assistants are not switched to eval either
        self.config = model.config
        # Where it computes: not `model.device`, which is `meta` where device_map offloaded its first weights.
        self.device = execution_device(model)
        self.compile_with_target = compile_with_target  # see `DraftModelConfig`
        self.compiled: tuple[Any, int, tuple[int, ...]] | None = None  # (CompileConfig, capacity, widths)

    def compile(self, config: Any, capacity: int, widths: tuple[int, ...]) -> None:
        """From now on `new_cache` gives static caches of `capacity` positions, forwards padded to
        `widths` and compiled by `config`."""
        self.compiled = (config, capacity, widths)

    def can_compile(self) -> bool:
        """Whether to compile it alike with a compiled target: asked to (`compile_with_target`), and
        a static cache serves it as a target's (`core.checks.check_static_cache`): full-attention
        layers only (a sliding window's ring buffer cannot be rolled back), and an attention that
        takes the 2D mask of real columns."""
        if not self.compile_with_target:
            return False
        attention = self.model.config.get_text_config(decoder=True)._attn_implementation
        layers = StaticCache(config=self.model.config, max_cache_len=1).layers  # allocated lazily
        return attention in ("sdpa", "eager") and all(type(layer) is StaticLayer for layer in layers)

    def new_cache(self, batch_size: int) -> RaggedKV | StaticKV:
        if self.compiled is None:
            return RaggedKV(self.model, None, batch_size, self.device)
        config, capacity, widths = self.compiled
        cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        decode = self.model.get_compiled_call(config)
        return StaticKV(self.model, cache, batch_size, self.device, widths, decode, config)


class DecoderDrafter(RowState, Drafter):
    """Drafts with a decoder, greedily or by sampling from its processed distribution.

    Each row's cache is rolled back to what it still shares with the row's sequence (which also
    survives EOS and restarts), then fed the rest; `observe` has nothing to learn.

    A draft of another tokenizer reads and answers through its `vocabulary`
    (`vocabulary.TokenIntersection`): the rows' sequences, the cache and `cached` are then in the
    draft's own ids, the logits drafted from in the target's.

    Asked for a tree (`DraftRequest.tree`, where the subclass `supports_tree`), it grows one with
    `tree.grow_tree`, feeding one level of nodes per forward, `tree_top_k` children per expanded
    node: as one row's tokens under a tree mask where the cache `takes_tree_masks`, else each node
    in a batch row of its own (`BranchRows`). The tree's nodes then leave the cache: the next draft
    feeds the accepted path with the target's token, in one forward.
    """

    # A forward per token of a chain, per level of a tree (draft_model, onnx, quantized alike).
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_TOKEN

    def __init__(
        self,
        decoder: DraftDecoder,
        min_confidence: float,
        device: torch.device,
        tree_top_k: int = 4,
        vocabulary: DraftVocabulary | None = None,
    ) -> None:
        self.decoder = decoder
        self.min_confidence = min_confidence
        self.tree_top_k = tree_top_k
        self.device = device  # the target's: tokens come in and go out there
        self.vocabulary = vocabulary or SharedVocabulary()
        self.kv: DecoderCache | None = None
        self.cached: list[torch.Tensor] = []  # per row: the real tokens the draft cache holds, its ids
        self.translated: list[Translated | None] = []  # per row: its tokens as last translated
        self.row_ids: list[int] = []

    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request)
        vocabulary = self.vocabulary
        self.translated = [
            vocabulary.draft_sequence(real_tokens(request, b), self.translated[b])
            for b in range(len(request.row_ids))
        ]
        sequences = [translated.sequence for translated in self.translated]
        first, catch_up_seconds = self._catch_up(sequences, request)
        first = vocabulary.target_logits(first)

        if request.tree:
            branches = (
                None
                if self.kv.takes_tree_masks
                else BranchRows(self.kv, len(sequences), self.decoder.device, self.device)
            )
            feed = self._feed if branches is None else branches.feed
            draft = grow_tree(
                request,
                request.max_tokens,
                self.tree_top_k,
                self.min_confidence,
                first,
                lambda level: vocabulary.target_logits(
                    feed(dataclasses.replace(level, tokens=vocabulary.draft_ids(level.tokens)))
                ),
            )
            if branches is not None:
                branches.close()
            self.cached = sequences  # what the tree fed is truncated away by the next draft
        else:
            draft = chain(request, request.max_tokens, self.min_confidence, self._logits_after(first))
            fed = [max(n - 1, 0) for n in draft.lengths]  # a row's last draft token is never fed
            self.cached = [
                torch.cat([seq, vocabulary.draft_ids(draft.tokens[b, : fed[b]]).to(seq.device)])
                for b, seq in enumerate(sequences)
            ]
        draft.catch_up_seconds = catch_up_seconds
        return draft

    def _catch_up(self, sequences: list[torch.Tensor], request: DraftRequest) -> tuple[torch.Tensor, float]:
        """Roll each row's cache back to what it still shares with its sequence `sequences[b]` (the
        draft's ids), then feed the rest. Returns the draft's logits after each row's last token
        [B, V_draft] on the target's device, and the seconds that took if it was a catch-up (see
        `DraftRequest.is_catch_up`), else 0."""
        draft_device = self.decoder.device
        keep = [self._shared_prefix(self.cached[b], seq) for b, seq in enumerate(sequences)]
        self.kv.truncate(torch.tensor(keep, device=draft_device))
        pending = [seq[n:] for seq, n in zip(sequences, keep)]
        start = clock(draft_device)
        first = self.kv.forward(*right_aligned(pending, draft_device), logits_to_keep=1).logits[:, -1]
        fed = max(len(p) for p in pending)
        return first.to(self.device), elapsed(start, first) if request.is_catch_up(fed) else 0.0

    def _logits_after(
        self, first: torch.Tensor
    ) -> Callable[[int, torch.Tensor | None, list[bool]], torch.Tensor]:
        """`chain`'s `logits_at`: `first` at position 0, then the draft fed each active row's token."""
        draft_device = self.decoder.device

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            if i == 0:
                return first
            fed = torch.tensor(active, device=draft_device)[:, None]
            tokens = self.vocabulary.draft_ids(previous)[:, None].to(draft_device)
            logits = self.kv.forward(tokens, fed, logits_to_keep=1).logits[:, -1]
            return self.vocabulary.target_logits(logits.to(self.device))

        return logits_at

    def _feed(self, level: Level) -> torch.Tensor:
        """One level of a tree through the draft, seeing only its ancestors: logits [B, W, V]."""
        draft_device = self.decoder.device
        tree = (level.visible.to(draft_device), level.depths.to(draft_device))
        output = self.kv.forward(level.tokens.to(draft_device), level.valid.to(draft_device), tree=tree)
        return output.logits.to(self.device)

    def compile_forwards(self, config: Any, capacity: int, widths: tuple[int, ...], batch_size: int) -> None:
        """A PyTorch draft gets a static cache of the call's batch size whose forwards are compiled
        at every width now, as a compiled target's (`DraftRows.compiled`; drafts a static cache
        cannot serve draft eagerly: `can_compile`, and so do drafts of another tokenizer, whose
        sequences the target's capacity does not bound). The cache is kept for the call's drafts;
        rows that finish stay in its batch, retired."""
        if not isinstance(self.decoder, TorchDecoder) or not self.decoder.can_compile():
            return
        if not self.vocabulary.keeps_length:
            return
        self.decoder.compile(config, DraftRows.room(capacity, widths), widths)
        self.kv = DraftRows.compiled(self.decoder.new_cache(batch_size))
        self.cached = [torch.zeros(0, dtype=torch.long, device=self.device) for _ in range(batch_size)]
        self.translated = [None] * batch_size
        self.row_ids = list(range(batch_size))  # the loop's rows: the user's batch, in order

    def probe_seconds(self, batch_size: int) -> float | None:
        """One draft forward of one token per row on a nearly empty cache: what a draft token costs
        at least, known before the catch-up over the prompt is paid. Best of two runs, since a fresh
        model's or ONNX session's first run is slow. On a cache of its own, or on a compiled draft's
        (`compile_forwards`), whose compiled forwards are the ones drafting will run: what the probe
        feeds there is truncated away by the first draft, as nothing of it is in `cached`."""
        kv = self.kv if self.kv is not None else self.decoder.new_cache(batch_size)
        if isinstance(kv, DraftRows):  # a compiled batch: every forward is the whole batch's shape
            batch_size = len(kv.slots.rows)
        tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=self.decoder.device)
        valid = torch.ones(batch_size, 1, dtype=torch.bool, device=self.decoder.device)
        best = float("inf")
        for _ in range(2):
            start = clock(self.decoder.device)
            kv.forward(tokens, valid, logits_to_keep=1)
            best = min(best, clock(self.decoder.device) - start)
        return best

    def _start_rows(self, request: DraftRequest) -> None:
        self.kv = self.decoder.new_cache(len(request.row_ids))
        self.cached = [torch.zeros(0, dtype=torch.long, device=self.device) for _ in request.row_ids]
        self.translated = [None] * len(request.row_ids)

    def _keep_rows(self, kept: list[int]) -> None:
        self.kv.select_rows(torch.tensor(kept, device=self.decoder.device))
        self.cached = [self.cached[i] for i in kept]
        self.translated = [self.translated[i] for i in kept]

    @staticmethod
    def _shared_prefix(cached: torch.Tensor, seq: torch.Tensor) -> int:
        """Length of the common prefix, leaving at least one token of `seq` to feed."""
        return shared_prefix(cached, seq[:-1])


class BranchRows:
    """Feeds a tree level by level to a cache that takes no tree masks: each node gets a batch row
    of its own, a copy of its parent's row (the sequence, then the node's ancestors), and is fed
    there as the next token of a plain chain. No node ever sees a sibling, so the causal mask the
    ONNX graph builds is the right one, at the price of copying each parent's cache per child
    (on a CPU a level of 4 nodes costs 1.7x a chain token after 128 tokens of context, 4.9x after
    1024; 1.2x under a tree mask: `benchmarks/micro/ort_tree_levels.py`).

    Holds, between levels, which cache row holds each fed node; `close` leaves one row per draft
    row again, whose tree tokens the next draft's truncation removes (they are real tokens there).
    """

    def __init__(
        self, kv: DecoderCache, batch: int, cache_device: torch.device, device: torch.device
    ) -> None:
        self.kv = kv
        self.batch = batch
        self.cache_device = cache_device  # the decoder's: row indices and tokens go there
        self.device = device  # where the logits go: the target's
        self.owners = list(range(batch))  # per cache row: the draft row whose sequence it holds
        self.row_of: dict[tuple[int, int], int] = {}  # (draft row, tree column) -> its cache row

    def feed(self, level: Level) -> torch.Tensor:
        """One level of a tree, each node after its parent's path: logits [B, W, V]."""
        batch, width = level.tokens.shape
        before = level.visible.shape[2] - width  # tree columns fed by earlier levels
        valid = level.valid.tolist()
        parents = level.parent_columns.tolist()
        level_tokens = level.tokens.tolist()
        first = self._first_rows()
        sources, nodes = [], []  # per new cache row: the row it copies, and its node (b, i) or (b, -1)
        for b in range(batch):
            mine = [i for i in range(width) if valid[b][i]]
            for i in mine:
                # A level's parents are the previous level's nodes; the first level's, the row's last token.
                sources.append(first[b] if parents[b][i] < 0 else self.row_of[b, parents[b][i]])
                nodes.append((b, i))
            if not mine:  # nothing to feed: one row keeps the row's sequence, fed a hole
                sources.append(first[b])
                nodes.append((b, -1))
        self.kv.select_rows(torch.tensor(sources, device=self.cache_device))
        self.owners = [b for b, _ in nodes]
        self.row_of = {(b, before + i): row for row, (b, i) in enumerate(nodes) if i >= 0}
        tokens = torch.tensor([[level_tokens[b][i] if i >= 0 else 0] for b, i in nodes])
        tokens = tokens.to(self.cache_device)  # [R, 1]
        fed = torch.tensor([[i >= 0] for _, i in nodes], device=self.cache_device)  # [R, 1]
        logits = self.kv.forward(tokens, fed, logits_to_keep=1).logits[:, -1].to(self.device)  # [R, V]
        out = logits.new_zeros(batch, width, logits.shape[-1])
        rows = [row for row, (_, i) in enumerate(nodes) if i >= 0]
        out[[nodes[row][0] for row in rows], [nodes[row][1] for row in rows]] = logits[rows]
        return out

    def _first_rows(self) -> dict[int, int]:
        """Per draft row, the first cache row holding its sequence."""
        first: dict[int, int] = {}
        for row, b in enumerate(self.owners):
            first.setdefault(b, row)
        return first

    def close(self) -> None:
        """Back to one cache row per draft row (each row's first copy)."""
        first = self._first_rows()
        self.kv.select_rows(torch.tensor([first[b] for b in range(self.batch)], device=self.cache_device))
