"""The KV-cache argument's name follows the model's own forward (it changed within transformers 5.x)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_specdec.core.compat import cache_argument, generate_cache

from ..conftest import tiny_llama


class _OldForward(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, past_key_values=None, **kwargs):
        return past_key_values


class _NewForward(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, cache=None, **kwargs):
        return cache


def test_cache_argument_is_the_name_the_forward_declares():
    assert cache_argument(_OldForward()) == "past_key_values"
    assert cache_argument(_NewForward()) == "cache"
    # The installed transformers' own model: the name reaches its forward (not its **kwargs).
    model = tiny_llama(7)
    cache = DynamicCache(config=model.config)
    model(torch.tensor([[5, 6, 7]]), use_cache=True, **{cache_argument(model): cache})
    assert cache.get_seq_length() == 3


def test_generate_cache_reads_either_name():
    cache = object()
    assert generate_cache({"cache": cache}) is cache
    assert generate_cache({"past_key_values": cache}) is cache
    assert generate_cache({}) is None
