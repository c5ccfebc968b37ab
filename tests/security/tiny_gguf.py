"""A tiny random Llama written as a GGUF file, with a byte-level BPE tokenizer inside: what
`demo_model_path()` builds the demo model from (`HF_SPECDEC_DEMO_GGUF`), at test size, so that the
real build (transformers' GGUF loader, save, stamp, manifest) runs in seconds."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (pad, bos, eos)


def write_tiny_llama_gguf(path: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """Write a 2-layer Llama (fp32 weights) with 261 tokens: the specials, the 256 bytes, two merges."""
    heads, kv_heads, ffn = 4, 2, 64
    spelling = bytes_to_unicode()
    tokens = [*SPECIAL_TOKENS, *(spelling[b] for b in range(256)), "ab", "abc"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    weight("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
