"""A tiny Gemma 4 text target with an assistant in the layout of Google's `*-assistant` checkpoints
(transformers' `Gemma4AssistantForCausalLM`: its layers all read the target's shared KV).

Random weights accept next to nothing, so `agreeing` builds the pair to agree part of the time: the
target's MLPs write nothing into the residual stream and its attention only `context` of its
(normalised) output: a bigram model of the embedding, bent by the context; the assistant passes the
token embedding it reads through its layers (its MLP outputs zeroed, its attention's scaled by
`own`) to an LM head that is the target's.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

from .mtp import VOCAB, prompts  # the same tiny vocabulary and left-padded prompts

__all__ = ["VOCAB", "pair", "prompts"]


def text_config(layers: int, layer_types: list[str], window: int, **overrides) -> Gemma4TextConfig:
    return Gemma4TextConfig(**{
        **dict(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
            sliding_window=window, layer_types=layer_types, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0, initializer_range=0.4, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=None,
        ),
        **overrides,
    })  # fmt: skip


def pair(
    seed: int = 0,
    window: int = 4,
    context: float = 0.5,
    own: float = 0.3,
    attention: str = "sdpa",
    ordered: bool = False,
    **overrides,
):
    """(target, assistant): a 4-layer target, its last two layers reusing the first two's KV, and a
    2-layer assistant (sliding, then full attention) reading the target's. `ordered`: the assistant
    scores only the tokens of its best centroids, as E2B's and E4B's do (`use_ordered_embeddings`:
    4 centroids of 4 tokens in a random order, the best 2 scored)."""
    kinds = ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    target_config = text_config(
        4, kinds * 2, window, num_kv_shared_layers=2, tie_word_embeddings=False, **overrides
    )
    target = Gemma4ForCausalLM._from_config(target_config, attn_implementation=attention).eval()
    centroids = dict(use_ordered_embeddings=True, num_centroids=4, centroid_intermediate_top_k=2)
    assistant_config = Gemma4AssistantConfig(
        text_config=text_config(2, kinds, window, num_kv_shared_layers=2, **overrides),
        backbone_hidden_size=32,
        **(centroids if ordered else {}),
    )
    torch.manual_seed(seed + 1)
    assistant = Gemma4AssistantForCausalLM._from_config(
        assistant_config, attn_implementation=attention
    ).eval()
    if ordered:
        with torch.no_grad():
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(target_config.vocab_size))
    agreeing(target, assistant, context, own)
    return target, assistant


@torch.no_grad()
def agreeing(target, assistant, context: float, own: float) -> None:
    for name, p in target.named_parameters():  # Gemma normalises each block's output before adding it
        if name.endswith("post_feedforward_layernorm.weight"):
            p.zero_()
        elif name.endswith("post_attention_layernorm.weight"):
            p.mul_(context)
    hidden = target.config.hidden_size
    assistant.pre_projection.weight.zero_()
    assistant.pre_projection.weight[:, :hidden] = torch.eye(hidden)  # [embedding, hidden] -> the embedding
    for name, p in assistant.model.named_parameters():
        if name.endswith("post_feedforward_layernorm.weight"):
            p.zero_()
        elif name.endswith("post_attention_layernorm.weight"):
            p.mul_(own)
    assistant.lm_head.weight.copy_(target.lm_head.weight)
    assistant.model.norm.load_state_dict(target.model.norm.state_dict())
