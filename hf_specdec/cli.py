"""`python -m hf_specdec.cli`: the `hf-specdec` command line, kept at this path for scripts that run it.

The commands live in the `hf_specdec_cli` package beside this one, which the `hf-specdec` console
script runs without importing `hf_specdec` until a command needs it; this path pays for importing
the package first.
"""

from __future__ import annotations

import sys

from hf_specdec_cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
