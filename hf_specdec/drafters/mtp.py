"""MTP drafting: a model's own multi-token-prediction layers (`heads/mtp.py`) draft for it.

Depth k of the layers reads, at index t, depth k-1's hidden state there (the target's own for
k = 0) and the token x_{t+k+1}; it has real inputs up to the index whose token is the row's last
known one, and each depth keeps a cache of its own over those indices, as transformers' `MtpCache`
does. A step drafts token i + 1 with depth i over the indices it has not cached yet: the real ones
(kept) and the last i, whose tokens are this step's drafts d_1..d_i (cut at the next request, as
EAGLE's chained positions are). Past the last depth the chain reapplies the last layer, reading its
own hidden state at the next index (what EAGLE does with its one layer). Every depth serves the
whole ragged batch in one forward, its rows right-aligned.

Asked for a tree, depth 0 grows EAGLE-2's dynamic tree, each node reading its parent's hidden
state: a deeper depth's context holds the chain's own drafts, which differ from branch to branch.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_layers import MtpModel

from ..core.devices import execution_device
from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.kv import RaggedKV, positions
from ..core.timing import clock
from ..heads.checkpoint import load_head
from ..heads.eagle import EagleHead
from ..heads.layers import is_whole_vocab
from ..heads.mtp import MtpDepth, load_mtp_layers, own_mtp_weights
from .base import Drafter, elapsed, options_to_config
from .chain import arrived, chain, right_aligned
from .head_drafter import full_vocab
from .registry import register_drafter
from .tree import ChainTreeConfig, Level, grow_tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

# A target's MTP layers, kept while the target lives so that each `generate` call does not read them
# out of its checkpoint again; `clear_loaded` (hf_specdec.clear_cache) drops them.
_LOADED: weakref.WeakKeyDictionary[Any, nn.Module] = weakref.WeakKeyDictionary()


def clear_loaded() -> None:
    _LOADED.clear()


def own_layers(target: Any) -> str | None:
    """Why `target` (a loaded model, a model folder, or a Hub repo id in the local Hub cache) drafts
    with its own MTP layers, in a sentence; None where its checkpoint here holds none transformers
    loads. Nothing is downloaded."""
    found = own_mtp_weights(target)
    if found is None:
        return None
    folder, keys, _ = found
    under = os.path.commonprefix(keys).rpartition(".")[0] or keys[0]
    return (
        f"its checkpoint ({folder}) carries its own multi-token-prediction layers ({len(keys)} weights "
        f"under {under}), which draft for it: nothing to download"
    )


def layers_for(target: Any) -> nn.Module:
    """`target`'s MTP layers, read out of its checkpoint once per model (`load_mtp_layers`)."""
    mtp = _LOADED.get(target)
    if mtp is None:
        mtp = _LOADED[target] = load_mtp_layers(target)
    return mtp


@register_drafter
class MtpDrafter(Drafter):
    """Drafts with the target's own MTP layers, or with an MTP head trained for it."""

    name: ClassVar[str] = "mtp"
    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_TOKEN
    hidden_state_layers: tuple[int, ...] = (-1,)  # the target's last, post-norm hidden state

    def __init__(
        self,
        depths: list[nn.Module],
        config: ChainTreeConfig,
        target: PreTrainedModel,
        draft_vocab: torch.Tensor | None = None,
    ) -> None:
        """`depths`: one module per MTP depth (`MtpDepth`, or a trained head); `draft_vocab`: the
        token ids a trained head scores (None: the whole vocabulary)."""
        self.depths = depths
        self.config = config
        text = target.config.get_text_config()
        self.vocab_size, self.hidden_size = text.vocab_size, text.hidden_size
        self.draft_vocab = draft_vocab
        # Read once: whether a trained head's vocabulary is the whole one asks the device, per token.
        self.whole_vocab = draft_vocab is None or is_whole_vocab(draft_vocab, self.vocab_size)
        self.device = execution_device(target)
        self.kvs: list[RaggedKV] = []
        self.row_ids: list[int] = []
        # Per depth, per row: the indices cached with real inputs, and the hidden states depth k has
        # computed at real indices that depth k + 1 has not cached as real yet (what it reads next).
        self.real: list[list[int]] = []
        self.carried: list[list[torch.Tensor]] = []

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        """The layers are read out of the target's checkpoint; or `draft=` gives them loaded already
        (transformers' `MtpModel.from_pretrained(target)`, or one built for the target), or names an
        MTP head of ours, trained for a target that ships none (`hf-specdec train-draft --method mtp`)."""
        options = options_to_config(ChainTreeConfig, config.options)
        draft = config.draft
        if draft is None or isinstance(draft, MtpModel):
            mtp = layers_for(target) if draft is None else draft
            return cls([MtpDepth(mtp, k) for k in range(len(mtp.layers))], options, target)
        if isinstance(draft, nn.Module) and not isinstance(draft, EagleHead):
            raise ValueError(
                "method='mtp' drafts with the target's own MTP layers, read out of its checkpoint: drop "
                f"draft= (or give transformers' MtpModel of them, or an MTP head of ours; got "
                f"{type(draft).__name__}). A separate draft model is method='draft_model'."
            )
        head = load_head(draft, target, method="mtp")
        return cls([head], options, target, head.draft_vocab)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request.row_ids, request.tree)
        for kv, real in zip(self.kvs, self.real):
            kv.truncate(torch.tensor(real, device=self.device))  # drop last step's chained indices
        sequences = [arrived(request, b, self.real[0][b], self.name)[0] for b in range(len(request.row_ids))]

        began = clock(self.device)
        features = [torch.zeros(0, self.hidden_size) if h is None else h for h in request.hidden_states]
        output, chained = self._depth_forward(0, sequences, [], features)
        fed = max(len(f) for f in features)
        catch_up_seconds = elapsed(began, output.logits) if request.is_catch_up(fed) else 0.0

        max_tokens = [n if len(s) > 1 else 0 for n, s in zip(request.max_tokens, sequences)]
        if request.tree:
            draft = self._tree(request, max_tokens, output)
        else:
            draft = self._chain(request, max_tokens, sequences, output, chained)
        draft.catch_up_seconds = catch_up_seconds
        return draft

    def _chain(
        self,
        request: DraftRequest,
        max_tokens: list[int],
        sequences: list[torch.Tensor],
        output: Any,
        chained: list[int],
    ) -> Draft:
        """Draft token i + 1 with depth i, past the last depth with the last one reapplied."""
        deepest = min(len(self.kvs), max(max_tokens, default=0))
        drafted: list[torch.Tensor] = []  # [B] per draft token so far

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            nonlocal output, chained
            if i > 0:
                drafted.append(previous)
            if 0 < i < deepest:  # depth i reads depth i-1's outputs at the indices it chained
                width = output.hidden_states.shape[1]
                hidden = [output.hidden_states[b, width - n :] for b, n in enumerate(chained)]
                output, chained = self._depth_forward(i, sequences, drafted, hidden)
            elif i >= deepest:  # the last depth reads its own hidden state at the next index
                fed = torch.tensor(active, device=self.device)[:, None]
                predicted = output.hidden_states[:, -1:]
                output = self.kvs[deepest - 1].forward(
                    previous[:, None], fed, logits_to_keep=1, features=predicted
                )
            return self._full_vocab(output.logits[:, -1])

        return chain(request, max_tokens, self.config.min_confidence, logits_at)

    def _depth_forward(
        self, k: int, sequences: list[torch.Tensor], drafted: list[torch.Tensor], hidden: list[torch.Tensor]
    ) -> tuple[Any, list[int]]:
        """Feed depth k each row's indices from the first it has not cached as real to the row's
        last: index t reads a hidden state and token x_{t+k+1}, one of this step's `drafted` tokens
        past the row's own. Returns depth k's output and, per row, how many of the indices it fed
        are chained (not real), the last columns of its row.

        `hidden[b]`: for k = 0 the target's new hidden states; else depth k-1's outputs at the indices
        it chained this step, which come after those `carried` holds for depth k."""
        tokens, inputs = [], []
        for b, sequence in enumerate(sequences):
            start, n = self.real[k][b], len(sequence)
            extended = torch.cat([sequence, *(d[b : b + 1] for d in drafted)])
            tokens.append(extended[start + k + 1 : n + k])
            inputs.append(hidden[b] if k == 0 else torch.cat([self.carried[k - 1][b], hidden[b]]))
        ids, valid = right_aligned(tokens, self.device)
        dtype = next(self.depths[k].parameters()).dtype
        feats, _ = right_aligned(inputs, self.device, dtype=dtype)
        kv = self.kvs[k]
        # transformers' positions on the first forward (index t of depth k at t + k + 1); continued after.
        at = {"positions": (valid.cumsum(dim=1) - 1).clamp_min(0) + k + 1} if kv.width == 0 else {}
        output = kv.forward(ids, valid, logits_to_keep=1, features=feats, **at)
        width, chained = ids.shape[1], []
        for b, sequence in enumerate(sequences):
            start, n = self.real[k][b], len(sequence)
            real = max(start, n - 1 - k)  # index t is real while x_{t+k+1} is a known token
            if k > 0:  # what depth k has now cached as real, depth k-1 no longer carries for it
                self.carried[k - 1][b] = self.carried[k - 1][b][real - start :]
            if k + 1 < len(self.carried):  # depth k + 1 reads these real outputs when it next runs
                first = width - (n - 1 - start)
                new = output.hidden_states[b, first : first + real - start]
                self.carried[k][b] = torch.cat([self.carried[k][b], new])
            self.real[k][b] = real
            chained.append(n - 1 - real)
        return output, chained

    def _tree(self, request: DraftRequest, max_tokens: list[int], output: Any) -> Draft:
        """EAGLE-2's dynamic tree on depth 0, each node reading its parent's hidden state; its nodes
        leave the cache at the next request, as chained indices do."""
        fed = [output.hidden_states[:, -1:]]  # [B, 1, H] after the last token, then per level

        def feed(level: Level) -> torch.Tensor:
            predicted = torch.cat(fed, dim=1)  # column 0: the last token's; tree column c at 1 + c
            rows = torch.arange(len(max_tokens), device=self.device)[:, None]
            features = predicted[rows, level.parent_columns + 1]
            out = self.kvs[0].forward(
                level.tokens, level.valid, tree=(level.visible, level.depths), features=features
            )
            fed.append(out.hidden_states)
            batch, width, _ = out.logits.shape
            return self._full_vocab(out.logits.flatten(0, 1)).reshape(batch, width, -1)

        root = self._full_vocab(output.logits[:, -1])
        return grow_tree(request, max_tokens, self.config.tree_top_k, self.config.min_confidence, root, feed)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary: a trained head's draft vocabulary scattered
        into it, a shared head cut to the unpadded vocabulary (`unpadded_vocab_size`) padded back;
        the ids left out at -inf."""
        if self.draft_vocab is not None:
            return full_vocab(logits, self.draft_vocab, self.vocab_size, whole=self.whole_vocab)
        missing = self.vocab_size - logits.shape[-1]
        if missing <= 0:
            return logits
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], missing), float("-inf"))], dim=-1)

    def _follow_rows(self, row_ids: list[int], tree: bool) -> None:
        batch = len(row_ids)
        if not self.kvs:
            # A call drafting trees reads depth 0 only: deeper depths get no cache, nothing carried.
            depths = self.depths[:1] if tree else self.depths
            self.kvs = [RaggedKV(d, DynamicCache(), batch, self.device, boolean_masks=True) for d in depths]
            self.real = [[0] * batch for _ in depths]
            empty = torch.zeros(0, self.hidden_size, device=self.device)
            self.carried = [[empty] * batch for _ in depths]
        elif row_ids != self.row_ids:
            where = positions(self.row_ids, row_ids)
            for kv in self.kvs:
                kv.select_rows(torch.tensor(where, device=self.device))
            self.real = [[r[i] for i in where] for r in self.real]
            self.carried = [[c[i] for i in where] for c in self.carried]
        self.row_ids = list(row_ids)
