"""Where an ONNX Runtime session runs for a target on a given device (`ort.session.placement`), as a
pure function: there is no GPU here, so the CUDA cases check the options a session would be made with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_specdec.drafters.onnx import OnnxDraftConfig, load_decoder
from hf_specdec.ort import session
from hf_specdec.ort.session import OnnxDecoder, placement

CPU = (torch.device("cpu"), ["CPUExecutionProvider"])


def _cuda(index: int):
    return torch.device("cuda", index), [
        ("CUDAExecutionProvider", {"device_id": index}),
        "CPUExecutionProvider",
    ]


CASES = [  # (provider, target device, CUDA provider usable, torch's current GPU) -> placement
    ("auto", "cuda:1", True, 0, _cuda(1)),  # on the target's own GPU, not the current one
    ("cuda", "cuda:1", True, 0, _cuda(1)),
    ("auto", "cuda:0", True, 1, _cuda(0)),
    ("auto", "cuda", True, 3, _cuda(3)),  # no index: torch's current GPU, as torch would use
    ("cuda", "cpu", True, 2, _cuda(2)),  # asked for CUDA with a CPU target
    ("auto", "cpu", True, 0, CPU),
    ("cpu", "cuda:1", True, 0, CPU),  # a CPU session for a GPU target: logits move to the target
    ("auto", "cuda:1", False, 0, CPU),  # onnxruntime without CUDA
    ("cuda", "cuda:0", False, 0, CPU),
]


@pytest.mark.parametrize("provider,target,has_cuda,current,expected", CASES)
def test_session_placement(provider, target, has_cuda, current, expected):
    assert placement(provider, torch.device(target), has_cuda, current) == expected


def test_the_onnx_drafter_loads_its_session_for_the_targets_device(monkeypatch, tmp_path):
    asked = []
    (tmp_path / "model.onnx").touch()
    monkeypatch.setattr(session, "_LOADED", {})
    monkeypatch.setattr(OnnxDecoder, "_load", classmethod(lambda cls, *args: asked.append(args) or object()))
    target = SimpleNamespace(device=torch.device("cuda", 1))  # stands in for a model on cuda:1
    load_decoder(tmp_path, OnnxDraftConfig(threads=1), target)
    load_decoder(tmp_path, OnnxDraftConfig(threads=1), SimpleNamespace(device=torch.device("cpu")))
    assert asked == [
        (tmp_path, "auto", 1, torch.device("cuda", 1)),
        (tmp_path, "auto", 1, torch.device("cpu")),  # another device, another session
    ]
