"""`hf-specdec demo` end to end on the real SmolLM2 model (few tokens, to stay quick)."""

from __future__ import annotations

from hf_specdec.cli import main
from hf_specdec.loading import native_bf16


def test_demo_runs_and_reports_no_mismatch(smollm2_path, capsys):
    assert main(["demo", "--max-new-tokens", "12", "--model", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "Overall: plain" in out and "speedup" in out
    dtype = "bfloat16" if native_bf16() else "float32"  # the checkpoint's, or fp32 where bf16 is emulated
    assert f"Running in dtype {dtype}, device cpu" in out
    assert "0 mismatches" in out and "native bf16" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out
