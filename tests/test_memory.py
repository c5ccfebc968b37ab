"""`hf_specdec.clear_cache()` frees every draft, session and tokenizer kept between generate calls."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import pipeline

import hf_specdec
from hf_specdec.core.policy import DEVICE_COSTS
from hf_specdec.drafters import draft_model, suffix
from hf_specdec.ort import session

from .conftest import random_batch, tiny_llama
from .helpers.tokenizers import word_level


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


def _reachable(root) -> list[str]:
    """The tensors and modules reachable from `root` through plain Python references."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            found.append(type(obj).__name__)
            continue
        stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("source", [True, "ngram", "suffix", "draft_model", "pipeline"])
def test_a_model_is_freed_once_the_user_drops_it(source):
    """`del model; gc.collect()` frees the target (and a draft model given as an object) after
    speculative calls, each draft source `speculative=` picks or names: nothing the package keeps
    between calls (DEVICE_COSTS, the suffix corpora, memos) holds it, and neither do the outputs,
    whose statistics reach no tensor (the cache stays the user's to drop)."""
    target, draft = tiny_llama(0), tiny_llama(1)
    refs = [weakref.ref(target), weakref.ref(draft)]
    ids = torch.tensor([[6, 7, 8, 9] * 4])
    spec = dict(method="draft_model", draft=draft) if source == "draft_model" else source
    if source == "pipeline":
        tokenizer = word_level([f"w{i}" for i in range(60)])
        pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
        (out,) = pipe("w6 w7 w8 w6 w7 w8 w6", max_new_tokens=8, do_sample=False, speculative=True)
        out = out["generated_text"]
        del pipe
    else:
        out = target.generate(input_ids=ids, max_new_tokens=8, speculative=spec, return_dict_in_generate=True)
        assert _reachable(out.speculative_stats) == []
    del target, draft, spec
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True]
    assert out is not None  # kept to the end: the output holds neither model


def test_the_suffix_corpus_stays_within_its_bound_over_many_calls(target):
    """A model's corpus takes every call's rows, and keeps at most `max_corpus_tokens` of them."""
    spec = dict(method="suffix", options={"max_corpus_tokens": 200})
    for seed in range(30):
        ids, mask = random_batch(seed, 3)
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, speculative=spec)
    corpus = suffix.corpus_for(target)
    assert 150 < corpus.num_tokens <= 200
    assert len(corpus.snapshot.starts) <= 200 and len(corpus.snapshot.keys) == corpus.num_tokens
