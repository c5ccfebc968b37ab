"""`method="auto"` with a draft given runs it as what it is: transformers' `MtpModel` of the target's
own MTP layers, and our EAGLE / MTP / Medusa heads, loaded or saved, and heads in their authors'
layouts, in a folder or a Hub repo, draft with their own method rather than being loaded as a draft
model (block drafts and assistants: `test_block.py`, `tests/drafters/test_assistant.py`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaModel

from hf_specdec import clear_cache
from hf_specdec.drafters.kind import draft_method
from hf_specdec.heads.io import save_head
from hf_specdec.selection.method import given_method

from ..conftest import assert_greedy_match, tiny_llama
from ..helpers import mtp
from ..helpers.heads import copied_layer_eagle, identity_medusa
from ..helpers.hub import local_hub
from ..helpers.published import write_eagle1, write_eagle3, write_medusa

try:  # `python -m pytest` from the repo root, or --import-mode=importlib
    from tests.hub_server import build_tiny_repo
except ImportError:  # plain `pytest`: the tests folder itself is on sys.path
    from hub_server import build_tiny_repo


def _method_of(target, draft, inputs, method: str = "auto") -> str:
    kwargs = dict(**inputs, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        spec = dict(method=method, draft=draft)
        out = target.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    assert_greedy_match(target, plain, out.sequences, inputs.get("attention_mask"))
    return out.speculative_stats.method


def test_a_models_own_mtp_layers_given_as_draft_draft_as_mtp():
    target, layers = mtp.target_and_layers(num_hidden_layers=2, first_k_dense_replace=2)
    assert _method_of(target, layers, mtp.prompts(2)) == "mtp"


def test_a_head_of_ours_given_as_draft_drafts_with_its_method(tmp_path):
    target = tiny_llama(30, layers=1)
    inputs = {"input_ids": torch.tensor([[3, 4, 5, 6, 3, 4]])}
    heads = {
        "mtp": copied_layer_eagle(target, method="mtp", output_norm=True),
        "eagle": copied_layer_eagle(target),
        "medusa": identity_medusa(target),
    }
    for method, head in heads.items():
        assert _method_of(target, head, inputs) == method
    save_head(heads["mtp"], tmp_path / "mtp")
    assert _method_of(target, str(tmp_path / "mtp"), inputs) == "mtp"


# --- heads in the authors' layouts, in a folder or on the Hub -------------------------------------

LAYOUTS = {
    "eagle1": (lambda folder, target: write_eagle1(folder, target), "eagle"),
    "eagle1-safetensors": (
        lambda folder, target: write_eagle1(folder, target, weights="model.safetensors"),
        "eagle",
    ),
    "eagle3": (lambda folder, target: write_eagle3(folder, target), "eagle"),
    "medusa": (lambda folder, target: write_medusa(folder, target), "medusa"),
}
PROMPT = {"input_ids": torch.tensor([[1, 17, 42, 9, 33]])}


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(0, layers=8)  # EAGLE-3 reads the inputs of its layers 2, 4 and 5


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_published_head_folder_given_as_draft_drafts_with_its_method(tmp_path, target8, layout):
    """As `heads.published` reads it (its files, its config, its tensors' names), not as a draft model."""
    write, method = LAYOUTS[layout]
    folder = write(tmp_path / layout, target8)
    assert draft_method(str(folder)) == method
    assert _method_of(target8, str(folder), PROMPT) == method


def test_a_model_saved_without_its_prefix_is_still_a_draft_model(tmp_path):
    """Its `layers.*` keys are EAGLE-1's names, but it has no `fc` (both EAGLE layouts fuse in one)."""
    LlamaModel(tiny_llama(0).config).save_pretrained(tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"layers.0.mlp.up_proj.weight", "embed_tokens.weight"} <= keys
    assert draft_method(str(tmp_path)) is None


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = local_hub(tmp_path, monkeypatch)
    clear_cache()
    yield server
    server.stop()
    clear_cache()


def test_a_hub_head_given_as_draft_drafts_with_its_method(tmp_path, target8, hub):
    """A Hub repo id under method 'auto' is told from its listing, its config.json and its
    safetensors header: a head runs as one; a draft model is still one."""
    for layout in ("eagle1-safetensors", "eagle3", "medusa"):
        write, method = LAYOUTS[layout]
        repo = f"someone/{layout}-head"
        hub.add(repo, write(tmp_path / layout, target8))
        assert _method_of(target8, repo, PROMPT) == method
        with pytest.raises(ValueError, match=rf"is not a draft model.*method='{method}'"):
            target8.generate(**PROMPT, max_new_tokens=3, speculative=dict(method="draft_model", draft=repo))
    hub.add("someone/Tiny-5M", build_tiny_repo(tmp_path / "model", 32, 1, 64, "A"))
    assert draft_method("someone/Tiny-5M") is None


def test_a_hub_head_with_pickled_weights_only_is_refused_naming_its_method(tmp_path, target8, hub):
    """Its pickle is neither downloaded nor unpickled to find out what it is: the error names both
    ways to run it."""
    repo = "someone/eagle1-head"
    hub.add(repo, write_eagle1(tmp_path / "eagle1", target8))  # pytorch_model.bin
    with pytest.raises(ValueError, match=rf"pickle.*loaded model.*method='eagle', draft='{repo}'"):
        target8.generate(**PROMPT, max_new_tokens=3, speculative=dict(draft=repo))
    assert "pytorch_model.bin" not in {name for _, name in hub.resolved(repo)}
    assert _method_of(target8, repo, PROMPT, method="eagle") == "eagle"


def test_a_draft_named_as_the_method_is_told_where_it_goes():
    target = tiny_llama(30, layers=1)
    with pytest.raises(ValueError, match=r"speculative=dict\(draft='org/eagle-head'\)"):
        target.generate(**PROMPT, max_new_tokens=3, speculative="org/eagle-head")


def test_a_head_the_registry_lists_takes_its_method_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert given_method("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") == "eagle"
    assert given_method("FasterDecoding/medusa-vicuna-7b-v1.3") == "medusa"
    assert given_method("z-lab/Qwen3-4B-DFlash-b16") == "dflash"


def test_the_choice_of_auto_is_logged_once_at_info(monkeypatch, caplog):
    """What `speculative=True` chose was told only by `out.speculative_stats.selection`: it is now
    logged at INFO by `hf_specdec.selection.method`, naming the method and why, once per choice
    rather than at every call of a loop."""
    import logging

    from hf_specdec.selection import method

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no search: the draft-free choice, with its reason
    method._log_once.cache_clear()
    target = tiny_llama(5, layers=1)
    kwargs = dict(input_ids=torch.tensor([[3, 4, 5, 3, 4]]), max_new_tokens=4, do_sample=False)
    with caplog.at_level(logging.INFO, logger="hf_specdec.selection.method"):
        for _ in range(2):
            out = target.generate(**kwargs, speculative=True, return_dict_in_generate=True)
    logged = [r for r in caplog.records if r.name == "hf_specdec.selection.method"]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    stats = out.speculative_stats
    assert f"drafts with method={stats.method!r}: {stats.selection}" in logged[0].getMessage()
