"""train-draft's data caches (the target's answers, its features) are reused only for what built them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_specdec.train import features as features_module
from hf_specdec.train.data import Sequence, build_sequences, load_prompts
from hf_specdec.train.features import cached_target_features

from ..conftest import tiny_llama


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def model(tokenizer, monkeypatch):
    """A one-layer Llama of SmolLM2's vocabulary, generating for real, every run of it counted."""
    monkeypatch.setattr("hf_specdec.train.data.MIN_TOKENS", 1)
    model = tiny_llama(7, vocab_size=len(tokenizer), layers=1, eos_token_id=None)
    model.runs = 0
    generate = model.generate

    def counted(*args, **kwargs):
        model.runs += 1
        return generate(*args, **kwargs)

    model.generate = counted
    return model


def _prompts(folder, name, texts):
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    return load_prompts(None, path)


def _same(a: list[Sequence], b: list[Sequence]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.ids, y.ids) and x.answer_start == y.answer_start for x, y in zip(a, b)
    )


def test_prompt_sets_sharing_their_first_prompt_and_count_are_cached_apart(model, tokenizer, tmp_path):
    """The cache key is a digest of every prompt as the target reads it, the target's weights and the
    generation settings: it was the prompt count and the first prompt, so a second prompt set with
    the same first prompt and count got the first set's answers, and a head trained on them."""
    first = _prompts(tmp_path, "first", ["Name a colour.", "Count to three."])
    second = _prompts(tmp_path, "second", ["Name a colour.", "Spell the word cat."])
    cache = tmp_path / "data" / "sequences.pt"
    a = build_sequences(model, tokenizer, first, cache, max_new_tokens=4)
    b = build_sequences(model, tokenizer, second, cache, max_new_tokens=4)
    assert model.runs == 2 and not _same(a, b)  # generated again, not read from the first set's cache
    assert _same(b, build_sequences(model, tokenizer, second, tmp_path / "fresh.pt", max_new_tokens=4))
    runs = model.runs
    assert _same(b, build_sequences(model, tokenizer, second, cache, max_new_tokens=4))
    assert model.runs == runs  # the same inputs: read from the cache
    for changed in (dict(max_new_tokens=5), dict(max_new_tokens=4, max_length=6)):
        build_sequences(model, tokenizer, second, cache, **changed)
        assert model.runs == runs + 1, changed
        runs = model.runs
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # another version of the target's weights
    build_sequences(model, tokenizer, second, cache, max_length=6, max_new_tokens=4)
    assert model.runs == runs + 1


def test_features_of_other_tokens_of_the_same_lengths_are_computed_again(monkeypatch, tmp_path):
    """The feature cache's key is a digest of every token id, the layers and the target's weights: it
    was the sequence count, the token total, the layers and the target's name, so other text of the
    same lengths, or a target fine-tuned since, got the features of what was cached."""
    model = tiny_llama(8, layers=1)
    cache = tmp_path / "features.pt"
    runs = []
    target_features = features_module.target_features

    def counted(*args, **kwargs):
        runs.append(1)
        return target_features(*args, **kwargs)

    monkeypatch.setattr(features_module, "target_features", counted)
    one = [Sequence(torch.tensor([1, 2, 3, 4]), 2), Sequence(torch.tensor([5, 6, 7]), 1)]
    other = [Sequence(torch.tensor([1, 2, 3, 9]), 2), Sequence(torch.tensor([5, 6, 7]), 1)]
    first = cached_target_features(model, one, (-1,), cache)
    assert len(runs) == 1
    cached_target_features(model, one, (-1,), cache)
    assert len(runs) == 1  # the same text: read from the cache
    again = cached_target_features(model, other, (-1,), cache)
    assert len(runs) == 2 and not torch.equal(first[0].labels, again[0].labels)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    cached_target_features(model, other, (-1,), cache)
    assert len(runs) == 3
