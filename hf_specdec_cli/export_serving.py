"""`hf-specdec export-serving MODEL --engine vllm|sglang --out DIR`: serve the same speculation at scale."""

from __future__ import annotations

import argparse
import json
import sys

from .options import draft_tokens, key_value, one_of


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-serving",
        help="write the vLLM or SGLang command that serves MODEL with the same speculation",
        description="Map what speculative=... runs for MODEL onto vLLM's speculative_config or SGLang's "
        "--speculative-* flags, write DIR/serving.json (command, config, caveats; a head converted to the "
        "engine's layout beside it) and print the command.",
    )
    parser.add_argument("model", metavar="MODEL", help="the target: a Hub repo id or a local folder")
    parser.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        required=True,
        help="the serving engine to write the command for",
    )
    parser.add_argument(
        "--method",
        default="auto",
        type=one_of("hf_specdec.drafters:DRAFTERS", "auto"),
        help="a drafter's name (ngram, eagle, mtp ...; default auto: what speculative=True picks for MODEL, "
        "or what runs the --draft given, by what it is)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="a folder or Hub repo id: a draft model, an ONNX export, a head or block draft, an assistant",
    )
    parser.add_argument(
        "--head",
        default=None,
        metavar="[METHOD=]FOLDER",
        help="a trained head or block draft (a folder or Hub repo id), ours or published; METHOD=FOLDER, "
        "as bench takes it (e.g. eagle=my-eagle-head), names its method, as --method does (default: "
        "the method of what it holds, else eagle)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        default="auto",
        type=draft_tokens,
        help='tokens drafted per step, or "auto" (default): measured with the adaptive policy',
    )
    parser.add_argument(
        "--from-bench", default=None, metavar="FILE", help="take the measured length from bench results.json"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        type=key_value,
        metavar="KEY=VALUE",
        help="a drafter option, e.g. --option max_ngram=3 (repeatable)",
    )
    parser.add_argument("--out", required=True, help="folder for serving.json")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_specdec.serving import ServingExportError, command_line, export_serving

    try:
        method, head = _method_and_head(args.method, args.head)
        result = export_serving(
            args.model,
            args.engine,
            method=method,
            draft=args.draft,
            head=head,
            num_draft_tokens=args.num_draft_tokens,
            options=_options(args.option),
            from_bench=args.from_bench,
            out=args.out,
        )
    except (ServingExportError, ValueError) as err:  # input refused: 2, as argparse's own errors
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(command_line(result))
    for caveat in result["caveats"]:
        print(f"note: {caveat}", file=sys.stderr)
    print(f"Wrote {args.out}/serving.json", file=sys.stderr)
    return 0


def _method_and_head(method: str, head: str | None) -> tuple[str, str | None]:
    """--method and --head's folder, for --head given as bench takes it (METHOD=FOLDER) or alone
    (a path that exists is a folder, even with a '=' in its name)."""
    from pathlib import Path

    from hf_specdec.heads import TRAINED_METHODS

    named, sep, folder = (head or "").partition("=")
    if not sep or named not in TRAINED_METHODS or Path(head).exists():
        return method, head
    if method not in ("auto", named):
        raise ValueError(f"--head {named}=... names method {named}, --method {method}: drop one of them.")
    return named, folder


def _options(items: list[tuple[str, str]]) -> dict[str, object]:
    options: dict[str, object] = {}
    for key, value in items:
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options
