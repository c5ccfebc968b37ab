"""`speculative=True` drafts with the block draft the registry lists for the target (served here by a
local Hub), passes over one that cannot be loaded with a warning, and a block draft given as
`draft=` is run as one, not as a draft model."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import hf_specdec.selection.select as select
from hf_specdec.selection.method import DRAFT_FREE_AUTO, method_of_draft

from ..conftest import tiny_llama
from ..heads.test_published import hub  # noqa: F401 (the local Hub fixture)
from ..helpers.block_drafts import random_block_draft, write_dspark, write_zlab

TARGET = "acme/Tiny-Target"


@pytest.fixture
def registry(monkeypatch, tmp_path):
    """A registry listing a DFlash draft for TARGET, and no draft model (n-grams otherwise)."""
    entry = dict(targets=[TARGET], method="dflash", head="z-lab/Tiny-DFlash", layout="DFlash", source="test")
    free = dict(targets=[TARGET], method="ngram", reason="no draft model", source="test")
    data = {"pair": [], "draft_free": [free], "head": [entry]}
    monkeypatch.setattr(select, "_registry_data", lambda: data)
    monkeypatch.setattr(select, "_registry", lambda: {TARGET.lower(): free})
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "specdec"))
    return entry


@pytest.fixture
def target():
    model = tiny_llama(0, eos_token_id=None)
    model.name_or_path = TARGET
    return model


def test_speculative_true_drafts_with_the_registrys_block_draft(tmp_path, target, registry, hub):  # noqa: F811
    hub.add("z-lab/Tiny-DFlash", write_zlab(tmp_path / "draft", target))
    prompt = torch.tensor([[1, 5, 6, 7, 8, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    out = target.generate(
        prompt, max_new_tokens=12, do_sample=False, speculative=True, return_dict_in_generate=True
    )
    assert out.speculative_stats.method == "dflash" and out.speculative_stats.drafted > 0
    assert torch.equal(out.sequences, plain)


def test_a_block_draft_that_cannot_be_loaded_is_passed_over(target, registry, hub, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not in the local cache: it cannot be had
    prompt = torch.tensor([[1, 5, 6, 7, 8, 5, 6]])
    with pytest.warns(UserWarning, match=r"published block draft z-lab/Tiny-DFlash for acme/Tiny-Target"):
        out = target.generate(
            prompt, max_new_tokens=6, do_sample=False, speculative=True, return_dict_in_generate=True
        )
    assert out.speculative_stats.method == DRAFT_FREE_AUTO  # no draft model: auto's draft-free method


def test_a_block_draft_given_as_draft_is_run_as_one(tmp_path, target):
    zlab, dspark = write_zlab(tmp_path / "zlab", target), write_dspark(tmp_path / "dspark", target)
    assert (method_of_draft(str(zlab)), method_of_draft(str(dspark))) == ("dflash", "dspark")
    assert method_of_draft(random_block_draft(target, (0, 1))) == "dflash"
    assert method_of_draft(str(tmp_path)) == "draft_model"  # a folder without one: a draft model, as before
    out = target.generate(
        torch.tensor([[1, 5, 6, 7]]),
        max_new_tokens=6,
        do_sample=False,
        speculative=dict(draft=str(dspark)),
        return_dict_in_generate=True,
    )
    assert out.speculative_stats.method == "dspark"


@pytest.mark.parametrize("own", ["mtp", "assistant"])
def test_the_models_own_heads_come_before_a_published_block_draft(target, registry, monkeypatch, own):
    """Where the selection finds the target's own heads, the registry's block draft for it is not
    loaded: `published_block_draft` steps aside (a failed load would warn; nothing is fetched)."""
    import hf_specdec.selection.block as block
    from hf_specdec.selection.choice import DraftChoice

    mine = DraftChoice(own, None, "its own heads", target=TARGET, source="checkpoint", heads=[registry])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the listed draft cannot be had: trying it warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert block.published_block_draft(target, mine) is None
    with pytest.warns(UserWarning, match="published block draft z-lab/Tiny-DFlash"):
        assert block.published_block_draft(target, dataclasses.replace(mine, method="ngram")) is None


@pytest.mark.parametrize("own", ["mtp", "assistant"])
def test_serving_export_steps_aside_for_the_models_own_heads_as_generate_does(registry, monkeypatch, own):
    """`export_serving` with no method exports what `speculative=True` drafts with: the model's own
    heads before a block draft the registry lists for it (`registry_block_heads`, their one rule)."""
    import hf_specdec.serving as serving
    from hf_specdec.selection.block import registry_block_heads
    from hf_specdec.selection.choice import DraftChoice

    mine = DraftChoice(own, None, "its own heads", target=TARGET, source="checkpoint", heads=[registry])
    assert registry_block_heads(mine) == []
    assert registry_block_heads(dataclasses.replace(mine, method="ngram")) == [registry]
    monkeypatch.setattr(serving, "select_draft", lambda model: mine)
    assert serving._resolve_method(TARGET, None, None, None)[0] == own
    monkeypatch.setattr(serving, "select_draft", lambda model: dataclasses.replace(mine, method="ngram"))
    assert serving._resolve_method(TARGET, None, None, None)[:2] == ("dflash", registry["head"])
