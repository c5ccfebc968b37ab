"""`hf-specdec` command line: a thin layer over the library, one module per command.

A package beside `hf_specdec`, not inside it: importing anything in `hf_specdec` runs its
`__init__`, which imports torch and transformers (seconds) to add `speculative=` to `generate()`.
Here the arguments are parsed with the standard library alone, so `--help` and a mistyped option
answer at once; a command imports the library in its `run`, once its arguments parse.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module of this package named here defines `register(subparsers)` that adds one sub-command
# whose parser sets `func` to a callable taking the parsed args and returning an exit code. Nothing
# a module imports when it is loaded may be heavier than the standard library (tests/test_cli.py).
_COMMANDS = ("bench", "demo", "export_onnx", "export_serving", "select", "train_draft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers.",
        epilog="Exit status: 0 done; 1 a run that failed (a benchmark row on every prompt, a demo output "
        "that differs from plain generate's, a Hub that would not show the target); 2 arguments or "
        "input refused, as argparse exits for a malformed option; 130 interrupted.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # the user stopped it: no traceback through torch's modules
        if os.environ.get("HF_SPECDEC_TRACEBACK"):
            raise
        print(f"hf-specdec {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as err:
        # What the library raises for bad input says what to do: print it, not a traceback.
        if os.environ.get("HF_SPECDEC_TRACEBACK"):
            raise
        print(f"hf-specdec {args.command}: error: {err}", file=sys.stderr)
        print("(HF_SPECDEC_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2
