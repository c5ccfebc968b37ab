"""`hf-specdec export-serving` (hf_specdec_cli/export_serving.py): prints the command, writes serving.json,
and exits 1 with the refusal's message."""

from __future__ import annotations

import json

import pytest

from hf_specdec.cli import main
from hf_specdec.serving.plans import REFUSALS


def test_cli_prints_the_command_and_writes_serving_json(models, tmp_path, capsys):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "vllm", "--method", "ngram"]
        + ["--num-draft-tokens", "4", "--option", "min_ngram=1", "--out", str(tmp_path)]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert out.startswith(f"vllm serve {models / 'target'} --speculative-config ")
    config = json.loads((tmp_path / "serving.json").read_text())["speculative_config"]
    assert config == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert "note: " in err


def test_cli_refusal_exits_1_with_the_message(models, tmp_path, capsys):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "sglang", "--method", "quantized"]
        + ["--out", str(tmp_path)]
    )
    assert code == 1
    assert "error: method 'quantized' drafts with an int8 copy" in capsys.readouterr().err


@pytest.mark.parametrize("method", sorted(REFUSALS))
def test_cli_prints_each_refusal_as_the_error(models, tmp_path, capsys, method):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "vllm", "--method", method]
        + ["--num-draft-tokens", "3", "--out", str(tmp_path)]
    )
    assert code == 1
    assert capsys.readouterr().err == f"error: {REFUSALS[method]}\n"


@pytest.mark.parametrize(
    "model, extra, message",
    [
        (
            "{target}",
            ["--num-draft-tokens", "3", "--from-bench", "results.json"],
            "both set the draft length",
        ),
        ("/no/such/model", ["--num-draft-tokens", "3"], "'/no/such/model' is neither a local folder nor"),
    ],
)
def test_cli_refuses_what_it_used_to_take_without_a_word(models, tmp_path, capsys, model, extra, message):
    """--from-bench beside --num-draft-tokens was ignored; a target path that does not exist was
    written into the serve command (with --method given)."""
    code = main(
        ["export-serving", model.format(target=models / "target"), "--engine", "vllm", "--method", "ngram"]
        + extra
        + ["--out", str(tmp_path)]
    )
    assert code == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "serving.json").exists()
