"""EAGLE-3: a one-layer head that reads three of the target's layers and scores its own vocabulary.

Differences from EAGLE-1 (`heads/eagle.py`), after the reference (github.com/SafeAILab/EAGLE,
`eagle/model/cnets.py`, EAGLE-3 version):

- its feature is `fc` of the target's hidden states at three depths, concatenated: the inputs of
  decoder layers 2, L // 2 and L - 3 (HF `output_hidden_states` indices 2, L // 2, L - 3);
- attention reads [input_layernorm(embedding), hidden_norm(feature)] side by side (2H wide);
  the residual stream starts from the feature itself;
- its own final norm and LM head score a reduced draft vocabulary; draft index i is token
  i + d2t[i] of the target;
- chaining feeds the layer's pre-norm output back as the next position's feature (no `fc`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .eagle import EagleHeadConfig, HeadOutput, causal_mask, query_columns, rotary_embedding
from .layers import MLP, Attention, RMSNorm


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's layers for an L-layer target, as `output_hidden_states` indices (ascending:
    the reference gathers them in layer order)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


class Eagle3Layer(nn.Module):
    """The reference's `midlayer`: a Llama layer whose attention reads [embedding, feature]."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = RMSNorm(hidden, eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(
            hidden, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        for name in ("q_proj", "k_proj", "v_proj"):  # they read the 2H-wide concatenation
            width = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * hidden, width, bias=False))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config.intermediate_size)

    def qkv(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)  # [B, T, 2H]
        return self.self_attn.project(x, cos, sin)

    def finish(self, features: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        x = features + attention
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """Drop-in for `EagleHead` in the EAGLE drafter; weights named as in the reference checkpoints.

    Its config has `variant="eagle3"` and names the target layers it reads (`feature_layers`).
    """

    def __init__(self, config: EagleHeadConfig, embed_tokens: nn.Module) -> None:
        super().__init__()
        if len(config.feature_layers) != 3:
            raise ValueError(
                f"An EAGLE-3 head reads three target layers; its config names {config.feature_layers}."
            )
        self.config = config
        self.feature_layers = tuple(config.feature_layers)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        self.rotary = rotary_embedding(config)
        # draft index -> target token id (the reference's i + d2t[i]), saved with the head
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size or config.vocab_size))
        self._target_parts = (embed_tokens,)  # the target's embedding: neither trained nor saved

    def project_features(self, raw: torch.Tensor) -> torch.Tensor:
        """Target hidden states [.., 3H] (the `feature_layers`, concatenated) -> the feature [.., H]."""
        return self.fc(raw.to(self.fc.weight.dtype))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._target_parts[0](token_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] x_{t+1}
        features: torch.Tensor,  # [B, T, H] projected target features, or the head's own outputs
        attention_mask: torch.Tensor | None = None,  # [B, past + T], 1 on real positions
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> HeadOutput:
        dtype = self.fc.weight.dtype
        embeds = self.embed(input_ids).to(dtype)
        features = features.to(dtype)
        length, device = features.shape[1], features.device
        queries, position_ids = query_columns(length, cache, use_cache, position_ids, device)
        cos, sin = self.rotary(features, position_ids)
        q, k, v = self.midlayer.qkv(embeds, features, cos, sin)
        if cache is not None and use_cache:
            k, v = cache.update(k, v, 0)
        mask = causal_mask(queries, k.shape[2], attention_mask)
        hidden = self.midlayer.finish(features, self.midlayer.self_attn.attend(q, k, v, mask))
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return HeadOutput(logits=self.lm_head(self.norm(kept)), hidden_states=hidden)
