"""`hf_specdec.loading`: the checkpoint's dtype by default, the fp32 fallback, runtime reports, prompts."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hf_specdec import loading
from hf_specdec.loading import (
    describe_runtime,
    encode_prompts,
    load_model,
    pad_token_id,
    resolve_dtype,
    runtime_line,
)

from .conftest import tiny_llama
from .helpers.tokenizers import byte_level_bpe

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    """A tiny Llama saved in bf16 (config dtype bfloat16), as Hub checkpoints are."""
    folder = tmp_path_factory.mktemp("tiny-bf16")
    tiny_llama(0).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("asked", "checkpoint", "native", "expected", "falls_back"),
    [
        ("auto", torch.bfloat16, True, torch.bfloat16, False),
        ("auto", torch.bfloat16, False, torch.float32, True),
        ("auto", torch.float16, False, torch.float32, True),
        ("auto", torch.float32, False, torch.float32, False),
        ("auto", None, True, "auto", False),  # declared nowhere: transformers reads the weights
        ("bfloat16", torch.float32, False, torch.bfloat16, False),  # explicit wins, even where slow
        ("float32", torch.bfloat16, True, torch.float32, False),
        (torch.float16, torch.bfloat16, True, torch.float16, False),
    ],
)
def test_resolve_dtype(monkeypatch, asked, checkpoint, native, expected, falls_back):
    monkeypatch.setattr(loading, "native_bf16", lambda device=None: native)
    dtype, message = resolve_dtype(asked, checkpoint, CPU)
    assert dtype == expected
    assert (message is not None) == falls_back
    if falls_back:
        assert "float32" in message and "native bf16" in message and "\n" not in message


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="auto, bfloat16, float16, float32"):
        resolve_dtype("float8", torch.bfloat16, CPU)


def test_the_gpu_keeps_a_bf16_checkpoint_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(loading, "native_bf16", lambda device=None: False)
    assert resolve_dtype("auto", torch.bfloat16, torch.device("cuda"))[0] == torch.bfloat16


def test_native_bf16_reads_the_cpu_flags(monkeypatch):
    loading._cpu_native_bf16.cache_clear()
    try:
        monkeypatch.setattr(loading, "_cpu_flags", lambda: {"avx2", "avx512_bf16"})
        assert loading.native_bf16()
        loading._cpu_native_bf16.cache_clear()
        monkeypatch.setattr(loading, "_cpu_flags", lambda: {"avx2", "avx512f"})
        assert not loading.native_bf16("cpu")
    finally:
        loading._cpu_native_bf16.cache_clear()


def test_load_model_follows_the_checkpoint(bf16_folder, monkeypatch, caplog):
    monkeypatch.setattr(loading, "native_bf16", lambda device=None: True)
    model, tokenizer = load_model(bf16_folder, device="cpu", tokenizer="tok")
    assert model.dtype == torch.bfloat16 and not model.training and tokenizer == "tok"
    assert load_model(bf16_folder, dtype="float32", device="cpu", tokenizer="tok")[0].dtype == torch.float32

    monkeypatch.setattr(loading, "native_bf16", lambda device=None: False)
    with caplog.at_level(logging.WARNING, logger="hf_specdec.loading"):
        model, _ = load_model(bf16_folder, device="cpu", tokenizer="tok")
    assert model.dtype == torch.float32
    assert "no native bf16" in caplog.text


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory) -> Path:
    """A LoRA adapter of a tiny bf16 Llama, saved as PEFT saves a fine-tune: adapter_config.json
    naming its base's folder and the adapter's weights, no config.json, no tokenizer."""
    base = tmp_path_factory.mktemp("tiny-base")
    tiny_llama(0, vocab_size=300).to(torch.bfloat16).save_pretrained(base)
    byte_level_bpe(300).save_pretrained(base)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("tiny-adapter")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(folder)
    return folder


def test_load_model_loads_a_peft_adapter_onto_its_base(adapter_folder, monkeypatch):
    """transformers' from_pretrained loads an adapter folder onto the base it names; load_model read
    the dtype from the folder's config.json, which an adapter has not ("Unrecognized model"), so
    `--model <adapter>` failed in every command unless a dtype was given."""
    base_folder = json.loads((adapter_folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    ids = torch.tensor([[1, 7, 40, 3, 9]])
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(loading, "native_bf16", lambda device=None, native=native: native)
        model, tokenizer = load_model(adapter_folder, device="cpu")
        assert model.dtype == dtype and not model.training
        assert tokenizer.eos_token == "<|endoftext|>"  # the base's: the adapter has none of its own
    # The adapter is applied: the fp32 model (the last loaded) computes otherwise than its base.
    assert not torch.allclose(model(ids).logits, base(ids).logits)


def test_load_model_refuses_a_model_that_is_not_a_causal_lm(tmp_path):
    """`hf-specdec demo --model <a T5 folder>` (bench, train-draft alike) answered with transformers'
    error listing every causal config class, some 4,000 characters on the terminal, and no word of
    what to pass instead."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        load_model(tmp_path, device="cpu", tokenizer="tok")
    message = str(err.value)
    assert "is a t5 model (T5ForConditionalGeneration), not a causal LM" in message
    assert "\n" not in message and len(message) < 400


def test_load_model_refuses_a_checkpoint_missing_weights(tmp_path):
    """transformers fills the weights a checkpoint lacks with random values and only logs it: a
    BERT encoder's folder loaded as a causal LM ran `hf-specdec demo` and `bench` on a random LM
    head, reporting its figures as any other model's (drafts from a folder were refused so already)."""
    from safetensors.torch import load_file, save_file

    tiny_llama(0).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of its weights \(model\.norm\.weight\)"):
        load_model(tmp_path, device="cpu", tokenizer="tok")


def test_a_loaded_model_is_never_converted(bf16_folder):
    model = tiny_llama(0)
    assert load_model(model, tokenizer="tok")[0] is model
    assert load_model(model, dtype="float32", device="cpu", tokenizer="tok")[0] is model
    with pytest.raises(ValueError, match="convert it first"):
        load_model(model, dtype="bfloat16", tokenizer="tok")
    assert model.dtype == torch.float32


def test_describe_runtime_says_dtype_device_and_bf16():
    info = describe_runtime(tiny_llama(0).to(torch.bfloat16))
    assert info["dtype"] == "bfloat16" and info["device"] == "cpu"
    assert isinstance(info["native_bf16"], bool) and info["cpu"] and info["torch"] and info["transformers"]
    line = runtime_line(info)
    assert "dtype bfloat16" in line and "device cpu" in line and "native bf16" in line


def test_encode_prompts_left_pads_without_touching_the_tokenizer(smollm2):
    model, tokenizer = smollm2
    side = tokenizer.padding_side
    pad = pad_token_id(tokenizer, model)
    inputs = encode_prompts(tokenizer, ["Hi", "A longer prompt than the first"], chat=True, pad_id=pad)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == mask.shape and ids.shape[0] == 2
    assert mask[0, 0] == 0 and mask[:, -1].all() and mask[1].all()
    assert (ids[0][mask[0] == 0] == pad).all()
    assert tokenizer.padding_side == side


def test_no_module_imports_private_names_of_another_subpackage():
    """A package never imports another package's `_private` names: shared helpers have a public home."""
    root = Path(loading.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        package = path.parent.relative_to(root).parts
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            source = _resolve(package, node)
            if source[:1] != package[:1] and source != package:
                offenders += [f"{path.relative_to(root)}: {a.name}" for a in node.names if _private(a.name)]
    assert not offenders, offenders


def _resolve(package: tuple[str, ...], node: ast.ImportFrom) -> tuple[str, ...]:
    """The subpackage path (under hf_specdec) an import reads from."""
    parts = node.module.split(".")
    if node.level == 0:
        return tuple(parts[1:-1]) if parts[0] == "hf_specdec" else ("<external>",)
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return tuple(base) + tuple(parts[:-1])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
