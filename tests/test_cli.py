"""The `hf-specdec` command line answers `--help` and argument errors without importing torch,
transformers or `hf_specdec` (whose import adds `speculative=` to generate() and takes seconds)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_specdec import cli
from hf_specdec_cli import build_parser, main

from .conftest import child_env, tiny_llama

ROOT = Path(__file__).resolve().parents[1]

# Runs the console script's entry point (read from pyproject.toml, so a script pointed back into
# `hf_specdec` fails here) on each argv, then reports the exit codes and the heavy modules loaded.
# The last argv is the control: `--device` is checked with torch, so torch must show up after it.
_CHILD = """
import importlib, json, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
entry = tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"]["hf-specdec"]
module, _, name = entry.partition(":")
main = getattr(importlib.import_module(module), name)

def heavy():
    return sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "hf_specdec"})

codes = []
for argv in json.loads(sys.argv[1]):
    try:
        codes.append(main(argv))
    except SystemExit as exit_:
        codes.append(exit_.code)
    print(json.dumps({"argv": argv, "code": codes[-1], "heavy": heavy()}), file=sys.stderr)
"""


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _subcommands() -> list[str]:
    return list(_subparsers())


def test_every_option_says_what_it_does():
    silent = [
        f"{name} {'/'.join(option.option_strings) or option.dest}"
        for name, parser in _subparsers().items()
        for option in parser._actions
        if not option.help and not isinstance(option, argparse._HelpAction)
    ]
    assert not silent, f"options without help text: {silent}"


def test_a_help_text_that_says_see_a_page_names_one_that_documents_the_option():
    wrong = []
    for name, parser in _subparsers().items():
        for option in parser._actions:
            for page in re.findall(r"\bsee ([\w/.-]+)", option.help or ""):
                file = ROOT / page
                if not (file.is_file() and any(s in file.read_text() for s in option.option_strings)):
                    wrong.append(f"{name} {'/'.join(option.option_strings)}: see {page}")
    assert not wrong, wrong


def test_help_and_argument_errors_import_neither_torch_nor_the_library():
    cases = [
        (["--help"], 0),
        ([], 2),  # no command: the help, exit 2
        *(([sub, "--help"], 0) for sub in _subcommands()),
        (["--bogus"], 2),
        (["bench", "--bogus"], 2),
        (["demo", "--max-new-tokens", "many"], 2),
        (["export-serving", "some/model"], 2),  # --engine and --out are required
        (["train-draft", "--out", "x", "--minutes", "soon"], 2),
        (["train-draft", "--out", "x", "--target-layers", "1,x"], 2),
    ]
    control = (["demo", "--device", "cpu", "--help"], 0)
    argvs = [argv for argv, _ in [*cases, control]]
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(argvs)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    reports = [json.loads(line) for line in child.stderr.splitlines() if line.startswith('{"argv"')]
    assert [r["argv"] for r in reports] == argvs, child.stderr
    for report, (_, code) in zip(reports, [*cases, control]):
        assert report["code"] == code, report
    loaded = {tuple(r["argv"]): r["heavy"] for r in reports}
    assert all(not loaded[tuple(argv)] for argv, _ in cases), loaded
    assert "torch" in loaded[tuple(control[0])], "the control imports torch: the check must see it"


@pytest.mark.parametrize(
    "argv, names",
    [
        (["bench", "--suite", "nope"], "hf_specdec.bench.suites:SUITES"),
        (["train-draft", "--out", "x", "--method", "nope"], "hf_specdec.heads:TRAINED_METHODS"),
        (["export-serving", "m", "--engine", "vllm", "--method", "nope"], "hf_specdec.drafters:DRAFTERS"),
        (["demo", "--dtype", "nope"], "hf_specdec.loading:DTYPE_CHOICES"),
        (["demo", "--method", "nope"], "hf_specdec.drafters:DRAFTERS"),
    ],
)
def test_a_name_the_library_does_not_list_is_refused_with_the_librarys_names(argv, names, capsys):
    """The choices are the library's own lists, read when the option is given (not copied here): such
    an error waits for the library's import, the others do not."""
    module, attribute = names.split(":")
    listed = getattr(importlib.import_module(module), attribute)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'nope' is none of" in err, err
    assert all(name in err for name in listed), err


def test_target_layers_that_are_not_numbers_are_refused_naming_the_option(capsys):
    """`--target-layers 1,x` answered "invalid literal for int() with base 10: 'x'", naming neither the
    option nor what it takes."""
    with pytest.raises(SystemExit) as exit_:
        main(["train-draft", "--out", "x", "--method", "dflash", "--target-layers", "1,x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "argument --target-layers: '1,x' is not comma-separated layer indices" in err


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_demo_refuses_a_max_new_tokens_that_is_not_positive_before_loading(value, capsys):
    """`hf-specdec demo --max-new-tokens 0` loaded the model, warmed it up and ran into
    transformers' own refusal at the first prompt, seconds later."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--max-new-tokens", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument --max-new-tokens: {value!r} is not a positive integer" in err, err


def test_export_onnx_names_a_model_path_that_does_not_exist(tmp_path, capsys):
    """huggingface_hub's "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" answered a
    mistyped folder, as `demo --model` and `bench --model` no longer do."""
    assert main(["export-onnx", "/no/such/model", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'/no/such/model' is neither a model folder that exists nor a Hub repo id" in err, err
    assert not (tmp_path / "out").exists()


def _exit_code(argv: list[str]) -> object:
    """What `hf-specdec ARGV` exits with: main's return value, or the code of the SystemExit it raised
    (a message given as the code exits 1)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export-serving", "a/b", "--engine", "vllm", "--num-draft-tokens", "many"], "--num-draft-tokens"),
        (
            ["export-serving", "a/b", "--engine", "vllm", "--option", "max_ngram"],
            "argument --option: 'max_ngram' is not KEY=VALUE",
        ),
        (
            ["export-serving", "/no/such/model", "--engine", "vllm", "--method", "ngram"]
            + ["--num-draft-tokens", "3"],
            "'/no/such/model' is neither a local folder nor a Hub repo id",
        ),
        (["select", "/no/such/model"], "'/no/such/model' is neither a local folder nor a Hub repo id"),
        (["bench", "--batch-sizes", "0"], "--batch-sizes takes positive integers"),  # bench exited 2 already
        (["export-onnx", "/no/such/model"], "is neither a model folder that exists nor a Hub repo id"),
    ],
)
def test_input_a_command_refuses_exits_2_as_argparse_does(argv, message, tmp_path, capsys):
    """bench exited 2 for input it refused, export-serving and select 1 (export-serving's malformed
    --num-draft-tokens or --option: 1 as well, by SystemExit's message), so a script could not tell
    a bad call from a failed run. Input refused exits 2, as argparse's own errors do; a run that
    failed, 1."""
    out = str(tmp_path / "out")
    argv = argv + (["--out", out] if argv[0] in ("bench", "export-serving") else [])
    argv = argv + ([out] if argv[0] == "export-onnx" else [])
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err


def test_every_command_says_what_it_does():
    """`hf-specdec demo --help` printed its options with no line of what the command does."""
    silent = [name for name, parser in _subparsers().items() if not parser.description]
    assert not silent, f"commands without a description: {silent}"


def test_export_onnx_of_a_model_torch_onnx_cannot_export_says_what_to_do(tmp_path, monkeypatch, capsys):
    """A checkpoint saved with torchao's int8 weights (loaded with `requires_grad` set on them)
    ended `export-onnx` in torch.onnx's traceback, "Only Tensors of floating point and complex
    dtype can require gradients", and its advice to file an issue with PyTorch; the exporter's
    failure is stubbed here, as torchao is not among the test dependencies."""
    import torch

    from hf_specdec.ort import export as ort_export

    def export(*args, **kwargs):
        raise torch.onnx.OnnxExporterError(
            "Only Tensors of floating point and complex dtype can require gradients"
        )

    monkeypatch.setattr(ort_export, "_export", export)
    folder = tmp_path / "model"
    tiny_llama(3, layers=1).save_pretrained(folder)
    assert main(["export-onnx", str(folder), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"torch.onnx could not export {folder}" in err, err
    assert "export the unquantized checkpoint" in err, err


def test_ctrl_c_ends_a_command_with_one_line_and_130(monkeypatch, capsys):
    """Ctrl-C while `hf-specdec demo` loaded or generated printed a traceback through torch's
    modules; a command stopped by the user says so and exits 130, as `bench` does."""
    from hf_specdec import loading

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "load_model", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "hf-specdec demo: interrupted\n"


@pytest.mark.parametrize("module", ["hf_specdec_cli", "hf_specdec.cli"])
def test_python_m_runs_the_command_line(module):
    """`python -m hf_specdec_cli` (fast) and `python -m hf_specdec.cli` (imports the package first)."""
    child = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, env=child_env(), capture_output=True, text=True
    )
    assert child.returncode == 0 and child.stdout.startswith("usage: hf-specdec"), child.stderr
    assert cli.main is main
