"""Targets split by accelerate (`device_map=`) over "cpu" and "disk" speculate correctly.

The embedding, the LM head and one of the two layers are offloaded to disk: their weights sit on the
`meta` device and `model.device` is `meta`. Every method must still run where the model computes (the
CPU here) and give plain greedy output; before, `draft_model` failed with torch's NotImplementedError
for `nonzero()` on `meta`, and heads read the offloaded LM head's `meta` weight.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_specdec.core.devices import execution_device, module_device
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head, save_head
from hf_specdec.heads.medusa import MedusaHeadConfig

from ..conftest import assert_greedy_speculation, tiny_llama
from ..helpers import mtp

pytest.importorskip("accelerate")

SPLIT = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_map")
    target = tiny_llama(0)
    target.save_pretrained(root / "target")
    draft = tiny_llama(0)  # the target with its last MLP perturbed: agrees with it most of the time
    with torch.no_grad():
        draft.model.layers[-1].mlp.down_proj.weight.mul_(0.7)
    draft.save_pretrained(root / "draft")
    torch.manual_seed(0)
    save_head(build_head(EagleHeadConfig.for_target(target, input_norms=True), target), root / "eagle")
    save_head(build_head(MedusaHeadConfig.for_target(target, num_heads=2), target), root / "medusa")
    return root


@pytest.fixture(scope="module")
def offloaded(folders):
    model = AutoModelForCausalLM.from_pretrained(
        folders / "target", device_map=SPLIT, offload_folder=str(folders / "offload")
    )
    assert model.device.type == "meta" and model.lm_head.weight.device.type == "meta"  # really offloaded
    return model


def test_execution_device_of_a_split_model(offloaded):
    assert execution_device(offloaded) == torch.device("cpu")
    assert execution_device(tiny_llama(0)) == torch.device("cpu")
    # A module offloaded to disk computes where its hook runs it; one built on `meta` has no weights.
    assert next(offloaded.model.layers[1].parameters()).device.type == "meta"
    assert module_device(offloaded.model.layers[1]) == torch.device("cpu")
    assert module_device(tiny_llama(0).to("meta").model.layers[1]) == torch.device("meta")


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "medusa"])
def test_every_method_gives_plain_greedy_output(folders, offloaded, method):
    input_ids = torch.tensor([[1, 17, 42, 9, 33, 17, 42, 9]])
    kwargs = dict(input_ids=input_ids, do_sample=False, max_new_tokens=16)
    plain = offloaded.generate(**kwargs)
    assert torch.equal(plain, tiny_llama(0).generate(**kwargs))  # the split model is the same model
    draft = {"ngram": None, "draft_model": str(folders / "draft")}.get(method, str(folders / method))
    out = offloaded.generate(
        **kwargs,
        speculative=dict(method=method, draft=draft, num_draft_tokens=3),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    if method != "ngram":  # a random prompt need not repeat; the others always draft
        assert out.speculative_stats.drafted > 0


def test_a_draft_model_given_offloaded_runs_where_it_computes(folders):
    """A draft loaded with its own device_map (half on disk) and given as draft=: it runs where its
    hooks compute (the CPU), as transformers runs an assistant model on its own device; before, its
    `model.device` (`meta`) took its cache and tokens there."""
    draft = AutoModelForCausalLM.from_pretrained(
        folders / "draft", device_map=SPLIT, offload_folder=str(folders / "draft-offload")
    )
    assert draft.device.type == "meta"
    target = tiny_llama(0)
    kwargs = dict(input_ids=torch.tensor([[1, 17, 42, 9, 33, 17, 42, 9]]), do_sample=False, max_new_tokens=16)
    spec = dict(method="draft_model", draft=draft, num_draft_tokens=3)
    with pytest.warns(UserWarning, match="vocabulary size only"):
        out = target.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(**kwargs))
    assert out.speculative_stats.accepted > 0


def test_mtp_layers_beside_an_offloaded_last_layer(tmp_path):
    """The model's MTP layers are read out of its checkpoint onto the device its last decoder layer
    computes on, as transformers places them: with that layer offloaded to disk (its weights on
    `meta`), its hook's device, the CPU. Before, they were read onto `meta` and failed in the first
    draft."""
    folder = mtp.checkpoint(tmp_path / "glm", "glm4_moe", agree=0.002)
    last = mtp.LAYOUTS["glm4_moe"] - 1
    split = {name: "cpu" for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    split |= {f"model.layers.{i}": "cpu" for i in range(last)} | {f"model.layers.{last}": "disk"}
    target = mtp.model_class("glm4_moe").from_pretrained(
        folder, device_map=split, offload_folder=str(tmp_path / "offload")
    )
    assert next(target.model.layers[last].parameters()).device.type == "meta"  # really offloaded
    assert_greedy_speculation(target, mtp.prompts(2), 8, method="mtp", num_draft_tokens=2)
