"""`hf-specdec` command line: a thin layer over the library, one module per command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module in hf_specdec/commands/ defines `register(subparsers)` that adds one sub-command
# whose parser sets `func` to a callable taking the parsed args and returning an exit code.
_COMMANDS = ("bench", "demo", "export_onnx", "export_serving", "select", "train_draft")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-specdec",
        description="Lossless speculative decoding for Hugging Face transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"hf_specdec.commands.{name}")
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
    except (ValueError, TypeError, OSError) as err:
        # What the library raises for bad input says what to do: print it, not a traceback.
        if os.environ.get("HF_SPECDEC_TRACEBACK"):
            raise
        print(f"hf-specdec {args.command}: error: {err}", file=sys.stderr)
        print("(HF_SPECDEC_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
