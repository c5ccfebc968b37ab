"""Self-drafting with an int8 ONNX copy of the target."""

from __future__ import annotations

import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_specdec.ort import cache as ort_cache
from hf_specdec.ort.cache import quantized_copy
from hf_specdec.store import fingerprint

from ..conftest import assert_greedy_match, random_batch, tiny_llama


def test_quantized_self_drafting(target, quantized_cache):
    ids, mask = random_batch(2, 2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    plain = target.generate(**kwargs)
    with pytest.warns(UserWarning, match="Building an int8 ONNX copy"):
        spec = target.generate(
            **kwargs, speculative=dict(method="quantized", num_draft_tokens=4), return_dict_in_generate=True
        )
    assert_greedy_match(target, plain, spec.sequences, mask)
    assert spec.speculative_stats.acceptance_rate > 0.6  # int8 in blocks of 32 still mostly agrees
    folders = [f for f in (quantized_cache / "onnx").iterdir() if not f.name.startswith(".")]  # .*.lock
    assert [f.name for f in folders] == ["LlamaForCausalLM-float32-int8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # cached: no rebuild the second time
        target.generate(**kwargs, speculative="quantized")


def test_weights_are_fingerprinted_once_per_model(target, quantized_cache, monkeypatch):
    """Whether the cached copy is the target's is decided from its weights once per model object:
    reading every weight (a device sync and an fp32 copy per tensor) is not paid on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # built here when this test runs alone
        folder = quantized_copy(target)

    def no_weight_reads(*args, **kwargs):
        raise AssertionError("the target's weights were read again")

    monkeypatch.setattr(fingerprint, "_read_fingerprint", no_weight_reads)
    assert quantized_copy(target) == folder


@pytest.fixture
def exported(tmp_path, monkeypatch) -> list[Any]:
    """The models `quantized_copy` exported, into a private cache; the export itself is a stub
    (this is the cache's part; tests/ort exports for real)."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    models: list[Any] = []

    def export(model, out_dir, *args, **kwargs):
        models.append(model)
        time.sleep(0.2)  # long enough for a second process to arrive while it runs
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "model.onnx").write_bytes(b"onnx")
        return Path(out_dir) / "model.onnx"

    monkeypatch.setattr(ort_cache, "export_onnx", export)
    return models


def test_weights_changed_in_place_rebuild_the_copy(exported):
    """A target fine-tuned in place after its copy was built (the same object, an optimizer step,
    `load_state_dict`) gets a copy of its new weights: the old one would still be lossless but
    would draft for weights the target no longer has, silently slow."""
    model = tiny_llama(3, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        folder = quantized_copy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[6, 7, 8]]), labels=torch.tensor([[6, 7, 8]])).loss.backward()
    optimizer.step()
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        assert quantized_copy(model) == folder
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        quantized_copy(model)
    assert len(exported) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # unchanged since: the copy is reused
        quantized_copy(model)
    assert len(exported) == 3


def test_switching_adapters_rebuilds_the_copy(exported):
    """A PEFT model holds every adapter's weights in its state dict whichever one is active:
    `set_adapter` and `disable_adapter()` change what it computes without changing a tensor, and the
    copy built under one adapter drafted for another, silently (acceptance 0 on a tiny model whose
    adapters diverge)."""
    lora = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_llama(3, layers=1), lora)
    model.add_adapter("other", lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantized_copy(model)
    model.set_adapter("other")
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        quantized_copy(model)
    with model.disable_adapter(), pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        quantized_copy(model)
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):  # enabled again
        quantized_copy(model)
    for module in model.modules():  # LoRA's scale, set on each layer (`LoraLayer.set_scale`)
        if hasattr(module, "set_scale"):
            module.set_scale("other", 0.5)
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        quantized_copy(model)
    assert len(exported) == 5


class Int8Weight(torch.Tensor):
    """A weight kept as int8 values and a scale, in the way torchao's `Int8Tensor` keeps it: a wrapper
    subclass whose values sit in inner tensors, refusing every op it does not implement (views)."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], *args: Any) -> Int8Weight:
        return Int8Weight(inner["qdata"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return Int8Weight(args[0].qdata, args[0].scale)
        raise NotImplementedError(f"Int8Weight does not implement {func}")


def int8_weights(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            scale = module.weight.detach().abs().amax(dim=1, keepdim=True) / 127
            qdata = (module.weight.detach() / scale).round().to(torch.int8)
            module.weight = torch.nn.Parameter(Int8Weight(qdata, scale), requires_grad=False)
    return model


def test_quantized_weights_are_fingerprinted_by_their_values(exported):
    """A target whose weights are a quantized tensor subclass (torchao's) is fingerprinted through
    the tensors inside them: reading the weight itself raised deep inside the subclass."""
    models = [int8_weights(tiny_llama(seed, layers=1)) for seed in (3, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        folders = [quantized_copy(model) for model in models]
    assert len(exported) == 2 and folders[0] == folders[1]  # other weights: rebuilt, not reused
    models[1].model.layers[0].mlp.up_proj.weight.qdata.add_(1)  # changed in place
    with pytest.warns(UserWarning, match="Rebuilding the int8 ONNX copy"):
        quantized_copy(models[1])


@pytest.mark.parametrize("ids", [("org-a/x", "org-b/x"), ("a/x", "b/x")], ids=["hub", "folders"])
def test_models_of_one_basename_keep_a_copy_each(exported, tmp_path, monkeypatch, ids):
    """Two models whose id or folder ends in the same name get a folder each, named by that name and
    a digest of the whole id: sharing one, every switch between them rebuilt the copy (minutes)."""
    monkeypatch.chdir(tmp_path)
    models = [tiny_llama(seed, layers=1) for seed in (3, 4)]
    for model, name in zip(models, ids):
        if ids[0] == "a/x":
            (tmp_path / name).mkdir(parents=True)  # a local folder: named by its absolute path
        model.name_or_path = name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        folders = [quantized_copy(model) for model in (*models, models[0])]
    assert len(exported) == 2 and folders[0] == folders[2] != folders[1]
    assert all(re.fullmatch(r"x-[0-9a-f]{8}-float32-int8", folder.name) for folder in folders)
    if ids[0] == "a/x":  # the same folder by its absolute path: the same copy
        models[0].name_or_path = str(tmp_path / "a" / "x")
        assert quantized_copy(models[0]) == folders[0] and len(exported) == 2


def test_callers_asking_at_once_export_once(exported):
    """Processes (here threads: each takes the lock through a file of its own) that ask for the same
    copy at once wait for the first one's export, instead of each exporting alongside it: N times
    the minutes, the memory and the disk."""
    model = tiny_llama(3, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with ThreadPoolExecutor(3) as pool:
            folders = list(pool.map(lambda _: quantized_copy(model), range(3)))
    assert len(exported) == 1 and len(set(folders)) == 1
    assert sorted(p.name for p in folders[0].parent.iterdir() if not p.name.startswith(".")) == [
        folders[0].name
    ]


def test_a_target_torch_onnx_cannot_export_is_refused_saying_what_to_do(tmp_path, monkeypatch):
    """A target torch.onnx cannot export (weights quantized by optimum-quanto: `quanto::qbytes_mm` has
    no ONNX function) is refused naming the way out, not with the exporter's advice to report a bug
    to PyTorch."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))

    def export(*args, **kwargs):
        raise torch.onnx.OnnxExporterError("No ONNX function found for quanto.qbytes_mm")

    monkeypatch.setattr(ort_cache, "export_onnx", export)
    model = tiny_llama(3, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Building an int8 ONNX copy"
        with pytest.raises(
            ValueError, match=r"torch.onnx could not export LlamaForCausalLM .*Use another method"
        ):
            model.generate(torch.tensor([[6, 7, 8]]), max_new_tokens=4, speculative="quantized")
