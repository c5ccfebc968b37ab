"""Medusa: k small heads on the target's last hidden state, head i guessing the token i+1 ahead.

All k guesses come from one feature, so a draft costs k tiny MLPs and no sequential model
calls; the price is that head i does not see the guesses before it. Our heads score with the
target's own LM head over a frequency-ranked vocabulary subset; published Medusa checkpoints
carry one full LM head per Medusa head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.devices import module_weight
from ..core.fields import check_fields
from .layers import is_whole_vocab, target_fields, vocab_rows


@dataclass
class MedusaHeadConfig:
    """Shape of a Medusa head set and the target it was trained for (saved as `head_config.json`)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    target: str = ""
    target_num_layers: int = 0
    draft_vocab_size: int = 0  # 0: the whole vocabulary
    own_lm_heads: bool = False  # published Medusa: each head has its own full LM head
    method: str = "medusa"

    def __post_init__(self) -> None:
        check_fields(
            self,
            ranges={
                **dict.fromkeys(("hidden_size", "vocab_size", "num_heads"), (1, None)),
                **dict.fromkeys(("num_layers", "target_num_layers", "draft_vocab_size"), (0, None)),
            },
        )

    @classmethod
    def for_target(cls, target: Any, draft_vocab_size: int = 0, **overrides: Any) -> MedusaHeadConfig:
        return cls(**target_fields(target), draft_vocab_size=draft_vocab_size, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head i begins as the target's LM head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    feature_layers: tuple[int, ...] = (-1,)

    def __init__(self, config: MedusaHeadConfig, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )
            if config.own_lm_heads
            else None
        )
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size or config.vocab_size))
        self._target_lm_head = (lm_head,)  # not trained, not saved
        self._lm_weight: torch.Tensor | None = None

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        self.draft_vocab = token_ids.to(self.draft_vocab.device, torch.long)
        self.config.draft_vocab_size = len(token_ids)
        self._lm_weight = None

    def forward(self, features: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [.., num_heads, draft_vocab] of the tokens 1..num_heads after the next one."""
        count = self.config.num_heads if num_heads is None else num_heads
        outputs = []
        for i in range(count):
            hidden = self.blocks[i](features.to(self._dtype()))
            if self.lm_heads is not None:
                logits = self.lm_heads[i](hidden)
                outputs.append(logits if self._whole_vocab() else logits[..., self.draft_vocab])
            else:
                outputs.append(hidden @ self._weight(hidden).T)
        return torch.stack(outputs, dim=-2)

    def _whole_vocab(self) -> bool:
        return is_whole_vocab(self.draft_vocab, self.config.vocab_size)

    def _dtype(self) -> torch.dtype:
        if self.config.num_layers:
            return self.blocks[0][0].linear.weight.dtype
        return self._target_lm_head[0].weight.dtype

    def _weight(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self._lm_weight
        # Kept per device and dtype: the head can be moved or cast (`.to`) after a first use.
        if kept is None or kept.device != hidden.device or kept.dtype != hidden.dtype:
            weight = module_weight(self._target_lm_head[0])  # also when device_map offloaded it
            self._lm_weight = vocab_rows(weight, self.draft_vocab).to(hidden.device, hidden.dtype)
        return self._lm_weight
