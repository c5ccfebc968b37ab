"""`hf-specdec demo` end to end on the real SmolLM2 model (few tokens, to stay quick)."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.cli import main
from hf_specdec.loading import native_bf16


def test_demo_runs_and_reports_no_mismatch(smollm2_path, capsys):
    assert main(["demo", "--max-new-tokens", "12", "--model", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "Overall: plain" in out and "speedup" in out
    dtype = "bfloat16" if native_bf16() else "float32"  # the checkpoint's, or fp32 where bf16 is emulated
    assert f"Running in dtype {dtype}, device cpu" in out
    assert "0 mismatches" in out and "native bf16" in out
    assert "Prompt 3/3:" in out and "τ: the tokens one speculative step adds" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_a_user_mistake_is_one_line_not_a_traceback(capsys, monkeypatch):
    """demo, export-onnx and train-draft printed a traceback for a model path that does not exist;
    the library's message now reaches the user as the error, exit 2."""
    monkeypatch.delenv("HF_SPECDEC_TRACEBACK", raising=False)
    assert main(["demo", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "hf-specdec demo: error: '/no/such/model' is neither a model folder that exists nor a Hub" in err
    assert "Traceback" not in err


def test_a_device_this_machine_lacks_is_refused_before_loading(capsys):
    missing = "cuda:64" if torch.cuda.is_available() else "cuda"
    for bad, message in ((missing, "has "), ("foo", "'foo' is not a torch device")):
        with pytest.raises(SystemExit) as stop:
            main(["demo", "--device", bad])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
