"""The one decoder layer an EAGLE head runs: Llama's, written out so that training can unroll it;
the pieces other heads share with it; and the fields a fresh head's config takes from its target.

Attention takes an explicit boolean mask, so the same code serves drafting (a KV cache with
holes, see `kv.RaggedKV`) and training-time test (queries of a later draft step attending to
keys of earlier steps).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, heads, T, d] of `x` [B, T, H], rotated to their positions."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention output [B, T, H]; `mask` [B, T, S] is True where query t may see key s."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP. EAGLE-1 heads have no input norm (their input is a projection)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        input_norm: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps) if input_norm else None
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        return self.self_attn.project(normed, cos, sin)

    def finish(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x = x + attention
        return x + self.mlp(self.post_attention_layernorm(x))


def vocab_rows(weight: torch.Tensor, draft_vocab: torch.Tensor) -> torch.Tensor:
    """The rows of an LM head `weight` [V, H] for `draft_vocab`; the weight itself (no copy of a
    possibly gigabyte-sized matrix) when the draft vocabulary is the whole vocabulary in order."""
    if is_whole_vocab(draft_vocab, weight.shape[0]):
        return weight
    return weight[draft_vocab.to(weight.device)]


def is_whole_vocab(draft_vocab: torch.Tensor, vocab_size: int) -> bool:
    return len(draft_vocab) == vocab_size and bool(
        (draft_vocab == torch.arange(vocab_size, device=draft_vocab.device)).all()
    )


def target_fields(target: Any) -> dict[str, Any]:
    """What every head config records of the target it is made for (`io.check_head_matches` compares
    it): hidden and vocabulary sizes, name and layer count."""
    text = target.config.get_text_config()
    return dict(
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        target=str(getattr(target, "name_or_path", "") or ""),
        target_num_layers=text.num_hidden_layers,
    )


def _mlp_width(text: Any) -> int:
    """The width of the target's MLPs, under whichever name its config gives it (`intermediate_size`;
    GPT-2's `n_inner`, Falcon's `ffn_hidden_size`, OPT's `ffn_dim`), 4x the hidden size where it
    gives none (GPT-2's `n_inner=None`); the widest where it gives one per layer (Gemma 3n)."""
    for name in ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"):
        width = getattr(text, name, None)
        if isinstance(width, (list, tuple)):
            width = max(width, default=None)
        if width:
            return int(width)
    return 4 * text.hidden_size


def target_layer_shape(target: Any) -> dict[str, Any]:
    """`target_fields` and the shape of the target's decoder layers, which a head with attention
    layers of its own (EAGLE, block drafts) copies: head counts and widths, MLP width, norm
    epsilon, rope parameters and context length."""
    text = target.config.get_text_config()
    heads = text.num_attention_heads
    return dict(
        **target_fields(target),
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate_size=_mlp_width(text),
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_parameters=dict(getattr(text, "rope_parameters", None) or {"rope_type": "default"}),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
    )
