"""`export_serving`: what `speculative=` runs, as a vLLM or SGLang command, checked against golden files.

Each engine × method writes `serving.json` for tiny offline models; the file must equal
`tests/golden/serving/<engine>-<case>.json` once the temporary folders and the version are replaced
by placeholders. After an intended change of the output, regenerate the golden files with

    HF_SPECDEC_REGEN_GOLDEN=1 python -m pytest tests/serving/test_export.py

and review the diff. Refusals are checked by their messages (test_plans.py).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import hf_specdec
from hf_specdec import clear_cache
from hf_specdec.config import SpeculativeConfig
from hf_specdec.selection.choice import DRAFT_FREE_AUTO
from hf_specdec.selection.method import resolve_method
from hf_specdec.serving import ServingExportError, export_serving
from hf_specdec.serving.plans import plan_mtp

from ..conftest import tiny_llama
from ..helpers import mtp
from ..helpers.hub import local_hub
from ..helpers.published import write_eagle3
from .conftest import CASES, export_case

GOLDEN = Path(__file__).parents[1] / "golden" / "serving"
REGENERATE = os.environ.get("HF_SPECDEC_REGEN_GOLDEN") == "1"


def _placeholders(text: str, models: Path, out: Path) -> str:
    text = text.replace(str(out), "<out>").replace(str(models), "<models>")
    return text.replace(f"hf-specdec {hf_specdec.__version__}", "hf-specdec <version>")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_serving_json_matches_golden(models, tmp_path, engine, case):
    result = export_case(models, tmp_path, engine, case)
    written = (tmp_path / "serving.json").read_text()
    assert json.loads(written) == result
    got = _placeholders(written, models, tmp_path)
    golden = GOLDEN / f"{engine}-{case}.json"
    if REGENERATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
    assert golden.is_file(), f"no golden file {golden}: run with HF_SPECDEC_REGEN_GOLDEN=1"
    assert got == golden.read_text()


def test_no_method_exports_what_speculative_true_picks(models, tmp_path):
    result = export_serving(str(models / "target"), "vllm", num_draft_tokens=2, out=tmp_path)
    runs, _ = resolve_method(SpeculativeConfig(method="auto"), str(models / "target"))
    assert result["method"] == runs.method == DRAFT_FREE_AUTO  # a local folder, no Hub origin: draft-free
    chosen = f"Chosen as speculative=True would for {models / 'target'}: suffix ("
    assert result["caveats"][0].startswith(chosen)
    sglang = export_serving(str(models / "target"), "sglang", num_draft_tokens=2)
    assert sglang["engine_method"] == "NGRAM"  # SGLang has no suffix decoding: it says what it serves
    assert any("no suffix decoding" in caveat for caveat in sglang["caveats"])
    with_draft = export_serving(
        str(models / "target"), "sglang", draft=str(models / "draft"), num_draft_tokens=2
    )
    assert (with_draft["method"], with_draft["engine_method"]) == ("draft_model", "STANDALONE")


# With no method, what is given as --draft (or --head) is exported as speculative=dict(draft=...) runs
# it (`selection.method.method_of_draft`), not as a draft model for being given as --draft.
DRAFTS_BY_KIND = {
    "eagle-head": ("target8", "head-eagle3", "eagle"),
    "onnx-export": ("target", "draft-onnx", "onnx"),
    "assistant": ("gemma4-target", "gemma4-assistant", "assistant"),
    "published-eagle-head": ("target8", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle"),  # the registry's
    "draft-model": ("target", "draft", "draft_model"),
}


@pytest.mark.parametrize("case", list(DRAFTS_BY_KIND))
def test_a_draft_given_with_no_method_is_exported_as_generate_runs_it(models, tmp_path, monkeypatch, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the published head is told by the registry's entry
    model, draft, method = DRAFTS_BY_KIND[case]
    model, draft = str(models / model), str(models / draft) if (models / draft).exists() else draft
    runs, _ = resolve_method(SpeculativeConfig(draft=draft), model)
    result = export_serving(model, "vllm", draft=draft, num_draft_tokens=3, out=tmp_path)
    assert result["method"] == runs.method == method


def test_a_hub_head_given_as_draft_is_exported_as_a_head(models, tmp_path, monkeypatch):
    """Told from its listing, config and safetensors header on the (local) Hub, as generate tells it:
    an EAGLE-3 head the registry does not list goes to the EAGLE plan, which asks for its folder,
    rather than into a draft-model plan that would serve it as a causal LM."""
    hub = local_hub(tmp_path, monkeypatch)
    try:
        hub.add("someone/eagle3-head", write_eagle3(tmp_path / "head", tiny_llama(0, layers=8)))
        with pytest.raises(ValueError, match="'someone/eagle3-head' is neither a local folder nor a head"):
            export_serving(str(models / "target8"), "vllm", draft="someone/eagle3-head", num_draft_tokens=3)
    finally:
        hub.stop()
        clear_cache()


def test_a_checkpoint_with_mtp_layers_exports_them(models, tmp_path):
    """As speculative=True chooses: the target's own MTP layers, no draft of another model. vLLM
    takes them with no `model`; SGLang from the target named as its draft path: sglang 0.5.23
    (`srt/arg_groups/speculative_hook.py`, `_handle_eagle_family`) fills that in itself only for
    DeepSeek-V3/V3.2/V4, GLM-4.5 (and Lite, DSA), Ling (BailingMoe, V2, V2.5), Mistral Large 3,
    Pixtral, HY V3/V4 and Qwen4-Exp; the other targets whose MTP layers it loads
    (`srt/configs/model_config.py`: Ernie4_5_MoeForCausalLM, Step3p7ForConditionalGeneration,
    InklingForConditionalGeneration, ...) start their draft worker with no model path."""
    target = str(models / "mtp-target")
    vllm = export_serving(target, "vllm", num_draft_tokens=2)
    assert vllm["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    sglang = export_serving(target, "sglang", num_draft_tokens=2)
    command = sglang["command"]
    assert sglang["method"] == "mtp" and sglang["draft"] == target
    assert command[command.index("--speculative-algorithm") + 1] == "EAGLE"
    assert command[command.index("--speculative-draft-model-path") + 1] == target
    assert plan_mtp(target, None, None, {}).mtp_layers == 1  # vLLM's draft length rule reads it
    with pytest.raises(ServingExportError, match="no engine equivalent.*drop --draft"):
        export_serving(str(models / "mtp-target"), "vllm", method="mtp", draft=str(models / "draft"))


@pytest.mark.parametrize("damage", [None, "missing", "misshapen"])
def test_own_mtp_layers_are_exported_as_their_headers_decide(tmp_path, monkeypatch, damage):
    """Whether the target's own MTP layers load is asked twice (what speculative=True picks, then
    its plan), from the checkpoint's safetensors header both times: read once, and no weight. Layers
    that do not load are passed over, saying why, and refused when named."""
    folder = mtp.checkpoint(tmp_path / "target", "glm4_moe")
    if damage is not None:
        mtp.damage(folder, damage)
    reads = mtp.count_reads(monkeypatch, folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = export_serving(str(folder), "vllm", num_draft_tokens=2)
    if damage is None:
        assert auto["speculative_config"]["method"] == "mtp" and not caught
    else:
        assert auto["speculative_config"]["method"] != "mtp"
        assert any("own MTP layers are not used" in caveat for caveat in auto["caveats"])
        assert [str(w.message) for w in caught if "MTP layers" in str(w.message)]
        with pytest.raises(ValueError, match="do not load as Glm4MoeForCausalLM's MTP layers.*eh_proj"):
            export_serving(str(folder), "vllm", method="mtp", num_draft_tokens=2)
    assert reads == {("open", "model.safetensors"): 1}


def test_bad_arguments(models, tmp_path):
    with pytest.raises(ValueError, match="Unknown engine 'tgi'"):
        export_serving(str(models / "target"), "tgi", method="ngram", num_draft_tokens=3)
    with pytest.raises(ValueError, match="positive integer"):
        export_serving(str(models / "target"), "vllm", method="ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="needs --draft"):
        export_serving(str(models / "target"), "vllm", method="draft_model", num_draft_tokens=3)
    a_file = tmp_path / "serving.txt"  # was '[Errno 17] File exists', once the draft length was measured
    a_file.write_text("")
    with pytest.raises(ValueError, match="serving.txt' is a file; pass a folder for serving.json"):
        export_serving(str(models / "target"), "vllm", method="ngram", out=a_file)


def test_a_peft_adapter_is_refused_with_how_to_serve_it(models, tmp_path):
    """An adapter folder (adapter_config.json, no config.json), which transformers loads onto its
    base, was written into the command as the model the engine serves: vLLM and SGLang load no
    adapter as a model."""
    lora = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(models / "target"), lora).save_pretrained(adapter)
    for engine, flags in (("vllm", "--lora-modules"), ("sglang", "--lora-paths")):
        with pytest.raises(
            ServingExportError, match=f"PEFT adapter of {models / 'target'}.*{flags}.*merge_and_unload"
        ):
            export_serving(str(adapter), engine, method="ngram", num_draft_tokens=3, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()
