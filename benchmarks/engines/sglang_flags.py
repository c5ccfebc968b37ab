"""Every SGLang flag `export-serving` writes, checked against the sglang wheel's own argument definitions.

    python benchmarks/engines/sglang_flags.py   # downloads sglang 0.5.23 (--no-deps, ~39 MB)
    python benchmarks/engines/sglang_flags.py --wheel sglang-0.5.23-*.whl --serving-json serve/serving.json
    python benchmarks/engines/sglang_flags.py --write-list   # refresh tests/golden/sglang_flags.json

SGLang needs a GPU, so nothing is launched and sglang is never imported: the wheel is read as a zip
and its sources parsed with `ast`. What 0.5.23 accepts on the command line (`launch_server`):

- `ServerArgs.add_cli_args` (`sglang/srt/server_args.py`) calls `add_cli_args_from_dataclass`
  (`sglang/srt/arg_groups/arg_utils.py`) over the fields declared as `name: A[T, "help" | Arg(...)]`
  in the namespace classes of `sglang/srt/arg_groups/fields/*.py`: the flag is `--` + the field name
  with dashes, or `Arg(cli_name=...)`, plus `Arg(aliases=[...])`; `Arg(no_cli=True)` fields have no
  flag. Choices come from `Literal[...]` types or `Arg(choices=[...])`. It then adds a few flags by
  hand with `parser.add_argument("--...")`, collected here too.
- `--speculative-algorithm` is a free string checked later by `SpeculativeAlgorithm.from_string`
  (`sglang/srt/speculative/spec_info.py`): an enum member name, upper-cased, or an alias of EAGLE
  or a plugin; the builtin members are read from the enum.
- `python -m sglang.launch_server` needs `sglang/launch_server.py`.

The commands checked: the SGLang golden files of `tests/serving/test_export.py` (what `export_serving`
writes for ngram, draft_model, an EAGLE-3 head and onnx, asserted there), `export_serving` for the
published EAGLE-1 and EAGLE-3 heads the registry knows (no download: they are served by name), and
any `serving.json` given. Exit status 1 when a flag, a value's type or a choice is not accepted.

`--write-list` records what the tests need to check new exports offline in
`tests/golden/sglang_flags.json` (the wheel's file name and sha256, every flag with its type and
choices, the algorithm names): `tests/serving/test_engines.py` checks our SGLang commands against it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from hf_specdec.serving import SGLANG_VERSION, export_serving

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "serving"
FLAG_LIST = ROOT / "tests" / "golden" / "sglang_flags.json"
FIELDS = "sglang/srt/arg_groups/fields/"
SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
LAUNCHER = "sglang/launch_server.py"
# Published heads the registry knows, served by name (as in tests/serving/test_engines.py).
PUBLISHED = {
    "EAGLE-1 head": ("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B"),
    "EAGLE-3 head": ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--wheel", type=Path, default=None, help="a downloaded sglang wheel (else pip download)"
    )
    parser.add_argument("--serving-json", type=Path, nargs="*", default=[], help="more serving.json to check")
    parser.add_argument("--out", type=Path, default=None, help="write the findings as JSON")
    parser.add_argument("--write-list", action="store_true", help=f"write {FLAG_LIST.relative_to(ROOT)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(Path(tmp))
        accepted = read_wheel(wheel)
    commands = our_commands(args.serving_json)
    findings = {name: check_command(command, accepted) for name, command in commands.items()}
    print(f"sglang {accepted['version']} ({accepted['wheel']}): {len(accepted['flags'])} flags")
    print("| export | command | problems |\n|---|---|---|")
    for name, problems in findings.items():
        shown = " ".join(commands[name][3:])
        print(f"| {name} | `{shown}` | {'; '.join(problems) or 'none'} |")
    failed = {name: problems for name, problems in findings.items() if problems}
    if args.out:
        report = {"wheel": accepted["wheel"], "sha256": accepted["sha256"], "commands": commands}
        args.out.write_text(json.dumps(report | {"problems": findings}, indent=2) + "\n")
    if args.write_list:
        FLAG_LIST.write_text(flag_list(accepted))
        print(f"Wrote {FLAG_LIST.relative_to(ROOT)}")
    print("FAIL" if failed else "PASS: every flag, value type and choice is accepted by this sglang")
    return 1 if failed else 0


def download(folder: Path) -> Path:
    """The sglang wheel export-serving writes for, by pip (no dependencies: nothing is installed)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={SGLANG_VERSION}",
            "--no-deps",
            "-q",
            "-d",
            str(folder),
        ],
        check=True,
    )
    return next(folder.glob("sglang-*.whl"))


# --- what the wheel accepts ---------------------------------------------------------------------


def read_wheel(wheel: Path) -> dict[str, Any]:
    """Flags (name -> {"type", "choices"}) and speculative algorithm names of an sglang wheel."""
    flags: dict[str, dict[str, Any]] = {}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for name in sorted(n for n in names if n.startswith(FIELDS) and n.endswith(".py")):
            for flag, spec in field_flags(ast.parse(archive.read(name))).items():
                flags[flag] = spec | {"from": name.removeprefix("sglang/srt/")}
        for flag, spec in manual_flags(ast.parse(archive.read(SERVER_ARGS))).items():
            flags.setdefault(flag, spec | {"from": SERVER_ARGS.removeprefix("sglang/srt/")})
        algorithms = enum_members(ast.parse(archive.read(SPEC_INFO)), "SpeculativeAlgorithm")
        has_launcher = LAUNCHER in names
    return {
        "package": "sglang",
        "version": wheel.name.split("-")[1],
        "wheel": wheel.name,
        "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "read": f"{FIELDS}*.py, {SERVER_ARGS}, {SPEC_INFO} (by benchmarks/engines/sglang_flags.py)",
        "launch_server": has_launcher,
        "speculative_algorithms": sorted(a for a in algorithms if a != "NONE"),
        "flags": dict(sorted(flags.items())),
    }


def field_flags(tree: ast.Module) -> dict[str, dict[str, Any]]:
    """`name: A[T, "help" | Arg(...)]` class fields -> their flags (as `add_cli_args_from_dataclass`)."""
    found: dict[str, dict[str, Any]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = node.annotation
        if not (isinstance(annotation, ast.Subscript) and _name(annotation.value) == "A"):
            continue
        parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if len(parts) < 2:
            continue
        kind, meta = parts[0], parts[1]
        options = _arg_keywords(meta)
        if options.get("no_cli") is True:
            continue
        spec = {"type": _type_name(kind), "choices": options.get("choices") or _literal_values(kind)}
        for flag in [options.get("cli_name") or "--" + node.target.id.replace("_", "-")] + list(
            options.get("aliases") or []
        ):
            found[flag] = spec
    return found


def manual_flags(tree: ast.Module) -> dict[str, dict[str, Any]]:
    """`parser.add_argument("--x", ...)` calls: flags added by hand."""
    found: dict[str, dict[str, Any]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            names = [
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            ]
            keywords = {k.arg: k.value for k in node.keywords}
            # an action without a type (store_true and its deprecated variants) takes no value
            kind = (
                _name(keywords["type"]) if "type" in keywords else "bool" if "action" in keywords else "str"
            )
            choices = _constant(keywords["choices"]) if "choices" in keywords else None
            for name in names:
                found[name] = {"type": kind, "choices": choices if isinstance(choices, list) else None}
    return found


def enum_members(tree: ast.Module, enum: str) -> list[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == enum:
            return [
                target.id
                for statement in node.body
                if isinstance(statement, ast.Assign)
                for target in statement.targets
                if isinstance(target, ast.Name)
            ]
    raise ValueError(f"No enum {enum} in the wheel: its speculative algorithms moved; update this script.")


def _arg_keywords(meta: ast.expr) -> dict[str, Any]:
    """`Arg(...)` keywords whose values are literals; a bare help string has none."""
    if not (isinstance(meta, ast.Call) and _name(meta.func) == "Arg"):
        return {}
    return {k.arg: _constant(k.value) for k in meta.keywords if k.arg}


def _constant(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:  # a name (a choices list defined elsewhere): not resolved here
        return None


def _literal_values(kind: ast.expr) -> list[Any] | None:
    """The values of `Literal[...]`, also inside `Optional[...]`."""
    if isinstance(kind, ast.Subscript):
        if _name(kind.value) == "Literal":
            values = kind.slice.elts if isinstance(kind.slice, ast.Tuple) else [kind.slice]
            return [_constant(v) for v in values]
        if _name(kind.value) == "Optional":
            return _literal_values(kind.slice)
    return None


def _type_name(kind: ast.expr) -> str:
    if isinstance(kind, ast.Subscript) and _name(kind.value) == "Optional":
        return _type_name(kind.slice)
    if isinstance(kind, ast.Subscript):
        return _name(kind.value) or "?"
    return _name(kind) or "?"


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def flag_list(accepted: dict[str, Any]) -> str:
    """`accepted` as JSON with one flag a line (a reviewable diff when the wheel changes)."""
    head = {key: value for key, value in accepted.items() if key != "flags"}
    lines = [json.dumps(head, indent=1)[:-2] + ',\n "flags": {']
    flags = [f"  {json.dumps(flag)}: {json.dumps(spec)}" for flag, spec in accepted["flags"].items()]
    return "\n".join(lines + [",\n".join(flags), " }", "}"]) + "\n"


# --- what we write ------------------------------------------------------------------------------


def our_commands(extra: list[Path]) -> dict[str, list[str]]:
    """SGLang commands `export-serving` writes: the golden files, published heads, extra files."""
    commands = {
        path.stem: json.loads(path.read_text())["command"] for path in sorted(GOLDEN.glob("sglang-*.json"))
    }
    for name, (target, head) in PUBLISHED.items():
        commands[f"sglang-published {name}"] = export_serving(
            target, "sglang", head=head, num_draft_tokens=3
        )["command"]
    for path in extra:
        result = json.loads(path.read_text())
        if result.get("engine") == "sglang":
            commands[str(path)] = result["command"]
    return commands


def check_command(command: list[str], accepted: dict[str, Any]) -> list[str]:
    """What in `command` this sglang would refuse (empty: nothing)."""
    problems = []
    if command[:3] != ["python", "-m", "sglang.launch_server"] or not accepted["launch_server"]:
        problems.append(f"not a `python -m sglang.launch_server` command: {command[:3]}")
    args = command[3:]
    i = 0
    while i < len(args):
        flag = args[i]
        spec = accepted["flags"].get(flag)
        if spec is None:
            problems.append(f"unknown flag {flag}")
            i += 1 if i + 1 == len(args) or args[i + 1].startswith("--") else 2  # and its value
            continue
        if spec["type"] == "bool":  # store_true: takes no value
            i += 1
            continue
        value = args[i + 1] if i + 1 < len(args) else None
        problems += _check_value(flag, value, spec, accepted["speculative_algorithms"])
        i += 2
    return problems


def _check_value(flag: str, value: str | None, spec: dict[str, Any], algorithms: list[str]) -> list[str]:
    if value is None or value.startswith("--"):
        return [f"{flag} has no value"]
    if spec["type"] == "int":
        try:
            int(value)
        except ValueError:
            return [f"{flag} takes an integer, not {value!r}"]
    if spec.get("choices") and value not in spec["choices"]:
        return [f"{flag} {value!r} is not one of {spec['choices']}"]
    if flag == "--speculative-algorithm" and value.upper() not in algorithms:
        return [f"--speculative-algorithm {value!r} is not a builtin ({', '.join(algorithms)})"]
    return []


if __name__ == "__main__":
    sys.exit(main())
