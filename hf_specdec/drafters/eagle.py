"""EAGLE drafting: chain a one-layer feature head, seeded with the target's own hidden states."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import DynamicCache

from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.kv import RaggedKV
from ..core.static_kv import DraftRows, StaticKV
from ..core.timing import clock
from ..heads.eagle import static_cache
from .base import RowState, elapsed
from .chain import chain, right_aligned
from .head_drafter import HeadDrafter, HeadDrafterConfig
from .registry import register_drafter
from .tree import Level, grow_tree


@register_drafter
class EagleDrafter(RowState, HeadDrafter):
    """Feeds the head the target's features of every token the target has cached, then chains.

    The head keeps its own KV cache: positions whose features came from the target stay, the
    chained draft positions (fed the head's own predictions) are cut off at the next request.

    Asked for a tree, it grows EAGLE-2's dynamic tree (`tree.grow_tree`: the frontier nodes of
    highest cumulative draft probability expanded into their top-k children, the budget's most
    probable nodes kept), one level per head forward: each node reads its parent's predicted
    feature, under a tree mask.

    `MtpDrafter` drafts the same way with a model's MTP layers, depth 0 as the head.
    """

    name: ClassVar[str] = "eagle"
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_TOKEN  # a head forward per token (per tree level)

    def __init__(self, head: Any, config: HeadDrafterConfig, vocab_size: int, device: torch.device) -> None:
        super().__init__(head, config, vocab_size, device)
        self.feature_dtype = next(head.parameters()).dtype
        self.kv: RaggedKV | DraftRows | None = None
        self.row_ids: list[int] = []

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request)
        self._roll_back()
        began = clock(self.device)
        output, fed = self._catch_up(request)
        catch_up_seconds = elapsed(began, output.logits) if request.is_catch_up(fed) else 0.0
        max_tokens = [n if self.done[b] > 0 else 0 for b, n in enumerate(request.max_tokens)]
        if request.tree:
            draft = self._tree(request, max_tokens, output)
        else:
            draft = self._chain(request, max_tokens, output)
        draft.catch_up_seconds = catch_up_seconds
        return draft

    def _roll_back(self) -> None:
        """Drop the positions last step's draft chained (or its tree's nodes) from the head's cache."""
        self.kv.truncate(torch.tensor(self.done, device=self.device))

    def _catch_up(self, request: DraftRequest) -> tuple[Any, int]:
        """Feed the head the target's features of the tokens the target cached since the last
        request: position t reads (f_t, x_{t+1}). Returns the head's output, whose last position
        predicts each row's next token, and how many positions the widest row fed."""
        tokens, features = [], []
        for b in range(len(request.row_ids)):
            real, new, start, count = self.arrived(request, b)
            tokens.append(real[start + 1 : start + 1 + count])
            size = self.head.config.hidden_size
            features.append(self.head.project_features(new) if count else torch.zeros(0, size))
            self.done[b] += count
        ids, valid = right_aligned(tokens, self.device)
        feats, _ = right_aligned(features, self.device, dtype=self.feature_dtype)
        return self.kv.forward(ids, valid, logits_to_keep=1, features=feats), ids.shape[1]

    def _chain(self, request: DraftRequest, max_tokens: list[int], output: Any) -> Draft:
        """A chain after the catch-up `output`, the head fed its own predicted features."""

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            nonlocal output
            if i > 0:
                output = self._chained(self.kv, output, previous, active)
            return self.full_vocab(output.logits[:, -1])

        return chain(request, max_tokens, self.config.min_confidence, logits_at)

    def _chained(self, kv: Any, output: Any, previous: torch.Tensor, active: list[bool]) -> Any:
        """One chain step over `kv`: each active row's last draft token `previous` [B], its predicted
        feature (the last of `output`) standing in for the target's at that position."""
        fed = torch.tensor(active, device=self.device)[:, None]
        # A copy: a compiled forward's outputs may be its CUDA graph's, overwritten by the next;
        # with a contiguous layout, as a compiled graph is specialized on strides.
        predicted = output.hidden_states[:, -1:].clone(memory_format=torch.contiguous_format)
        tokens = previous[:, None].to(self.device)  # drafted where the target computes (`MtpDrafter`)
        return kv.forward(tokens, fed, logits_to_keep=1, features=predicted)

    def compile_forwards(self, config: Any, capacity: int, widths: tuple[int, ...], batch_size: int) -> None:
        """The head gets a static cache of the call's batch size whose forwards after the first are
        padded to the target's `widths` and compiled by `config` (the catch-up over the target's
        newly cached tokens, and each chained token at width 1), every width compiled now
        (`DraftRows.compiled`). Rows that finish stay in its batch, retired.
        Trees are not drafted on a static target."""
        if not self.config.compile_with_target:
            return
        cache = static_cache(self.head.config, DraftRows.room(capacity, widths))
        decode = torch.compile(self.head.forward, **config.to_dict())
        kv = StaticKV(self.head, cache, batch_size, self.device, widths, decode, config)
        size, dtype = self.head.config.hidden_size, self.feature_dtype

        def features(width: int) -> dict[str, torch.Tensor]:
            return {"features": torch.zeros(batch_size, width, size, dtype=dtype, device=self.device)}

        self.kv = DraftRows.compiled(kv, features)
        self.done = [0] * batch_size
        self.row_ids = list(range(batch_size))  # the loop's rows: the user's batch, in order

    def _tree(self, request: DraftRequest, max_tokens: list[int], output: Any) -> Draft:
        """EAGLE-2's dynamic tree after the catch-up `output`; its nodes leave the cache at the next
        request, as chained positions do."""
        fed = [
            output.hidden_states[:, -1:]
        ]  # [B, 1, H] the predicted feature after the last token, then per level

        def feed(level: Level) -> torch.Tensor:
            level = level.to(self.device)  # grown where the target computes (`MtpDrafter`)
            predicted = torch.cat(fed, dim=1)  # column 0: the last token's; tree column c at 1 + c
            rows = torch.arange(len(max_tokens), device=self.device)[:, None]
            features = predicted[rows, level.parent_columns + 1]  # each node reads its parent's
            out = self.kv.forward(
                level.tokens, level.valid, tree=(level.visible, level.depths), features=features
            )
            fed.append(out.hidden_states)
            batch, width, _ = out.logits.shape
            logits = self.full_vocab(out.logits.flatten(0, 1))
            return logits.reshape(batch, width, -1)

        root = self.full_vocab(output.logits[:, -1])
        return grow_tree(request, max_tokens, self.config.tree_top_k, self.config.min_confidence, root, feed)

    def _start_rows(self, request: DraftRequest) -> None:
        batch = len(request.row_ids)
        self.kv = RaggedKV(self.head, DynamicCache(), batch, self.device, boolean_masks=True)
        self.done = [0] * batch

    def _keep_rows(self, kept: list[int]) -> None:
        self.kv.select_rows(torch.tensor(kept, device=self.device))
        self.done = [self.done[i] for i in kept]
