"""transformers' own assisted-decoding and prompt-lookup tests, run against transformers and against us.

    python benchmarks/engines/upstream_tests.py --transformers PATH [--rev REV] [--archs llama,gpt2,...]
        [--runs stock,ours,ours-tree] [--keep DIR] [--json OUT]

PATH is a transformers git repository (a clone, a bare mirror) or a source tree; REV (default
HEAD) the commit to take the tests from: best the tag of the installed version
(`git clone --depth 1 -b v$(python -c "import transformers; print(transformers.__version__)")
https://github.com/huggingface/transformers`). The tests are not on PyPI: the wheel and the sdist
leave out `tests/generation`, so they come from a checkout, and none of their code is kept here.

What it runs: `GenerationTesterMixin`'s `test_assisted_decoding_matches_greedy_search` (random and
same assistant), `test_assisted_decoding_sample` and `test_prompt_lookup_decoding_matches_greedy_search`
(`tests/generation/test_utils.py`), in every test class of the 14 decoder-only architectures'
`tests/models/<arch>/test_modeling_<arch>.py` (built on `tests/causal_lm_tester.py` and friends), twice:

- `stock`: as upstream runs them, transformers' own assisted generation;
- `ours`: `assistant_model=` / `prompt_lookup_num_tokens=` turned into `speculative=` by
  `benchmarks/engines/upstream_conftest.py`; no assertion is touched (`ours-tree`: the same, drafting trees).

The tests check generate's whole output contract step by step: sequences and scores equal to
plain greedy's, the shapes of scores, logits, attentions and hidden states per generated token,
and the returned cache. The copy is edited twice, so that the tests run rather than pass vacuously
or fail to import: upstream's bare `@is_flaky` (which turns the prompt-lookup test into a
decorator factory that never runs it) becomes `@is_flaky()`; `model_class._is_stateful`, which
transformers 5.2x dropped, is read with a default of False; and where the checkout's test
plumbing imports a name from transformers that the installed version lacks (a checkout newer or
older than the install: testers' defaults, helpers of mixin tests not run here), the conftest
defines it from the checkout's own source and the report header lists it. Use the install's tag
to need none.

Needs transformers' test extras: `pip install parameterized timeout-decorator datasets httpx`.
Prints each test's outcome per run, the pass counts and the distinct errors, and exits non-zero
when a test passes with stock but not with ours (or, without a stock run, fails with ours).
Measured (transformers 5.24.0 installed, tests of huggingface/transformers main at 5.16.0.dev0, 2
CPU cores): stock, ours and ours-tree 60 of 60 each, ~30-40 s a run on a quiet machine (over 200 s
with other jobs on the cores); before issue 20, ours passed 0 of 60.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from hf_specdec.core.timing import clock

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt2",
    "opt",
    "gpt_neox",
    "falcon",
    "starcoder2",
    "olmo2",
)
TESTS = (
    "test_assisted_decoding_matches_greedy_search",
    "test_assisted_decoding_sample",
    "test_prompt_lookup_decoding_matches_greedy_search",
)
RUNS = {
    "stock": {"HF_SPECDEC_UPSTREAM": "stock"},
    "ours": {"HF_SPECDEC_UPSTREAM": "ours"},
    "ours-tree": {"HF_SPECDEC_UPSTREAM": "ours", "HF_SPECDEC_UPSTREAM_TREE": "1"},
}
HERE = Path(__file__).resolve().parent
PYTEST_INI = """[pytest]
markers =
    generate: GenerationTesterMixin tests
    is_training_test: TrainingTesterMixin tests
    is_tensor_parallel_test: TensorParallelTesterMixin tests
    is_fsdp_test: FSDPTesterMixin tests
    flash_attn_test: flash attention tests
    torch_compile_test: torch.compile tests
"""


def extract(source: Path, rev: str, archs: tuple[str, ...], out: Path) -> list[str]:
    """Copy the test plumbing and the architectures' model tests from `source` at `rev` into `out`;
    return the edits made to the copy."""
    for member in ("tests", "utils", "tests/models/__init__.py", *(f"tests/models/{a}" for a in archs)):
        # tests/ without the other ~400 architectures' folders
        _copy(source, rev, member, out, skip="tests/models/" if member == "tests" else None)
    # The conftest defines from the checkout's source what the tests import that the install lacks.
    _copy(source, rev, "src/transformers", out / "checkout")
    # Some test modules load `src/transformers` by path (direct_transformers_import), which would run the
    # checkout's lazy __init__ over the installed package: give them an empty one, which leaves it be.
    (out / "src" / "transformers").mkdir(parents=True)
    (out / "src" / "transformers" / "__init__.py").write_text("# the installed transformers is used\n")
    shutil.copy(HERE / "upstream_conftest.py", out / "conftest.py")
    (out / "pytest.ini").write_text(PYTEST_INI)
    test_utils = out / "tests" / "generation" / "test_utils.py"
    return _run_flaky_tests(test_utils) + _read_stateful_safely(test_utils)


def _is_git(source: Path) -> bool:
    return (source / ".git").exists() or ((source / "HEAD").is_file() and (source / "objects").is_dir())


def _git(source: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(source), *args], check=True, capture_output=True).stdout


def _copy(source: Path, rev: str, member: str, out: Path, skip: str | None = None) -> None:
    """Copy the file or folder `member` of the checkout (at `rev`, for git) to the same path under `out`."""
    if not _is_git(source):
        if (source / member).is_file():
            (out / member).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / member, out / member)
        else:
            ignore = shutil.ignore_patterns(Path(skip).name) if skip else None
            shutil.copytree(source / member, out / member, ignore=ignore, dirs_exist_ok=True)
        return
    with tarfile.open(fileobj=io.BytesIO(_git(source, "archive", rev, member))) as archive:
        members = [m for m in archive.getmembers() if not (skip and m.name.startswith(skip))]
        archive.extractall(out, members=members, filter="data")


def _run_flaky_tests(test_utils: Path) -> list[str]:
    """`@is_flaky` without parentheses makes the test its decorator's factory, so it never runs."""
    text, count = re.subn(r"^(\s*)@is_flaky\s*$", r"\1@is_flaky()", test_utils.read_text(), flags=re.M)
    test_utils.write_text(text)
    return [f"tests/generation/test_utils.py: {count} bare @is_flaky made @is_flaky()"] if count else []


def _read_stateful_safely(test_utils: Path) -> list[str]:
    """transformers 5.2x dropped `PreTrainedModel._is_stateful`, which older tests read off every
    model class (every test would fail with AttributeError): read it with False as the default."""
    pattern = r"(?<![.\w])(\w+)\._is_stateful\b"  # a name's attribute, not one down a chain
    text, count = re.subn(pattern, r'getattr(\1, "_is_stateful", False)', test_utils.read_text())
    test_utils.write_text(text)
    return [f"tests/generation/test_utils.py: {count} `._is_stateful` read with a default"] if count else []


def run(tree: Path, name: str, archs: tuple[str, ...], python: str) -> dict[str, str]:
    """Run the selected tests under `RUNS[name]`; returns {test id: outcome}."""
    report = tree / f"{name}.xml"
    files = [f"tests/models/{a}/test_modeling_{a}.py" for a in archs]
    env = {**os.environ, **RUNS[name], "PYTHONPATH": os.pathsep.join([str(tree), os.getcwd()])}
    args = ["-p", "no:cacheprovider", "-p", "no:warnings", "-rfE", "--continue-on-collection-errors"]
    args += ["-k", " or ".join(TESTS), f"--junitxml={report}", *files]
    with open(tree / f"{name}.log", "w") as log:
        subprocess.run(
            [python, "-m", "pytest", *args], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)
        test_id = f"{module[-1]}.{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[test_id] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", type=Path, required=True, help="a transformers checkout or mirror")
    parser.add_argument("--rev", default="HEAD", help="the commit or tag to take the tests from (git only)")
    parser.add_argument("--archs", default=",".join(ARCHITECTURES))
    parser.add_argument("--runs", default="stock,ours", help=f"any of {', '.join(RUNS)}")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run the tests with")
    parser.add_argument("--keep", type=Path, help="extract into this folder and keep it")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args()
    archs = tuple(args.archs.split(","))
    runs = args.runs.split(",")
    tree = args.keep or Path(tempfile.mkdtemp(prefix="upstream-tests-"))
    if args.keep and tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True, exist_ok=True)
    edits = extract(args.transformers, args.rev, archs, tree)
    commit = (
        _git(args.transformers, "rev-parse", args.rev).decode().strip() if _is_git(args.transformers) else "?"
    )
    outcomes, seconds = {}, {}
    for name in runs:
        start = clock("cpu")  # the tests run in a subprocess, timed whole
        outcomes[name] = run(tree, name, archs, args.python)
        seconds[name] = clock("cpu") - start
    print(f"\ntransformers tests from {args.transformers} at {commit}")
    for edit in edits:
        print(f"edited: {edit}")
    tests = sorted(set().union(*outcomes.values()))
    print(f"\n| test | {' | '.join(runs)} |\n|---|{'---|' * len(runs)}")
    for test in tests:
        print(f"| {test} | {' | '.join(outcomes[n].get(test, '-') for n in runs)} |")
    print()
    for name in runs:
        passed = sum(v == "passed" for v in outcomes[name].values())
        print(f"{name}: {passed} of {len(outcomes[name])} passed ({seconds[name]:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"commit": commit, "edits": edits, "outcomes": outcomes}, indent=2))
    for name in runs:
        for reason, count in _failure_reasons(tree / f"{name}.log").items():
            print(f"{name}: {count} x {reason}")
    # Judged against stock where it ran: a test transformers' own assisted generation fails is no regression.
    reference = outcomes.get("stock")
    regressions = sorted(
        (name, test)
        for name in runs
        if name != "stock"
        for test, outcome in outcomes[name].items()
        if outcome != "passed" and (reference is None or reference.get(test) == "passed")
    )
    for name, test in regressions:
        print(f"REGRESSION {name}: {test}")
    if not args.keep:
        shutil.rmtree(tree)
    sys.exit(1 if regressions else 0)


def _failure_reasons(log: Path) -> dict[str, int]:
    """The distinct exception lines of a pytest log, with how often each occurred."""
    reasons: dict[str, int] = {}
    for line in log.read_text().splitlines():
        if re.match(r"^E\s+\w+(Error|Exception)\b", line):
            reason = line[1:].strip()[:200]
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


if __name__ == "__main__":
    main()
