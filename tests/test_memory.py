"""`hf_specdec.clear_cache()` frees every draft, session and tokenizer kept between generate calls."""

from __future__ import annotations

import weakref

import torch

import hf_specdec
from hf_specdec.core.policy import DEVICE_COSTS
from hf_specdec.drafters import draft_model
from hf_specdec.ort import session

from .conftest import random_batch


def _generate(target, **speculative):
    ids, mask = random_batch(0, 2)
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, speculative=speculative)


def test_a_draft_loaded_by_path_is_freed(target, onnx_dirs):
    _generate(target, method="draft_model", draft=str(onnx_dirs["good-hf"]), num_draft_tokens=3)
    draft, _ = draft_model.load_draft(str(onnx_dirs["good-hf"]), target)
    assert len(draft_model._LOADED) == 1  # the generate call loaded it, load_draft found it
    kept = weakref.ref(draft)
    del draft
    hf_specdec.clear_cache()
    assert draft_model._LOADED == {}
    assert kept() is None  # nothing else holds it: generate left no reference behind


def test_onnx_sessions_are_freed(target, onnx_dirs):
    _generate(target, method="onnx", draft=str(onnx_dirs["good"]), num_draft_tokens=3)
    decoders = [weakref.ref(d) for d in session._LOADED.values()]
    sessions = [weakref.ref(d().session) for d in decoders]
    assert decoders
    hf_specdec.clear_cache()
    assert session._LOADED == {}
    assert all(ref() is None for ref in decoders + sessions)


def test_tokenizers_read_from_a_folder_are_forgotten(tmp_path):
    draft_model._load_tokenizer(str(tmp_path), (0,))
    assert draft_model._load_tokenizer.cache_info().currsize >= 1
    hf_specdec.clear_cache()
    assert draft_model._load_tokenizer.cache_info().currsize == 0


def test_cuda_memory_goes_back_only_once_cuda_is_in_use(monkeypatch):
    # No GPU here: checks the dispatch, with torch.cuda's two functions replaced.
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    hf_specdec.clear_cache()
    assert emptied == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    hf_specdec.clear_cache()
    assert emptied == [True]


def test_what_verifying_cost_on_a_model_is_forgotten(target):
    ids = torch.tensor([[6, 7, 8, 9] * 4])  # repeats: n-gram drafts, verified wider than a step
    target.generate(input_ids=ids, max_new_tokens=12, speculative="ngram")
    assert DEVICE_COSTS.policy(target).costs.prior
    hf_specdec.clear_cache()
    assert not DEVICE_COSTS.policy(target).costs.prior
