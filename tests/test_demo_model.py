"""The demo model's cache: stored in bf16 like the Hub checkpoint; an old fp32 folder is converted once."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from hf_specdec import demo_model

from .conftest import tiny_llama


def test_an_unstamped_fp32_folder_is_converted_to_bf16_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    folder = tmp_path / "models" / demo_model.DEMO_MODEL_NAME
    tiny_llama(0).save_pretrained(folder)  # what an older version left: fp32, no stamp
    (folder / "tokenizer.json").write_text("{}")
    original = tiny_llama(0).state_dict()

    assert demo_model.demo_model_path(quiet=True) == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["_name_or_path"].startswith("HuggingFaceTB/")
    assert (folder / "tokenizer.json").read_text() == "{}"  # the other files are kept
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        name = "model.layers.0.mlp.down_proj.weight"
        assert weights.get_tensor(name).dtype == torch.bfloat16
        assert torch.equal(weights.get_tensor(name), original[name].to(torch.bfloat16))
    assert [p.name for p in tmp_path.joinpath("models").iterdir()] == [demo_model.DEMO_MODEL_NAME]

    stamped = (folder / "model.safetensors").stat().st_mtime_ns
    assert demo_model.demo_model_path(quiet=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamped  # not converted again
