"""DFlash and DSpark drafting: a whole block of drafts from one forward of a block draft.

Each request, the draft first takes in the target's hidden states of the tokens the target cached
since the last request (its context: keys and values per layer, kept per row), then runs the block
[newest token, mask, ..., mask] once: one distribution per block position. A chain is the block's
argmax path (or a sample of it), cut where the policy says; a tree takes the top-k of each position,
grown by `tree.grow_tree` without any further forward. With DSpark's Markov head each position's
logits also depend on the token drafted before it, which the chain and the tree supply.

Sampling is exact. Rejection sampling (Leviathan et al. 2023, Algorithm 1) accepts draft token i with
probability min(1, p_i(x) / q_i(x)) and otherwise resamples from max(0, p_i - q_i), where q_i must be
the distribution x was drawn from given the tokens before it. The proof needs nothing else of q_i: it
may depend on the earlier drafted tokens (an autoregressive draft, DSpark's Markov head) or not at
all (DFlash's positions, which see only the mask tokens before them). So each row samples token i
from its processed q_i (`chain.next_tokens`: the processors see the drafted tokens, as the target's
will) and hands that very q_i to the verifier in `Draft.probs`. A row's draft may also end where
DSpark's confidence head says, since that estimate for position i reads only tokens before i: the
decision to draft token i never depends on token i itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..config import CHAINS, read_when
from ..core.devices import execution_device
from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.fields import check_fields
from ..core.timing import clock
from ..heads.checkpoint import load_head
from ..heads.dflash import BlockDraft, attention_masks
from .base import Drafter, RowState, elapsed, options_to_config
from .chain import chain, right_aligned
from .head_drafter import HeadDrafter
from .registry import register_drafter
from .tree import ChainTreeConfig, Level, grow_tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


BLOCK_METHODS = ("dflash", "dspark")


def load_block_draft(source: Any, target: PreTrainedModel) -> BlockDraft:
    """The block draft `source` names (a folder, a Hub repo id or a module), checked against `target`."""
    return load_head(source, target, method="dflash")


@dataclass
class BlockDrafterConfig(ChainTreeConfig):
    """Settings of the `dflash` and `dspark` drafters.

    Args:
        min_confidence: stop a greedy draft once the draft's probability of its next token falls
            below this; 0 leaves the cut to the draft-length policy.
        tree_top_k: with `SpeculativeConfig(tree=...)`: the children drafted per expanded node and
            the nodes expanded per level (EAGLE-2's top-k over the block's positions).
        confidence_threshold: DSpark drafts: end each row's chain before the first position whose
            confidence-head estimate is below this (DeepSpec's variable verify length); 0 keeps the
            whole block and leaves the cut to the policy, which reads the same estimates. Refused
            for a draft without a confidence head; trees do not read it (a warning says so).
    """

    confidence_threshold: float = read_when(CHAINS, 0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, ranges={"confidence_threshold": (0, 1)})


class BlockContext:
    """What a block draft holds of each row: per layer, the keys and values of the row's context
    (right-aligned chunks, one per request, so rows that took in fewer tokens have holes), their
    positions, and which columns are real."""

    def __init__(self, layers: int, batch_size: int, device: torch.device) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)

    def append(
        self,
        keys_values: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [B, kv_heads, T, d]
        positions: torch.Tensor,  # [B, T]
        valid: torch.Tensor,  # [B, T]
    ) -> None:
        for i, (k, v) in enumerate(keys_values):
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.valid = torch.cat([self.valid, valid], dim=1)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current batch), and drop columns that are holes in all."""
        keep = self.valid[rows].any(dim=0)
        self.keys = [None if k is None else k[rows][:, :, keep] for k in self.keys]
        self.values = [None if v is None else v[rows][:, :, keep] for v in self.values]
        self.positions, self.valid = self.positions[rows][:, keep], self.valid[rows][:, keep]


@register_drafter
class DFlashDrafter(RowState, HeadDrafter):
    """Drafts a block per request from a DFlash, DSpark or MuseGlimmer block draft
    (`SpeculativeConfig.draft`: a folder or Hub repo in any layout `heads.dflash_published` reads,
    or one `hf-specdec train-draft --method dflash` wrote)."""

    name: ClassVar[str] = "dflash"
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_BLOCK
    options_class: ClassVar[type] = BlockDrafterConfig

    def __init__(
        self, head: BlockDraft, config: BlockDrafterConfig, vocab_size: int, device: torch.device
    ) -> None:
        super().__init__(head, config, vocab_size, device)
        self.context: BlockContext | None = None
        self.row_ids: list[int] = []

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        if config.draft is None:
            raise ValueError(
                f"method={cls.name!r} needs a block draft: SpeculativeConfig(method={cls.name!r}, "
                "draft='folder/or/repo') with a DFlash (z-lab), DSpark or DFlash (DeepSpec) or MuseGlimmer "
                "assistant checkpoint, or one trained with "
                "`hf-specdec train-draft --target <model> --method dflash --out <folder>`."
            )
        head = load_block_draft(config.draft, target)
        cls.check_draft(head, config.draft)
        options = options_to_config(cls.options_class, config.options)
        threshold = options.confidence_threshold
        if threshold > 0 and head.confidence_head is None:
            raise ValueError(
                f"options confidence_threshold={threshold} cuts drafts by DSpark's confidence head, and "
                f"the draft ({head.config.layout}) has no confidence head: drop the option."
            )
        return cls(head, options, target.config.get_text_config().vocab_size, execution_device(target))

    @classmethod
    def check_draft(cls, head: BlockDraft, source: Any) -> None:
        """Refuse a draft this method does not run (every block draft runs as `dflash`)."""

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request)
        config = self.head.config
        began = clock(self.device)

        # The context: the target's hidden states of the tokens it cached since the last request.
        chunks, spans, anchors = [], [], []
        for b in range(len(request.row_ids)):
            real, new, start, count = self.arrived(request, b)
            width = len(config.target_layer_ids) * config.hidden_size
            chunks.append(new if count else torch.zeros(0, width))
            spans.append(torch.arange(start, start + count))
            anchors.append(real[-1])
            self.done[b] += count
        features, valid = right_aligned(chunks, self.device, dtype=self.head.fc.weight.dtype)
        if features.shape[1]:
            places, _ = right_aligned(spans, self.device)
            self.context.append(self.head.context_keys(features, places), places, valid)

        # The block [anchor, mask, ...] at the anchor's position on: one forward, every position.
        anchor_at = torch.tensor(self.done, device=self.device)  # the anchor is token number done[b]
        block_at = anchor_at[:, None] + torch.arange(config.block_size, device=self.device)
        keys_at = torch.cat([self.context.positions, block_at], dim=1)
        real_keys = torch.cat([self.context.valid, torch.ones_like(block_at, dtype=torch.bool)], dim=1)
        masks = attention_masks(config, block_at, keys_at, real_keys, self.context.valid.shape[1])
        anchor = torch.stack(anchors).to(self.device)
        embeds = self.head.embed_block(anchor)
        hidden = self.head.run_block(embeds, block_at, self.context.layers(), masks)
        hidden = self.head.drafting_outputs(hidden)
        catch_up_seconds = elapsed(began, hidden) if request.is_catch_up(features.shape[1]) else 0.0

        steps = min(max(request.max_tokens, default=0), config.drafts_per_block)
        hidden = hidden[:, :steps]
        logits = self.head.logits(hidden)  # [B, steps, draft_vocab]
        max_tokens = [min(n, steps) if not request.tree else n for n in request.max_tokens]
        if request.tree:
            draft = self._tree(request, max_tokens, anchor, hidden, logits)
        else:
            draft = self._chain(request, max_tokens, anchor, hidden, logits)
        draft.catch_up_seconds = catch_up_seconds
        return draft

    def _position_logits(
        self, i: int, previous: torch.Tensor, hidden: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Full-vocabulary logits [N, V] of block position i after `previous` [N] (the token before
        it: DSpark's Markov head reads it; DFlash's positions do not depend on it)."""
        bias = self.head.markov_bias(previous, hidden)
        return self.full_vocab(logits if bias is None else logits + bias.to(logits.dtype))

    def _chain(
        self,
        request: DraftRequest,
        max_tokens: list[int],
        anchor: torch.Tensor,
        hidden: torch.Tensor,  # [B, steps, H]
        logits: torch.Tensor,  # [B, steps, draft_vocab]
    ) -> Draft:
        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            before = anchor if previous is None else previous
            return self._position_logits(i, before, hidden[:, i], logits[:, i])

        draft = chain(request, max_tokens, self.config.min_confidence, logits_at)
        width = draft.tokens.shape[1]
        if self.head.confidence_head is None or width == 0:
            return draft
        before = torch.cat([anchor[:, None], draft.tokens[:, :-1]], dim=1)
        estimate = self.head.confidence(hidden[:, :width], before)
        # DSpark's confidence head estimates just what `Draft.confidence` means; the threshold cut
        # reads position i's estimate, which depends on tokens before i only (see the module doc).
        draft.confidence = estimate.to(draft.tokens.device)
        threshold = self.config.confidence_threshold
        if threshold > 0:
            below = (estimate < threshold).cumsum(dim=1) > 0
            kept = (~below).sum(dim=1).tolist()
            return draft.truncated([min(n, k) for n, k in zip(draft.lengths, kept)])
        return draft

    def _tree(
        self,
        request: DraftRequest,
        max_tokens: list[int],
        anchor: torch.Tensor,
        hidden: torch.Tensor,
        logits: torch.Tensor,
    ) -> Draft:
        """EAGLE-2's dynamic tree over the block's positions: a node at depth d takes the top-k of
        position d (after its own token, for a Markov head), with no draft forward per level."""
        steps = logits.shape[1]
        depth = 0

        def feed(level: Level) -> torch.Tensor:
            nonlocal depth
            depth += 1  # grow_tree feeds one level per depth, the children of depth `depth`
            batch, width = level.tokens.shape
            at = hidden[:, depth, None].expand(-1, width, -1).flatten(0, 1)
            base = logits[:, depth, None].expand(-1, width, -1).flatten(0, 1)
            out = self._position_logits(depth, level.tokens.flatten(), at, base)
            return out.reshape(batch, width, -1)

        root = self._position_logits(0, anchor, hidden[:, 0], logits[:, 0]) if steps else None
        if root is None:
            return Draft.empty(len(max_tokens), self.device)
        top_k, floor = self.config.tree_top_k, self.config.min_confidence
        return grow_tree(request, max_tokens, top_k, floor, root, feed, max_depth=steps)

    def _start_rows(self, request: DraftRequest) -> None:
        self.context = BlockContext(len(self.head.layers), len(request.row_ids), self.device)
        self.done = [0] * len(request.row_ids)

    def _keep_rows(self, kept: list[int]) -> None:
        self.context.select_rows(torch.tensor(kept, device=self.device))
        self.done = [self.done[i] for i in kept]


@register_drafter
class DSparkDrafter(DFlashDrafter):
    """DFlash drafting with DSpark's heads (DeepSpec's layout): the Markov head conditions each block
    position on the token drafted before it, the confidence head sizes each row's draft."""

    name: ClassVar[str] = "dspark"

    @classmethod
    def check_draft(cls, head: BlockDraft, source: Any) -> None:
        if head.markov_head is None and head.confidence_head is None:
            raise ValueError(
                f"{source!r} is a block draft without DSpark's Markov and confidence heads "
                f"({head.config.layout}): use SpeculativeConfig(method='dflash')."
            )
