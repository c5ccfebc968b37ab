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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_layers import MtpModel

from ..core.devices import check_placed, execution_device
from ..core.draft import Draft, DraftRequest
from ..core.kv import RaggedKV
from ..heads.checkpoint import load_head
from ..heads.eagle import EagleHead
from ..heads.mtp import (
    MtpDepth,
    checkpoint_folder,
    checkpoint_model,
    clear_read_files,
    load_mtp_layers,
    mtp_layer_count,
    mtp_placement,
    mtp_weight_keys,
)
from ..store.manifest import checkpoint_stamp
from .base import Drafter, options_to_config
from .chain import chain, real_tokens, right_aligned
from .eagle import EagleDrafter
from .registry import register_drafter
from .tree import ChainTreeConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass(frozen=True)
class _Read:
    """What reading a target's MTP layers out of its checkpoint gave: the layers, or why they do not
    load; and what that depended on (`basis`: the checkpoint's files, where the layers run, the
    attention implementation), which a later call compares to read them again only once it changed."""

    basis: tuple
    layers: nn.Module | None
    failure: str = ""


class RememberedFailure(ValueError):
    """A target's MTP layers did not load on an earlier call, and nothing they depend on changed since:
    the error then, raised again without reading anything (and, by `select_draft`, not warned again)."""


# Per target, kept while it lives, what reading its MTP layers gave, so that each `generate` call does
# not read them (or fail to) out of its checkpoint again; `clear_loaded` (hf_specdec.clear_cache)
# forgets them and the files read for them.
_READ: weakref.WeakKeyDictionary[Any, _Read] = weakref.WeakKeyDictionary()


def clear_loaded() -> None:
    _READ.clear()
    clear_read_files()


def own_layers(target: Any) -> str | None:
    """Why `target` (a loaded model, a model folder, or a Hub repo id in the local Hub cache) drafts
    with its own MTP layers, in a sentence; None where it has none here (its config declares none
    transformers loads, or its checkpoint is not here). Decided as method='mtp' loads them
    (`load_mtp_layers`): a loaded model's once per checkpoint (`layers_for`, kept for the drafter); a
    folder's onto the meta device, from its safetensors headers. Nothing is downloaded, and a call
    after the first reads no file again while the checkpoint's files are unchanged.

    Raises:
        ValueError: its config declares MTP layers and its checkpoint is here, but they do not load
            (none in the checkpoint, weights missing or misshapen, ...); the message says why.
            `RememberedFailure` where an earlier call found so of this loaded model.
    """
    model = checkpoint_model(target)
    if model is None:
        return None
    mtp = layers_for(model) if model is target else load_mtp_layers(model)
    folder = checkpoint_folder(model)
    keys, _ = mtp_weight_keys(model, folder)
    under = os.path.commonprefix(keys).rpartition(".")[0] or keys[0]
    return (
        f"its checkpoint ({folder}) carries its own multi-token-prediction layers ({len(mtp.layers)}, "
        f"{len(keys)} weights under {under}), which draft for it: nothing to download"
    )


def layers_for(target: Any) -> nn.Module:
    """`target`'s MTP layers, read out of its checkpoint once per model (`load_mtp_layers`), and again
    once its checkpoint's files changed (`checkpoint_stamp`), the model moved to another dtype or
    device (`mtp_placement`), or its attention implementation or MTP layer count changed. Layers
    that do not load are not read again either: `RememberedFailure` repeats why, until one of those
    changes.

    Raises:
        ValueError: as `load_mtp_layers`.
    """
    folder, count = checkpoint_folder(target), mtp_layer_count(target)
    if folder is None or count == 0:  # refused before any weight is read
        return load_mtp_layers(target)
    # The embedding and head the layers share: a PEFT adapter put on one since wraps it in another module.
    shared = (id(target.get_input_embeddings()), id(target.get_output_embeddings()))
    basis = (
        checkpoint_stamp(folder),
        mtp_placement(target),
        target.config._attn_implementation,
        count,
        shared,
    )
    read = _READ.get(target)
    if read is None or read.basis != basis:
        try:
            read = _Read(basis, load_mtp_layers(target))
        except ValueError as err:
            _READ[target] = _Read(basis, None, str(err))
            raise
        _READ[target] = read
    if read.layers is None:
        raise RememberedFailure(
            f"{read.failure} (As an earlier call found; the checkpoint is unchanged since: "
            "hf_specdec.clear_cache() reads it again.)"
        )
    return read.layers


def check_layers_fit(mtp: MtpModel, target: Any) -> MtpModel:
    """`mtp` (given as `draft=`) if it was built for a model of `target`'s hidden and vocabulary
    sizes and sits where the target's MTP layers run (`mtp_placement`); ValueError naming the size or
    the devices that differ otherwise."""
    text = target.config.get_text_config()
    for field in ("hidden_size", "vocab_size"):
        theirs, ours = getattr(mtp.config, field), getattr(text, field)
        if theirs != ours:
            raise ValueError(
                f"draft= holds the MTP layers of a model of {field}={theirs}; this target's is {ours}: "
                "build them for it with transformers' MtpModel.from_pretrained(target), or drop draft= "
                "(method='mtp' reads the target's own out of its checkpoint)."
            )
    if getattr(mtp, "shared_head", None) is not target.get_output_embeddings():
        raise ValueError(
            "draft= holds MTP layers built for another model of the same sizes (they embed and score "
            "with that model's embedding and LM head, not this target's): build them for it with "
            "transformers' MtpModel.from_pretrained(target), or drop draft= (method='mtp' reads the "
            "target's own out of its checkpoint)."
        )
    device, _ = mtp_placement(target)
    check_placed(
        mtp.layers,
        device,
        "The MtpModel given as draft=",
        "a model's MTP layers run beside its last decoder layer, as transformers places them. Build them "
        f"there (MtpModel.from_pretrained(target, device_map={{'': {str(device)!r}}})) or move them "
        f"(draft.layers.to({str(device)!r}); not draft.to(), which moves the target's embedding and LM "
        "head with them), or drop draft= (method='mtp' reads the target's own there).",
    )
    return mtp


@register_drafter
class MtpDrafter(EagleDrafter):
    """Drafts with the target's own MTP layers, or with an MTP head trained for it (one depth).

    Depth 0 is an EAGLE head (`EagleDrafter`: its cache and per-row state, its trees, its chain
    step, which past the last depth reapplies the last one); a chain's token i + 1 comes from
    depth i, fed over the indices it has not cached yet."""

    name: ClassVar[str] = "mtp"
    options_class: ClassVar[type] = ChainTreeConfig

    def __init__(self, depths: list[nn.Module], config: ChainTreeConfig, target: PreTrainedModel) -> None:
        """`depths`: one module per MTP depth (`MtpDepth`), or a trained head.

        The layers' caches, inputs and outputs live where the layers compute (`MtpDepth.device`,
        beside the target's last decoder layer, which a device_map may put on another device than
        the one the target computes on); the target's tokens and hidden states are moved there,
        and the logits drafted from come back (`full_vocab`)."""
        text = target.config.get_text_config()
        self.target_device = execution_device(target)
        head = depths[0]
        super().__init__(
            head, config, text.vocab_size, head.device if isinstance(head, MtpDepth) else self.target_device
        )
        self.depths = depths
        self.hidden_size = text.hidden_size
        # Depth 0's cache and real indices per row are EAGLE's `kv` and `done`; per deeper depth, its
        # own. Per depth before a deeper one, per row: the hidden states it computed at real indices
        # that the next depth has not cached as real yet (what that depth reads next).
        self.deeper: list[RaggedKV] = []
        self.real: list[list[int]] = []
        self.carried: list[list[torch.Tensor]] = []

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        """The layers are read out of the target's checkpoint; or `draft=` gives them loaded already
        (transformers' `MtpModel.from_pretrained(target)`, or one built for the target), or names an
        MTP head of ours, trained for a target that ships none (`hf-specdec train-draft --method mtp`)."""
        options = options_to_config(cls.options_class, config.options)
        draft = config.draft
        if draft is None or isinstance(draft, MtpModel):
            mtp = layers_for(target) if draft is None else check_layers_fit(draft, target)
            return cls([MtpDepth(mtp, k) for k in range(len(mtp.layers))], options, target)
        if isinstance(draft, nn.Module) and not isinstance(draft, EagleHead):
            raise ValueError(
                "method='mtp' drafts with the target's own MTP layers, read out of its checkpoint: drop "
                f"draft= (or give transformers' MtpModel of them, or an MTP head of ours; got "
                f"{type(draft).__name__}). A separate draft model is method='draft_model'."
            )
        return cls([load_head(draft, target, method="mtp")], options, target)

    def compile_forwards(self, config: Any, capacity: int, widths: tuple[int, ...], batch_size: int) -> None:
        """Drafts eagerly, each depth over a dynamic cache of its own: `EagleDrafter`'s compiled
        static cache is shaped for an EAGLE head's one layer, not for a model's MTP layers."""

    def _roll_back(self) -> None:
        super()._roll_back()
        for kv, real in zip(self.deeper, self.real):
            kv.truncate(torch.tensor(real, device=self.device))

    def _catch_up(self, request: DraftRequest) -> tuple[Any, int]:
        """Depth 0 over the target's hidden states of the tokens it cached since the last request."""
        sequences = [self.arrived(request, b)[0] for b in range(len(request.row_ids))]
        features = [torch.zeros(0, self.hidden_size) if h is None else h for h in request.hidden_states]
        output, _ = self._depth_forward(0, sequences, [], features)
        return output, max(len(f) for f in features)

    def _chain(self, request: DraftRequest, max_tokens: list[int], output: Any) -> Draft:
        """Draft token i + 1 with depth i; past the last depth, the last one reapplied."""
        kvs = [self.kv, *self.deeper]
        deepest = min(len(kvs), max(max_tokens, default=0))
        if deepest < 2:  # depth 0 only: EAGLE's chain
            return super()._chain(request, max_tokens, output)
        sequences = [real_tokens(request, b) for b in range(len(max_tokens))]
        drafted: list[torch.Tensor] = []  # [B] per draft token so far
        chained = [0] * len(max_tokens)  # per row: the indices the last depth run fed past its real ones

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            nonlocal output, chained
            if i > 0:
                drafted.append(previous)
            if 0 < i < deepest:  # depth i reads depth i-1's outputs at the indices it chained
                width = output.hidden_states.shape[1]
                hidden = [output.hidden_states[b, width - n :] for b, n in enumerate(chained)]
                output, chained = self._depth_forward(i, sequences, drafted, hidden)
            elif i >= deepest:  # the last depth reads its own hidden state at the next index
                output = self._chained(kvs[deepest - 1], output, previous, active)
            return self.full_vocab(output.logits[:, -1])

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
        kv, cached = (self.kv, self.done) if k == 0 else (self.deeper[k - 1], self.real[k - 1])
        tokens, inputs = [], []
        for b, sequence in enumerate(sequences):
            start, n = cached[b], len(sequence)
            extended = torch.cat([sequence, *(d[b : b + 1] for d in drafted)])
            tokens.append(extended[start + k + 1 : n + k])
            inputs.append(hidden[b] if k == 0 else torch.cat([self.carried[k - 1][b], hidden[b]]))
        ids, valid = right_aligned(tokens, self.device)
        feats, _ = right_aligned(inputs, self.device, dtype=self.feature_dtype)
        # transformers' positions on the first forward (index t of depth k at t + k + 1); continued after.
        at = {"positions": (valid.cumsum(dim=1) - 1).clamp_min(0) + k + 1} if kv.width == 0 else {}
        output = kv.forward(ids, valid, logits_to_keep=1, features=feats, **at)
        width, chained = ids.shape[1], []
        for b, sequence in enumerate(sequences):
            start, n = cached[b], len(sequence)
            real = max(start, n - 1 - k)  # index t is real while x_{t+k+1} is a known token
            if k > 0:  # what depth k has now cached as real, depth k-1 no longer carries for it
                self.carried[k - 1][b] = self.carried[k - 1][b][real - start :]
            if k < len(self.carried):  # depth k + 1 reads these real outputs when it next runs
                first = width - (n - 1 - start)
                new = output.hidden_states[b, first : first + real - start]
                self.carried[k][b] = torch.cat([self.carried[k][b], new])
            cached[b] = real
            chained.append(n - 1 - real)
        return output, chained

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary, where the target computes: a trained head's
        draft vocabulary scattered into it; the model's own layers' shared head, cut to the
        unpadded vocabulary (`MtpModel._project_to_logits`), padded back at -inf."""
        logits = logits.to(self.target_device)
        if not isinstance(self.head, MtpDepth):
            return super().full_vocab(logits)
        missing = self.vocab_size - logits.shape[-1]
        if missing <= 0:
            return logits
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], missing), float("-inf"))], dim=-1)

    def _start_rows(self, request: DraftRequest) -> None:
        super()._start_rows(request)
        # A call drafting trees reads depth 0 only: deeper depths get no cache, nothing carried.
        deeper = [] if request.tree else self.depths[1:]
        batch = len(request.row_ids)
        self.deeper = [RaggedKV(d, DynamicCache(), batch, self.device, boolean_masks=True) for d in deeper]
        self.real = [[0] * batch for _ in deeper]
        empty = torch.zeros(0, self.hidden_size, device=self.device)
        self.carried = [[empty] * batch for _ in deeper]

    def _keep_rows(self, kept: list[int]) -> None:
        super()._keep_rows(kept)
        rows = torch.tensor(kept, device=self.device)
        for kv in self.deeper:
            kv.select_rows(rows)
        self.real = [[r[i] for i in kept] for r in self.real]
        self.carried = [[c[i] for i in kept] for c in self.carried]
