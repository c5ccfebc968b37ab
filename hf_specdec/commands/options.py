"""Command-line options that several commands share."""

from __future__ import annotations

import argparse

from ..loading import DTYPE_CHOICES


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    """`--dtype` and `--device`, read by `hf_specdec.loading.load_model`."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="model dtype (default auto: the checkpoint's own, float32 for a bf16/fp16 checkpoint on a "
        "CPU without native bf16)",
    )
    parser.add_argument(
        "--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)"
    )
