"""Tiny random models of transformers' architectures, built from their own configs."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_SPECIAL = {
    "gpt2": dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
    ),
    "opt": dict(_COMMON, ffn_dim=128, word_embed_proj_dim=64),
    "falcon": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bos_token_id=1
    ),
    "gemma": dict(_COMMON, head_dim=16),
}
FULL_ATTENTION = [
    "llama", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "cohere", "stablelm", "gpt2", "opt",
    "gpt_neox", "falcon", "mixtral", "qwen3_moe", "phi", "smollm3", "glm",
]  # fmt: skip
WINDOW = 16
SLIDING_WINDOW = {
    "mistral": dict(_COMMON, sliding_window=WINDOW),
    "gemma2": dict(_COMMON, head_dim=16, sliding_window=WINDOW),
    "gemma3_text": dict(_COMMON, head_dim=16, sliding_window=WINDOW),
    "starcoder2": dict(_COMMON, sliding_window=WINDOW),
    "exaone4": dict(_COMMON, sliding_window=WINDOW),
}


# Models whose cache keeps a recurrent state per row (linear attention, state-space layers) beside
# their attention layers, if any: each config with at least one full-attention layer where the
# architecture has both.
RECURRENT = {
    "qwen3_next": dict(_COMMON, num_hidden_layers=4),  # gated delta-net layers, then full attention
    "falcon_h1": dict(_COMMON),  # a Mamba-2 mixer and attention in every layer
    "mamba": dict(_COMMON),  # state-space layers only
    "lfm2": dict(_COMMON, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2),
}


def tiny(name: str, seed: int, **overrides) -> torch.nn.Module:
    kwargs = SLIDING_WINDOW.get(name) or RECURRENT.get(name) or _SPECIAL.get(name) or _COMMON
    config = AutoConfig.for_model(name, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
