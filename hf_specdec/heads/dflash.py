"""DFlash and DSpark: block drafts that fill a whole block of masked positions in one forward.

A few transformer layers read the target's hidden states at `target_layer_ids` (concatenated, then
projected by `fc` and normalised: the context) and a block [anchor, mask, ..., mask] embedded with
the target's own embedding; the anchor is the row's newest token, the one the target has not cached
yet. Each layer's queries come from the block; its keys and values from the context (the same
projected context in every layer, through that layer's own k/v projections and k-norm) followed by
the block, which attends to all of itself: no causal mask inside a block. The target's LM head turns
the block's outputs into one distribution per position, all from one forward (Chen et al. 2026,
"DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036).

Which outputs are drafts depends on the layout (`drafts_from_anchor`):
- DFlash (z-lab) and transformers' MuseGlimmer assistant: output i >= 1 predicts the token at the
  block's own position i, so a block of `block_size` gives `block_size - 1` drafts;
- DSpark (DeepSpec): output i predicts the token after position i, `block_size` drafts.

DSpark (arXiv 2607.05147) adds two small heads: a low-rank Markov head, a bias on position i's logits
from the token drafted just before it (so a block is sampled left to right, each token conditioned
on the previous one), and a confidence head, its estimate that position i is accepted given the
positions before it were (a logistic regression on the block's output and the previous token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from ..core.devices import module_weight
from ..core.fields import check_fields
from .eagle import check_attention_shape, rotary_embedding
from .layers import MLP, RMSNorm, is_whole_vocab, target_layer_shape, vocab_rows

MARKOV_HEADS = ("vanilla", "gated")  # DeepSpec's `markov_head_type`s we run (its "rnn" is not)


@dataclass
class BlockDraftConfig:
    """Shape of a block draft, how it reads the target, and which target it was trained for.

    `target_layer_ids` name decoder layers whose outputs the draft reads (0-based; -1: the embedding
    output), as every published layout does: `output_hidden_states` index i + 1.
    """

    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4}
    )
    max_position_embeddings: int = 0  # the rotary's context length (llama3/yarn rope); 0: the target's
    attention_bias: bool = False
    # Per layer, the farthest position distance |query - key| attended to (0: no limit); empty: none.
    layer_windows: list[int] = field(default_factory=list)
    # Per layer, whether a block position sees only the block positions up to itself (z-lab's
    # sliding-window layers); empty: no layer is causal.
    causal_layers: list[bool] = field(default_factory=list)
    drafts_from_anchor: bool = False  # DSpark: output i predicts the token after position i
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # 0: none
    markov_rank: int = 0  # DSpark's Markov head; 0: none
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False  # the confidence head also reads the previous token's code
    draft_vocab_size: int = 0  # 0: the whole vocabulary
    target: str = ""  # the target's name or path, for messages and selection
    target_num_layers: int = 0
    layout: str = "hf-specdec"  # where the weights came from, for messages
    method: str = "dflash"

    def __post_init__(self) -> None:
        sizes = (
            "hidden_size",
            "vocab_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
        counts = ("max_position_embeddings", "markov_rank", "draft_vocab_size", "target_num_layers")
        check_fields(
            self,
            ranges={
                **dict.fromkeys(sizes, (1, None)),
                **dict.fromkeys(counts, (0, None)),
                "block_size": (2, None),
                "rms_norm_eps": (0, 1),
                "final_logit_softcapping": (0, None),
            },
            choices={"markov_head_type": MARKOV_HEADS},
        )
        check_attention_shape(self, "A block draft")
        if not self.target_layer_ids or min(self.target_layer_ids) < -1:
            raise ValueError(
                f"A block draft reads one or more target layers (0-based, -1 for the embeddings); its "
                f"target_layer_ids are {self.target_layer_ids}."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"The block draft's mask_token_id {self.mask_token_id} is outside its vocabulary of "
                f"{self.vocab_size} tokens."
            )
        for name in ("layer_windows", "causal_layers"):
            given = getattr(self, name)
            if given and len(given) != self.num_hidden_layers:
                raise ValueError(
                    f"A block draft's {name} names {len(given)} layers; it has {self.num_hidden_layers}."
                )
        if self.confidence_with_markov and not (self.confidence_head and self.markov_rank):
            raise ValueError("confidence_with_markov needs both a confidence head and a Markov head.")

    @classmethod
    def for_target(
        cls,
        target: Any,
        target_layer_ids: list[int],
        *,
        num_hidden_layers: int = 1,
        block_size: int = 8,
        mask_token_id: int | None = None,
        **overrides: Any,
    ) -> BlockDraftConfig:
        """A fresh draft shaped like the target's layers (what `hf-specdec train-draft` trains).

        The mask token defaults to the target's pad token (else its last id): the block's masked
        positions embed it, and training teaches the draft what it stands for."""
        text = target.config.get_text_config()
        if mask_token_id is None:
            pad = getattr(text, "pad_token_id", None)
            usable = isinstance(pad, int) and 0 <= pad < text.vocab_size
            mask_token_id = pad if usable else text.vocab_size - 1
        return cls(
            **target_layer_shape(target),
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            **overrides,
        )

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's `output_hidden_states` indices the draft reads (0: the embeddings)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.drafts_from_anchor else self.block_size - 1

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def causal(self, layer: int) -> bool:
        return bool(self.causal_layers[layer]) if self.causal_layers else False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BlockAttention(nn.Module):
    """Queries from the block, keys and values from the context and the block (names as published)."""

    def __init__(self, config: BlockDraftConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(*x.shape[:2], heads, self.head_dim)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normalised, rotated) and values [B, kv_heads, T, d] of `x` [B, T, H]."""
        k = self.k_norm(self._split(self.k_proj(x), self.kv_heads)).transpose(1, 2)
        v = self._split(self.v_proj(x), self.kv_heads).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] the block, normalised
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,  # [B, kv_heads, K, d] the context's keys, then the block's are appended
        past_v: torch.Tensor,
        mask: torch.Tensor,  # [B, Q, K + Q] True where a query sees a key
    ) -> torch.Tensor:
        q = self.q_norm(self._split(self.q_proj(x), self.heads)).transpose(1, 2)
        q = _rotate(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v.to(q.dtype), attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `x` [B, heads, T, d] (transformers' `apply_rotary_pos_emb`, for
    one tensor: queries and keys are rotated apart here)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class BlockLayer(nn.Module):
    def __init__(self, config: BlockDraftConfig) -> None:
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, past_k, past_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's Markov head: logits bias W2 · W1[previous token], gated by the position's output when
    `gated` (DeepSpec's `VanillaMarkov` / `GatedMarkovHead`, names as published)."""

    def __init__(self, config: BlockDraftConfig) -> None:
        super().__init__()
        rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)
        gated = config.markov_head_type == "gated"
        self.gate_proj = nn.Linear(config.hidden_size + rank, rank) if gated else None

    def codes(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(previous)

    def bias(
        self, previous: torch.Tensor, hidden: torch.Tensor, draft_vocab: torch.Tensor | None
    ) -> torch.Tensor:
        """The bias [.., draft_vocab] on a position's logits from the token before it, [..];
        `draft_vocab` None: the whole vocabulary."""
        code = self.codes(previous)
        if self.gate_proj is not None:
            code = code * torch.sigmoid(self.gate_proj(torch.cat([hidden.to(code.dtype), code], dim=-1)))
        weight = self.markov_w2.weight
        return code @ (weight if draft_vocab is None else weight[draft_vocab.to(weight.device)]).T


class ConfidenceHead(nn.Module):
    """DSpark's confidence head (DeepSpec's `AcceptRatePredictor`): a logit per position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


class BlockDraft(nn.Module):
    """The trainable part of a DFlash / DSpark draft; the embedding and LM head are the target's."""

    def __init__(self, config: BlockDraftConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = rotary_embedding(config)
        self.markov_head = MarkovHead(config) if config.markov_rank else None
        width = hidden + (config.markov_rank if config.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if config.confidence_head else None
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size or config.vocab_size))
        # The target's embedding and LM head stay the target's: outside the module tree, so they
        # are neither trained nor saved with the draft.
        self._target_parts = (embed_tokens, lm_head)
        self._lm_weight: torch.Tensor | None = None
        self._whole_vocab: bool | None = None  # read once: asking the device is a sync, per position

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        self.draft_vocab = token_ids.to(self.draft_vocab.device, torch.long)
        self.config.draft_vocab_size = len(token_ids)
        self._lm_weight = self._whole_vocab = None

    # --- the pieces drafting and training share ---------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target hidden states [B, T, layers * H] -> the context every layer reads [B, T, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_keys(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values [B, kv_heads, T, d] of the context at `positions` [B, T]."""
        ctx = self.context(features)
        cos, sin = self.rotary(ctx, positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def embed_block(self, anchors: torch.Tensor) -> torch.Tensor:
        """[anchor, mask, ..., mask] embedded, [B, block_size, H], for anchors [B]: the target's raw
        embedding rows (no embedding scale of its own, as the reference reads them) times the
        draft's `input_embedding_scale`."""
        ids = anchors.new_full((anchors.shape[0], self.config.block_size), self.config.mask_token_id)
        ids[:, 0] = anchors
        weight = module_weight(self._target_parts[0])
        embeds = F.embedding(ids.to(weight.device), weight).to(self.fc.weight.dtype)
        scale = self.config.input_embedding_scale
        return embeds * scale if scale != 1 else embeds

    def run_block(
        self,
        x: torch.Tensor,  # [B, Q, H] block embeddings
        positions: torch.Tensor,  # [B, Q]
        past: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, keys and values [B, kv, K, d]
        masks: dict[tuple[int, bool], torch.Tensor],  # (window, causal) -> [B, Q, K + Q]
    ) -> torch.Tensor:
        """The layers over the block; its outputs [B, Q, H], before the final norm."""
        cos, sin = self.rotary(x, positions)
        for i, (layer, (k, v)) in enumerate(zip(self.layers, past)):
            mask = masks[(self.config.window(i), self.config.causal(i))]
            x = layer(x, cos, sin, k.to(x.dtype), v, mask)
        return self.norm(x)

    def drafting_outputs(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block outputs that predict drafts: [B, drafts_per_block, H]."""
        return hidden if self.config.drafts_from_anchor else hidden[:, 1:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [.., draft_vocab] of block outputs: the target's LM head (its draft-vocabulary rows),
        times `output_multiplier`, soft-capped where the layout says so."""
        if self._lm_weight is None or self._lm_weight.device != hidden.device:
            weight = module_weight(self._target_parts[1])  # also when device_map offloaded it
            self._lm_weight = vocab_rows(weight, self.draft_vocab).to(hidden.device)
        logits = hidden.to(self._lm_weight.dtype) @ self._lm_weight.T
        if self.config.output_multiplier != 1:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def markov_bias(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """DSpark's bias [.., draft_vocab] on a position's logits from the token before it; None
        without a Markov head."""
        if self.markov_head is None:
            return None
        if self._whole_vocab is None:
            self._whole_vocab = is_whole_vocab(self.draft_vocab, self.config.vocab_size)
        rows = None if self._whole_vocab else self.draft_vocab
        return self.markov_head.bias(previous, hidden, rows).to(hidden.dtype)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """DSpark's estimate [..] that each position is accepted given the ones before it were, from
        its output and the token before it; None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_with_markov:
            features = torch.cat([hidden, self.markov_head.codes(previous).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(self.confidence_head(features).float())


def attention_masks(
    config: BlockDraftConfig,
    query_positions: torch.Tensor,  # [B, Q]
    key_positions: torch.Tensor,  # [B, K + Q] the context's, then the block's own
    key_valid: torch.Tensor,  # [B, K + Q]
    block_start: int,  # keys from here on are the block's
) -> dict[tuple[int, bool], torch.Tensor]:
    """Each distinct (window, causal) of the draft's layers -> its mask [B, Q, K + Q]: a query sees
    every real context key (the context precedes the block), the whole block, or with a causal
    layer the block up to itself, and with a window only keys within it. Not `core.masks`' rules:
    its keys are compared by position, not cache column, and a block sees all of itself."""
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    base = key_valid[:, None, :].expand(-1, query_positions.shape[1], -1)
    in_block = torch.zeros_like(key_valid)
    in_block[:, block_start:] = True
    masks = {}
    for i in range(config.num_hidden_layers):
        kind = (config.window(i), config.causal(i))
        if kind in masks:
            continue
        mask = base
        if kind[1]:
            mask = mask & (~in_block[:, None, :] | (k <= q))
        if kind[0]:
            mask = mask & ((q - k).abs() <= kind[0])
        masks[kind] = mask
    return masks
