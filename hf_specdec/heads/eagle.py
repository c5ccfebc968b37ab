"""EAGLE: a one-layer head that predicts the target's next feature from its last one.

At position t the head reads the target's feature f_t (its last hidden state, the one its LM head
turns into logits) and the embedding of token x_{t+1}, and predicts f_{t+1}; the target's own LM
head turns that into a guess for x_{t+2}. Drafting chains: the predicted feature stands in for
the real one at the next position. Only a frequency-ranked subset of the vocabulary is scored
while drafting (the target still verifies with all of it, so the output stays lossless).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, StaticCache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from ..core.devices import module_weight
from ..core.fields import check_fields
from ..core.masks import allowed_keys
from .layers import DecoderLayer, RMSNorm, target_layer_shape, vocab_rows


@dataclass
class EagleHeadConfig:
    """Shape of an EAGLE head and the target it was trained for (saved as `head_config.json`)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4}
    )
    target: str = ""  # the target's name or path, for messages
    target_num_layers: int = 0
    draft_vocab_size: int = 0  # 0: the whole vocabulary
    fc_bias: bool = False
    input_norm: bool = False  # EAGLE-1's layer has no input norm: its input is the fc projection
    attention_bias: bool = False  # biases on q/k/v (the reference's `qkv_bias`, as in Qwen heads)
    max_position_embeddings: int = 0  # the rotary's context length (llama3/dynamic rope); 0: the target's
    # Our heads RMS-normalise the token embedding and the feature before `fc`: a target's
    # embeddings can be far smaller than its features, and the token is what the head most needs.
    input_norms: bool = False
    # DeepSeek-V3's MTP design (`method="mtp"` heads): an RMSNorm on the layer's output (its
    # `shared_head.norm`) before the target's LM head; the normalised output is what the chain reads.
    output_norm: bool = False
    variant: str = "eagle"  # "eagle" (EAGLE-1/2 and ours: `EagleHead`) or "eagle3" (`Eagle3Head`)
    feature_layers: list[int] = field(default_factory=list)  # EAGLE-3: the target layers it reads
    method: str = "eagle"

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        counts = ("target_num_layers", "draft_vocab_size", "max_position_embeddings")  # 0: unknown, or all
        ranges = {**dict.fromkeys(sizes, (1, None)), **dict.fromkeys(counts, (0, None))}
        check_fields(self, ranges={**ranges, "intermediate_size": (1, None), "rms_norm_eps": (0, 1)})
        check_attention_shape(self, "An EAGLE head")

    @classmethod
    def for_target(cls, target: Any, draft_vocab_size: int = 0, **overrides: Any) -> EagleHeadConfig:
        return cls(**target_layer_shape(target), draft_vocab_size=draft_vocab_size, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_attention_shape(config: Any, owner: str) -> None:
    """Refuse head counts that do not group (`num_attention_heads` a multiple of `num_key_value_heads`)
    and a rope type transformers does not know; `owner` names the config in the message."""
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"{owner}'s num_attention_heads ({config.num_attention_heads}) must be a multiple of its "
            f"num_key_value_heads ({config.num_key_value_heads})."
        )
    rope_types = ("default", *sorted(ROPE_INIT_FUNCTIONS))
    if config.rope_parameters.get("rope_type", "default") not in rope_types:
        raise ValueError(
            f"{owner}'s rope_parameters name rope_type {config.rope_parameters.get('rope_type')!r}; "
            f"transformers knows {', '.join(map(repr, rope_types))}."
        )


def rotary_embedding(config: Any) -> LlamaRotaryEmbedding:
    """The head's rotary embedding (an `EagleHeadConfig` or `BlockDraftConfig`): the target's rope
    parameters and context length."""
    extra = (
        {"max_position_embeddings": config.max_position_embeddings} if config.max_position_embeddings else {}
    )
    return LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            rope_parameters=dict(config.rope_parameters),
            **extra,
        )
    )


def static_cache(config: EagleHeadConfig, max_cache_len: int) -> StaticCache:
    """A StaticCache for a head's one attention layer (its shape is taken at the first write)."""
    layer = LlamaConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
    )
    return StaticCache(config=layer, max_cache_len=max_cache_len)


@dataclass
class HeadOutput(ModelOutput):
    logits: torch.Tensor | None = None  # [B, T', draft_vocab] over `EagleHead.draft_vocab`
    hidden_states: torch.Tensor | None = None  # [B, T, H] predicted next features


class EagleHead(nn.Module):
    """The trainable part of an EAGLE draft; the token embedding and LM head are the target's."""

    def __init__(self, config: EagleHeadConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.embed_norm = RMSNorm(hidden, config.rms_norm_eps) if config.input_norms else None
        self.feature_norm = RMSNorm(hidden, config.rms_norm_eps) if config.input_norms else None
        self.layer = DecoderLayer(
            hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            input_norm=config.input_norm,
            bias=config.attention_bias,
        )
        self.output_norm = RMSNorm(hidden, config.rms_norm_eps) if config.output_norm else None
        self.rotary = rotary_embedding(config)
        draft_vocab = torch.arange(config.draft_vocab_size or config.vocab_size)
        self.register_buffer("draft_vocab", draft_vocab)  # draft index -> token id, saved with the head
        # The target's embedding and LM head stay the target's: kept outside the module tree so
        # they are neither trained nor saved with the head.
        self._target_parts = (embed_tokens, lm_head)
        self._lm_weight: torch.Tensor | None = None

    # Target hidden-state layers the head reads (indices into `output_hidden_states`); EAGLE-1
    # and our heads read the last, post-norm one. EAGLE-3 heads read three and project them.
    feature_layers: tuple[int, ...] = (-1,)

    def project_features(self, raw: torch.Tensor) -> torch.Tensor:
        """Target hidden states [.., len(feature_layers) * H] -> the head's feature input [.., H]."""
        return raw

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        self.draft_vocab = token_ids.to(self.draft_vocab.device, torch.long)
        self.config.draft_vocab_size = len(token_ids)
        self._lm_weight = None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._target_parts[0](token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [.., draft_vocab] of predicted features: the target's LM head, subset rows only."""
        if self._lm_weight is None or self._lm_weight.device != hidden.device:
            weight = module_weight(self._target_parts[1])  # also when device_map offloaded it
            self._lm_weight = vocab_rows(weight, self.draft_vocab).to(hidden.device)
        return hidden.to(self._lm_weight.dtype) @ self._lm_weight.T

    def inputs(self, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The layer's input at each position: features f_t with the embedding of x_{t+1}."""
        embeds = self.embed(token_ids).to(self.fc.weight.dtype)
        features = features.to(self.fc.weight.dtype)
        if self.embed_norm is not None:
            embeds, features = self.embed_norm(embeds), self.feature_norm(features)
        return self.fc(torch.cat([embeds, features], dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] x_{t+1}
        features: torch.Tensor,  # [B, T, H] f_t (real, or the head's own earlier prediction)
        attention_mask: torch.Tensor | None = None,  # [B, past + T], 1 on real positions; or see causal_mask
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **_: Any,
    ) -> HeadOutput:
        x = self.inputs(input_ids, features)
        queries, position_ids = query_columns(x.shape[1], cache, use_cache, position_ids, x.device)
        cos, sin = self.rotary(x, position_ids)
        q, k, v = self.layer.qkv(x, cos, sin)
        if cache is not None and use_cache:
            k, v = cache.update(k, v, 0)
        mask = causal_mask(queries, k.shape[2], attention_mask)
        hidden = self.output(x, self.layer.self_attn.attend(q, k, v, mask))
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return HeadOutput(logits=self.logits(kept), hidden_states=hidden)

    def unrolled(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: predicted features [B, T, H] of `steps` chained draft steps.

        Step 1 reads the real f_t at every position t. Step s reads, at position t, step s-1's
        prediction of f_t, and attends as drafting would: to step-1 keys up to t-s+1 and to
        step r's key at t-s+r (r = 2..s), the draft positions chained so far.
        """
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch, -1)
        x = self.inputs(input_ids, features)
        cos, sin = self.rotary(x, positions)
        keys, values, predicted = [], [], []
        t = torch.arange(length, device=input_ids.device)
        for step in range(1, steps + 1):
            if step > 1:  # position t reads the previous step's prediction of f_t, made at t - 1
                shifted = torch.cat([predicted[-1][:, :1], predicted[-1][:, :-1]], dim=1)
                x = self.inputs(input_ids, shifted)
            q, k, v = self.layer.qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            blocks = [t[None, :] <= (t[:, None] - step + 1)]  # step-1 keys
            for r in range(2, step + 1):
                blocks.append(t[None, :] == (t[:, None] - step + r))
            mask = torch.cat(blocks, dim=1)  # every query sees its own key (the last block's diagonal)
            attention = self.layer.self_attn.attend(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask[None].expand(batch, -1, -1)
            )
            predicted.append(self.output(x, attention))
        return predicted

    def output(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The layer's output (the predicted feature), normalised where the head has an output norm."""
        hidden = self.layer.finish(x, attention)
        return hidden if self.output_norm is None else self.output_norm(hidden)


def query_columns(
    length: int, cache: Any, use_cache: bool, position_ids: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache columns `length` queries are written to, and their positions (`position_ids` if given).

    Read before `cache.update`: a dynamic cache writes after its last column, a static one at its
    write position (which `StaticKV` moves back on a rollback, so its columns after the queries
    hold stale keys the mask must hide: queries are not simply the last columns there)."""
    past = cache.get_seq_length() if cache is not None else 0  # a 0-dim tensor for a static cache
    offsets = torch.arange(length, device=device)
    queries = offsets + past if use_cache else offsets  # a new tensor: `update` moves `past` in place
    return queries, (offsets + past)[None] if position_ids is None else position_ids


def causal_mask(queries: torch.Tensor, total: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, len(queries), total]: the query at column `queries[t]` sees earlier real keys and itself.

    A boolean `attention_mask` [B, 1, length, total] is a mask built whole (`RaggedKV`'s, for a
    tree draft: each node sees the cache, its ancestors and itself) and is used as it is."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask[:, 0]
    if attention_mask is not None:
        return allowed_keys(attention_mask[:, :total].bool(), queries)
    return (torch.arange(total, device=queries.device)[None, :] <= queries[:, None])[None]
