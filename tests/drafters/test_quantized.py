"""Self-drafting with an int8 ONNX copy of the target."""

from __future__ import annotations

import warnings

import pytest

from hf_specdec.ort.cache import quantized_copy

from ..conftest import assert_greedy_match, random_batch


def test_quantized_self_drafting(target, quantized_cache):
    ids, mask = random_batch(2, 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain = target.generate(**kwargs)
    with pytest.warns(UserWarning, match="Building an int8 ONNX copy"):
        spec = target.generate(
            **kwargs, speculative=dict(method="quantized", num_draft_tokens=4), return_dict_in_generate=True
        )
    assert_greedy_match(target, plain, spec.sequences, mask)
    assert spec.speculative_stats.acceptance_rate > 0.6  # int8 in blocks of 32 still mostly agrees
    folders = list((quantized_cache / "onnx").iterdir())
    assert [f.name for f in folders] == ["LlamaForCausalLM-float32-int8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # cached: no rebuild the second time
        target.generate(**kwargs, speculative="quantized")


def test_weights_are_fingerprinted_once_per_model(target, quantized_cache, monkeypatch):
    """Whether the cached copy is the target's is decided from its weights once per model object:
    reading every weight (a device sync and an fp32 copy per tensor) is not paid on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # built here when this test runs alone
        folder = quantized_copy(target)

    def no_weight_reads(*args, **kwargs):
        raise AssertionError("the target's weights were read again")

    monkeypatch.setattr(target, "state_dict", no_weight_reads)
    monkeypatch.setattr(target, "parameters", no_weight_reads)
    assert quantized_copy(target) == folder
