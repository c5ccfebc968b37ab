"""`hf-specdec export-serving` (hf_specdec_cli/export_serving.py): prints the command, writes serving.json,
and exits 2 (input refused) with the refusal's message."""

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


def test_cli_refusal_exits_2_with_the_message(models, tmp_path, capsys):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "sglang", "--method", "quantized"]
        + ["--out", str(tmp_path)]
    )
    assert code == 2
    assert "error: method 'quantized' drafts with an int8 copy" in capsys.readouterr().err


@pytest.mark.parametrize("method", sorted(REFUSALS))
def test_cli_prints_each_refusal_as_the_error(models, tmp_path, capsys, method):
    code = main(
        ["export-serving", str(models / "target"), "--engine", "vllm", "--method", method]
        + ["--num-draft-tokens", "3", "--out", str(tmp_path)]
    )
    assert code == 2
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
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "serving.json").exists()


@pytest.mark.parametrize("extra", [[], ["--method", "ngram", "--num-draft-tokens", "3"]])
def test_cli_refuses_a_target_that_is_not_a_causal_lm(t5_folder, tmp_path, capsys, extra):
    """`export-serving ./t5` printed AutoModelForCausalLM's list of every causal config class (as it
    loaded the target to measure a draft length), or, with the method and length given, wrote a
    command serving a T5 with prompt lookup."""
    code = main(["export-serving", str(t5_folder), "--engine", "vllm", *extra, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{t5_folder} is a t5 model (T5ForConditionalGeneration), not a causal LM" in err
    assert err.count("\n") == 1 and len(err) < 400, err
    assert not (tmp_path / "serving.json").exists()


def test_cli_takes_a_head_as_bench_does_too(models, tmp_path, capsys):
    """bench takes --head METHOD=FOLDER, export-serving took --head FOLDER only: the form bench took,
    copied over, was read as a folder named 'eagle=...'. Both forms now export the same; a METHOD=
    that --method contradicts is refused."""
    head = models / "head-eagle3"
    exported = {}
    for form in (str(head), f"eagle={head}"):
        out = tmp_path / str(len(exported))
        argv = ["export-serving", str(models / "target8"), "--engine", "vllm", "--head", form]
        assert main([*argv, "--num-draft-tokens", "3", "--out", str(out)]) == 0
        exported[form] = json.loads((out / "serving.json").read_text().replace(str(out), "OUT"))
    assert exported[str(head)] == exported[f"eagle={head}"]
    assert exported[str(head)]["speculative_config"]["method"] == "eagle3"
    argv = ["export-serving", str(models / "target8"), "--engine", "vllm", "--method", "medusa"]
    assert main([*argv, "--head", f"eagle={head}", "--out", str(tmp_path / "x")]) == 2
    assert "--head eagle=... names method eagle, --method medusa" in capsys.readouterr().err
