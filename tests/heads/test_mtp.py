"""A model's own MTP layers read out of its checkpoint (`method="mtp"` with no `draft=`): tiny
checkpoints in DeepSeek-V3's layout (the MTP layer as decoder layer 61, its experts one key each)
and GLM-4.5-Air's (layer 46), on which transformers' own `generate(use_mtp=True)` runs as the
reference; Ling's hybrid of linear-attention and MLA layers, against plain decoding; and the errors
for checkpoints without MTP weights, with malformed ones, and for architectures transformers loads
no MTP layers for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from hf_specdec import SpeculativeConfig, clear_cache
from hf_specdec.heads.mtp import (
    checkpoint_folder,
    checkpoint_model,
    load_mtp_layers,
    mtp_architectures,
    mtp_weight_keys,
)

from ..conftest import assert_greedy_speculation, tiny_llama
from ..helpers import mtp
from ..helpers.forwards import assert_drafts_as_theirs

AGREE = 0.002  # 46-61 layers of attention each bend the bigram a little (tests/helpers/mtp.py)


@pytest.fixture(scope="module", params=list(mtp.LAYOUTS))
def layout(request, tmp_path_factory):
    folder = mtp.checkpoint(tmp_path_factory.mktemp(request.param), request.param, agree=AGREE)
    return request.param, folder


def load(layout: str, folder):
    return mtp.model_class(layout).from_pretrained(folder).eval()


def test_the_published_layout_drafts_as_transformers_does(layout):
    """Batch 1: identical to plain and to transformers' use_mtp=True, in as few target forwards (one
    draft token a step, as it drafts); a left-padded batch of 2, identical to plain."""
    name, folder = layout
    target = load(name, folder)
    ours = dict(speculative=dict(method="mtp", num_draft_tokens=1))
    assert_drafts_as_theirs(target, mtp.prompts(1), dict(use_mtp=True), ours, max_new_tokens=10)

    assert_greedy_speculation(target, mtp.prompts(2), 10, method="mtp", num_draft_tokens=3)


def test_a_hybrid_checkpoint_decodes_as_plain(tmp_path):
    """`bailing_hybrid` (Ling: KDA linear-attention layers beside MLA ones, its MTP layer after the
    last): its MTP layer drafts chains of 1 and 3, some rejected and some accepted, and the output
    is plain greedy's (the linear layers' recurrent state rolled back to the last token kept);
    `speculative=True` picks it. transformers 5.25's `use_mtp=True` differs from plain on most such
    prompts (`tests/helpers/mtp.py`), so plain is the reference. A batch is refused by method="mtp",
    saying what to do, and decoded plainly by `speculative=True`."""
    name = "bailing_hybrid"
    target = load(name, mtp.checkpoint(tmp_path, name, agree=0.1))
    for k in (1, 3):
        stats = assert_greedy_speculation(target, mtp.prompts(1), 24, method="mtp", num_draft_tokens=k)
        assert stats.accepted < stats.drafted
    kwargs = dict(**mtp.prompts(1), max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(**kwargs, speculative=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.speculative_stats.method == "mtp"
    with pytest.raises(ValueError, match="linear-attention or state-space layers.*one sequence at a time"):
        target.generate(**mtp.prompts(2), max_new_tokens=3, speculative="mtp")
    batch = dict(**mtp.prompts(2), max_new_tokens=3, do_sample=False)
    assert torch.equal(target.generate(**batch, speculative=True), target.generate(**batch))  # plainly


def test_the_layers_are_read_once_per_model(tmp_path, monkeypatch):
    target = load("glm4_moe", mtp.checkpoint(tmp_path, "glm4_moe"))
    reads = []
    read = load_mtp_layers
    monkeypatch.setattr("hf_specdec.drafters.mtp.load_mtp_layers", lambda t: reads.append(t) or read(t))
    for _ in range(2):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp"))
    assert len(reads) == 1
    clear_cache()
    target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp"))
    assert len(reads) == 2


def test_trust_remote_code_is_named_as_unread(tmp_path):
    """The layers are read out of the target's own checkpoint, with no repo code to run: a
    trust_remote_code=True given is said to be unread (no draft is loaded through Auto classes)."""
    target = load("glm4_moe", mtp.checkpoint(tmp_path, "glm4_moe"))
    spec = dict(method="mtp", trust_remote_code=True)
    with pytest.warns(UserWarning, match=r"method='mtp'.*\n- trust_remote_code=True .*this call loads none"):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=spec)


def test_the_layers_follow_the_model_to_another_dtype(tmp_path):
    """Read in fp32, then the model cast to bf16 (`model.to`): the layers, whose embedding and head
    are the model's and moved with it, run in bf16 too."""
    target = load("glm4_moe", mtp.checkpoint(tmp_path, "glm4_moe", agree=AGREE))
    for dtype in (torch.float32, torch.bfloat16):
        target.to(dtype)
        assert_greedy_speculation(target, mtp.prompts(2), 8, method="mtp", num_draft_tokens=3)


def test_a_checkpoint_without_mtp_weights_names_the_keys_looked_for(tmp_path):
    """DeepSeek-V3's config declares one MTP layer by default, converted checkpoints often lack it."""
    target = load("deepseek_v3", mtp.checkpoint(tmp_path, mtp=False))
    with pytest.raises(
        ValueError, match=r"holds no MTP weights.*model\\\\\.layers\\\\\.61.*model\.safetensors"
    ):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp"))


def test_the_layers_are_read_from_model_safetensors_before_a_stale_index(tmp_path):
    """A folder with `model.safetensors` (MTP layers in it) and an index left from an older sharded
    copy, naming other files without them: loading reads `model.safetensors`, so method='mtp' drafts
    with its layers, and `speculative=True` picks them."""
    folder = mtp.checkpoint(tmp_path, "glm4_moe", agree=AGREE)
    stale = {k: "model-00001-of-00002.safetensors" for k in load_file(folder / "model.safetensors")}
    stale = {k: file for k, file in stale.items() if ".46." not in k}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": stale}))
    target = load("glm4_moe", folder)
    assert_greedy_speculation(target, mtp.prompts(1), 8, method="mtp", num_draft_tokens=2)
    out = target.generate(**mtp.prompts(1), max_new_tokens=4, speculative=True, return_dict_in_generate=True)
    assert out.speculative_stats.method == "mtp"


def test_mtp_weights_in_a_file_loading_does_not_read_are_not_the_model_s(tmp_path):
    """MTP weights only in a stray safetensors file beside `model.safetensors` (a consolidated copy):
    loading would not read them, and the error says the model's weights hold none (not that the
    stray file's do not match the config)."""
    folder = mtp.checkpoint(tmp_path / "target", "glm4_moe", mtp=False)
    with_mtp = mtp.checkpoint(tmp_path / "with_mtp", "glm4_moe")
    shutil.copy(with_mtp / "model.safetensors", folder / "consolidated.safetensors")
    target = load("glm4_moe", folder)
    with pytest.raises(ValueError, match=r"holds no MTP weights.* in its safetensors \(model\.safetensors\)"):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp"))


def test_a_shard_index_that_names_no_weights_is_named(tmp_path):
    folder = mtp.checkpoint(tmp_path, "glm4_moe", shards=2)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match=r"is not read: its model.safetensors.index.json names no weights"):
        load_mtp_layers(checkpoint_model(str(folder)))


@pytest.mark.parametrize("damage", ["missing", "misshapen"])
def test_malformed_mtp_weights_are_refused_with_the_key(tmp_path, damage):
    folder = mtp.checkpoint(tmp_path)
    weights = load_file(folder / "model.safetensors")
    if damage == "missing":
        del weights["model.layers.61.enorm.weight"]
    else:
        weights["model.layers.61.eh_proj.weight"] = weights["model.layers.61.eh_proj.weight"].T.contiguous()
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    target = load("deepseek_v3", folder)
    with pytest.raises(
        ValueError, match=r"do not load as DeepseekV3ForCausalLM's MTP layers.*(enorm|eh_proj)"
    ):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp"))


def test_an_architecture_without_mtp_layers_is_refused():
    with pytest.raises(
        ValueError, match="transformers .* loads none for LlamaForCausalLM.*deepseek_v3.*glm4_moe"
    ):
        tiny_llama(0).generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, speculative=dict(method="mtp"))


def test_a_checkpoint_declaring_mtp_layers_transformers_does_not_load_says_so(tmp_path):
    """MiMo-style: a Llama-like checkpoint whose config counts MTP layers under another field."""
    model = tiny_llama(0)
    model.config.num_nextn_predict_layers = 1
    model.save_pretrained(tmp_path)
    target = LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"declares or holds MTP layers \(config.num_nextn_predict_layers=1\)"
    ):
        target.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, speculative=dict(method="mtp"))


def test_a_model_built_in_memory_is_told_to_load_from_a_checkpoint():
    target, _ = mtp.target_and_layers(num_hidden_layers=2, first_k_dense_replace=2)
    with pytest.raises(ValueError, match="was not loaded from a folder"):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=SpeculativeConfig(method="mtp"))


def test_weight_keys_and_architectures(layout):
    name, folder = layout
    target = load(name, folder)
    keys, pattern = mtp_weight_keys(target, checkpoint_folder(target))
    index = mtp.INDEX[name]
    assert (
        f"model.layers.{index}.eh_proj.weight" in keys
        and f"model.layers.{index}.mlp.experts.0.gate_proj.weight" in keys
    )
    assert all(k.startswith(f"model.layers.{index}.") for k in keys) and str(index) in pattern
    assert {"deepseek_v3", "glm4_moe", "ernie4_5_moe"} <= set(mtp_architectures())


@pytest.mark.parametrize("damage", [None, "missing", "misshapen"])
def test_a_folder_is_decided_from_its_headers_as_loading_decides(tmp_path, monkeypatch, damage):
    """Of a folder (`checkpoint_model`, on the meta device), `load_mtp_layers` reads the safetensors
    header and no weight, and decides as reading the loaded model's layers does: the same layers
    (names, shapes, dtypes), or the same error, word for word."""
    folder = mtp.checkpoint(tmp_path, "glm4_moe")
    if damage is not None:
        mtp.damage(folder, damage)

    def outcome(target):
        try:
            layers = load_mtp_layers(target)
        except ValueError as err:
            return str(err)
        return {name: (p.shape, p.dtype) for name, p in layers.layers.named_parameters()}

    reads = mtp.count_reads(monkeypatch, folder)
    decided = outcome(checkpoint_model(str(folder)))
    assert reads == {("open", "model.safetensors"): 1}  # its header: no weight read
    loaded = outcome(load("glm4_moe", folder))
    assert decided == loaded and isinstance(loaded, dict) == (damage is None)


def test_a_transformers_that_opens_files_otherwise_is_read_as_it_reads(tmp_path, monkeypatch):
    """Where transformers' MTP loader no longer opens files through `safetensors.safe_open` by that
    name, nothing is swapped: the folder's layers are decided by reading them, as before."""
    import transformers.modeling_layers as loader

    folder = mtp.checkpoint(tmp_path, "glm4_moe")
    opened = []

    def other_opener(path, *args, **kwargs):
        opened.append(Path(path).name)
        return safe_open(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", other_opener)
    layers = load_mtp_layers(checkpoint_model(str(folder)))
    assert opened == ["model.safetensors"] and loader.safe_open is other_opener
    assert all(p.device.type == "meta" for p in layers.parameters())


def test_a_peft_adapter_on_the_lm_head_is_named(tmp_path):
    """The MTP layers score with the model's LM head. Wrapped by PEFT (LoRA on lm_head), transformers'
    MtpModel looked for the wrapper's weights in the checkpoint, and the error blamed the checkpoint
    ("do not match its config"); layers read before the wrap kept scoring with the bare head."""
    target = load("glm4_moe", mtp.checkpoint(tmp_path, "glm4_moe", agree=AGREE))
    target.generate(**mtp.prompts(1), max_new_tokens=3, speculative="mtp")  # read with the bare head
    lora = LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False)
    model = get_peft_model(target, lora).eval()
    for _ in range(2):  # read before the wrap, then read afresh
        with pytest.raises(ValueError, match=r"LM head is wrapped by PEFT .*merge_and_unload\(\)"):
            model.generate(**mtp.prompts(1), max_new_tokens=3, speculative="mtp")
        clear_cache()
    assert_greedy_speculation(model.merge_and_unload(), mtp.prompts(2), 8, method="mtp", num_draft_tokens=3)
