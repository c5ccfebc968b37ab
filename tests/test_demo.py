"""`hf-specdec demo` end to end on the real SmolLM2 model (few tokens, to stay quick)."""

from __future__ import annotations

from hf_specdec.cli import main


def test_demo_runs_and_reports_identical_outputs(smollm2_path, capsys):
    assert main(["demo", "--max-new-tokens", "12", "--model", str(smollm2_path)]) == 0
    out = capsys.readouterr().out
    assert "Overall: plain" in out and "speedup" in out
    assert "Outputs identical to plain greedy generate: yes" in out


def test_cli_without_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out
