"""The exporter: the Hub's ONNX decoder layout, checked against PyTorch."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.ort import export_onnx_report
from hf_specdec.ort.export import _load
from hf_specdec.ort.session import OnnxDecoder
from hf_specdec.serving import export_serving
from hf_specdec.serving.sources import onnx_source

from ..conftest import tiny_llama


def test_export_writes_hub_layout_and_matches_pytorch(onnx_dirs, tmp_path):
    folder = onnx_dirs["good"]
    assert {"model.onnx", "config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    decoder = OnnxDecoder.load(folder)
    names = {i.name for i in decoder.session.get_inputs()}
    assert {"input_ids", "attention_mask", "position_ids", "past_key_values.1.value"} <= names
    # Our optional inputs have defaults, so readers of the Hub layout need not feed them.
    optional = {i.name for i in decoder.session.get_overridable_initializers()}
    assert {"num_logits_to_keep", "tree_attention_mask"} <= optional and decoder.has_tree_mask
    # The report's figures, on a one-layer model (the two-layer exports above passed the same parity
    # check to be written): what they say does not depend on the depth, an export's cost does.
    report = export_onnx_report(tiny_llama(1, layers=1), tmp_path / "again", progress=False)
    assert report.max_abs_diff < report.tolerance <= 1e-2


def test_an_export_names_the_model_it_came_from_so_it_can_be_served(onnx_dirs):
    """transformers 5 writes no `_name_or_path` into config.json: the export adds it (the folder's
    absolute path), and export-serving serves the ONNX draft with that model instead of refusing it."""
    good, source = onnx_dirs["good"], onnx_dirs["good-hf"]
    assert json.loads((good / "config.json").read_text())["_name_or_path"] == str(source.resolve())
    assert onnx_source(good) == str(source.resolve())
    served = export_serving(str(source), "vllm", draft=str(good), num_draft_tokens=3)
    assert served["speculative_config"]["model"] == str(source.resolve())
    OnnxDecoder.load(good)  # and the folder still loads as a draft


def test_a_model_is_converted_tensor_by_tensor_never_duplicated_where_it_lives(weak_draft, monkeypatch):
    """The export's copy of a model on a GPU or in another dtype is made one tensor at a time on the
    CPU: a deep copy would first duplicate every weight where it lives (twice a GPU model's memory)."""
    duplicated = []
    deepcopy = torch.nn.Parameter.__deepcopy__

    def recording(self, memo):
        duplicated.append(tuple(self.shape))
        return deepcopy(self, memo)

    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", recording)
    copy, _ = _load(weak_draft, None, torch.float16)
    assert duplicated == []
    assert copy.dtype == torch.float16 and copy.device.type == "cpu"
    assert weak_draft.dtype == torch.float32  # the caller's model is untouched
    theirs, ours = weak_draft.state_dict(), copy.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], tensor.half()) for name, tensor in theirs.items())


def test_eager_attention_exports_take_the_tree_mask_too(tmp_path):
    """The 4D mask the export builds is additive for eager attention, boolean for sdpa: both
    reproduce PyTorch with the tree mask left at its default."""
    model = tiny_llama(1, layers=1)  # every layer takes the same mask: one shows it
    model.set_attn_implementation("eager")
    report = export_onnx_report(model, tmp_path / "eager", progress=False)
    assert report.max_abs_diff < report.tolerance
    assert OnnxDecoder.load(tmp_path / "eager").has_tree_mask


def test_sliding_window_models_get_no_tree_mask():
    """One 4D mask cannot say a sliding window: such exports keep the model's own masks (their
    trees are grown a batch row per node)."""
    from transformers import MistralConfig, MistralForCausalLM

    from hf_specdec.ort.export import takes_tree_mask

    small = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    assert takes_tree_mask(tiny_llama(0))
    assert not takes_tree_mask(MistralForCausalLM(MistralConfig(**small, sliding_window=8)))


def test_a_failed_export_leaves_no_folder_and_a_file_is_refused(tmp_path):
    """A model that does not load left an empty output folder behind; a file as the output was
    found only after loading (FileExistsError)."""
    out = tmp_path / "never-made"
    with pytest.raises(OSError):
        export_onnx_report("/no/such/model", out, progress=False)
    assert not out.exists()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="a-file is a file; pass a folder for the ONNX export"):
        export_onnx_report("/no/such/model", tmp_path / "a-file", progress=False)


def test_a_model_that_is_not_a_causal_lm_is_refused_in_one_line(t5_folder, tmp_path):
    """`hf-specdec export-onnx ./t5` answered with AutoModelForCausalLM's list of every causal config
    class (some 4,000 characters), no word of what to export instead."""
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        export_onnx_report(str(t5_folder), out, progress=False)
    message = str(err.value)
    assert f"{t5_folder} is a t5 model (T5ForConditionalGeneration), not a causal LM" in message
    assert "\n" not in message and len(message) < 400
    assert not out.exists()


def test_a_model_in_train_mode_is_exported_without_dropout_and_left_in_its_mode(tmp_path):
    """Traced and checked in eval mode, then each module back in its own: the caller's model (a
    target `method="quantized"` exports) was left switched to eval for good, its dropout off."""
    model = tiny_llama(1, layers=1).train()
    model.model.layers[0].self_attn.attention_dropout = 0.5  # in the export, the parity check would fail
    model.lm_head.eval()
    report = export_onnx_report(model, tmp_path / "trained", progress=False)
    assert report.max_abs_diff < report.tolerance
    assert [name for name, m in model.named_modules() if not m.training] == ["lm_head"]
