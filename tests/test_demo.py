"""`hf-specdec demo` end to end on the real SmolLM2 model (few tokens, to stay quick)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_specdec.cli import main
from hf_specdec.loading import native_bf16

from .conftest import tiny_llama
from .helpers.tokenizers import byte_level_bpe


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


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a small byte-level tokenizer, saved: the demo in seconds."""
    tokenizer = byte_level_bpe(300)
    folder = tmp_path_factory.mktemp("tiny-demo")
    tiny_llama(0, len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_draft_goes_to_the_method_named(tiny_folder, tmp_path, capsys):
    """--draft was loaded as a draft model whatever --method said: an export-onnx folder for
    --method onnx failed to load ("no file named model.safetensors"), and --method ngram --draft X
    ran draft_model under the user's nose."""
    from hf_specdec.ort import export_onnx

    export = tmp_path / "onnx"
    export_onnx(str(tiny_folder), export, progress=False)
    argv = ["demo", "--model", str(tiny_folder), "--max-new-tokens", "6"]
    assert main([*argv, "--method", "onnx", "--draft", str(export)]) == 0
    assert "Method onnx:" in capsys.readouterr().out
    assert main([*argv, "--method", "ngram", "--draft", str(tiny_folder)]) == 2
    assert "method='ngram' drafts without a draft of yours" in capsys.readouterr().err


def test_a_method_refusing_its_arguments_says_so_before_the_prompts(tiny_folder, capsys, monkeypatch):
    """The speculative call is warmed up with plain's: a method missing its draft was refused only
    at the first prompt's speculative run, after plain had run on it."""
    monkeypatch.delenv("HF_SPECDEC_TRACEBACK", raising=False)
    assert main(["demo", "--model", str(tiny_folder), "--method", "eagle"]) == 2
    captured = capsys.readouterr()
    assert "method='eagle' needs a trained head" in captured.err
    assert "Prompt 1/3" not in captured.out


def test_a_run_that_verified_no_draft_says_so(tiny_folder, capsys):
    """One new token is the prompt's forward's: no step verified a draft, which the overall line
    gave as "acceptance rate 0%, ..., τ 0.00 per speculative step"."""
    assert main(["demo", "--model", str(tiny_folder), "--max-new-tokens", "1", "--method", "ngram"]) == 0
    overall = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Method "))
    assert overall.startswith("Method ngram: no draft verified: plain decoding throughout, 0 speculative")
