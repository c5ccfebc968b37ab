"""Medusa drafting: k heads read the target's last feature and guess k tokens at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..devices import execution_device
from ..draft import Draft, DraftRequest
from ..heads.checkpoint import load_head
from .base import Drafter, options_to_config
from .chain import chain
from .heads import HeadDrafterConfig, full_vocab_logits, head_source
from .registry import register_drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@register_drafter
class MedusaDrafter(Drafter):
    """Head i reads the feature that predicted the row's last token and guesses the i-th after it."""

    name: ClassVar[str] = "medusa"
    supports_sampling: ClassVar[bool] = True

    def __init__(self, head: Any, config: HeadDrafterConfig, vocab_size: int, device: torch.device) -> None:
        self.head = head
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.hidden_state_layers = head.feature_layers
        self.last_feature: dict[int, torch.Tensor] = {}  # per user row: the newest target feature

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        head = load_head(head_source(config, cls.name), target, method=cls.name)
        options = options_to_config(HeadDrafterConfig, config.options)
        return cls(head, options, target.config.get_text_config().vocab_size, execution_device(target))

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        batch = len(request.row_ids)
        for b, row in enumerate(request.row_ids):
            new = request.hidden_states[b]
            if new is not None and len(new):
                self.last_feature[row] = new[-1]
        known = [row in self.last_feature for row in request.row_ids]
        max_tokens = [
            min(n, self.head.config.num_heads) if ok else 0 for n, ok in zip(request.max_tokens, known)
        ]
        steps = max(max_tokens, default=0)
        if steps == 0:
            return Draft.empty(batch, self.device)
        size = self.head.config.hidden_size
        features = torch.stack(
            [self.last_feature.get(row, torch.zeros(size, device=self.device)) for row in request.row_ids]
        )
        head_logits = self.head(features, num_heads=steps)  # [B, steps, draft_vocab]

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            return full_vocab_logits(head_logits[:, i], self.head.draft_vocab, self.vocab_size)

        return chain(request, max_tokens, self.config.min_confidence, logits_at)
