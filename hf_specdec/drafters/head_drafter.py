"""What the head drafters (EAGLE and MTP, Medusa, DFlash) share: their settings, and the
`HeadDrafter` base that finds their head, builds them and scatters a head's draft-vocabulary logits
into the full vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..config import COMPILED, read_when
from ..core.devices import execution_device
from ..core.draft import DraftRequest
from ..heads.checkpoint import load_head
from ..heads.layers import is_whole_vocab
from .base import Drafter, options_to_config
from .chain import arrived
from .tree import ChainTreeConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass
class HeadDrafterConfig(ChainTreeConfig):
    """Settings of the `eagle` drafter: `ChainTreeConfig`'s (`min_confidence`, `tree_top_k`) and

    Args:
        compile_with_target: where the target decodes on a compiled static cache
            (`compile_config`), compile the head's per-token forwards alike
            (`Drafter.compile_forwards`); False keeps them eager. An eager target does not read it.
    """

    compile_with_target: bool = read_when(COMPILED, True)


class HeadDrafter(Drafter):
    """A drafter running a trained head (`SpeculativeConfig.draft`) on the target's hidden states of
    the layers the head was trained on; a subclass names its method and drafts."""

    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True
    takes_draft_tokenizer: ClassVar[bool] = False  # a head reads the target's tokens
    options_class: ClassVar[type] = HeadDrafterConfig

    def __init__(self, head: Any, config: HeadDrafterConfig, vocab_size: int, device: torch.device) -> None:
        self.head = head
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.hidden_state_layers = head.feature_layers
        self.done: list[int] = []  # per row: tokens whose hidden states the drafter has taken in
        self._whole_vocab: bool | None = None  # whether the head scores the whole vocabulary, in order

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        if config.draft is None:
            raise ValueError(
                f"method={cls.name!r} needs a trained head: "
                f"SpeculativeConfig(method={cls.name!r}, draft='folder/or/repo'). Train one with "
                f"`hf-specdec train-draft --target <model> --method {cls.name} --out <folder>`."
            )
        head = load_head(config.draft, target, method=cls.name)
        options = options_to_config(cls.options_class, config.options)
        return cls(head, options, target.config.get_text_config().vocab_size, execution_device(target))

    def arrived(self, request: DraftRequest, b: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        """`chain.arrived` for row b, from where this drafter's state of it stands."""
        return arrived(request, b, self.done[b], self.name)

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self._whole_vocab is None:  # read once: a block draft asks per position, every step
            self._whole_vocab = is_whole_vocab(self.head.draft_vocab, self.vocab_size)
        return full_vocab(logits, self.head.draft_vocab, self.vocab_size, whole=self._whole_vocab)


def full_vocab(
    logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, whole: bool | None = None
) -> torch.Tensor:
    """A head's logits [B, len(draft_vocab)] scattered into [B, vocab_size]; tokens outside its draft
    vocabulary get -inf, so the draft never proposes them and its sampling distribution gives them
    probability 0. `whole`: whether the draft vocabulary is the whole vocabulary in order, where the
    caller knows (None: read here)."""
    if whole is None:
        whole = is_whole_vocab(draft_vocab, vocab_size)
    if logits.shape[-1] == vocab_size and whole:
        return logits
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, draft_vocab.to(logits.device), logits)
