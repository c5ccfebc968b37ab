"""Fixtures of the bench's tests: a tiny random Llama that uses SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_specdec


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A 1-layer random Llama (vocabulary 49152) saved next to SmolLM2's tokenizer and chat template."""
    folder = tmp_path_factory.mktemp("tiny-smol")
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_specdec.demo_model_path(quiet=True))
    except RuntimeError as err:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {err}")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
