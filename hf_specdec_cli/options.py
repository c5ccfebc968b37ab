"""Command-line options that several commands share."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable


def one_of(names: str, default: str | None = None) -> Callable[[str], str]:
    """An argparse type: the option's string `default`, or a name the library lists (`names`:
    "module:ATTRIBUTE"), read only for an option given: importing the library takes seconds, and
    neither `--help` nor an error in another argument should wait for it (argparse passes string
    defaults through the type too, hence `default` passes without the import)."""
    module, attribute = names.split(":")

    def check(value: str) -> str:
        if value == default:
            return value
        listed = getattr(importlib.import_module(module), attribute)
        choices = list(dict.fromkeys([*([default] if default else []), *listed]))
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{value!r} is none of {', '.join(choices)}")
        return value

    check.__name__ = attribute.lower()  # how argparse names the type in its messages
    return check


def positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1, refused before a model loads."""
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return int(value)


def draft_tokens(value: str) -> int | str:
    """An argparse type: "auto", or a positive number of tokens drafted per step."""
    if value == "auto":
        return value
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f'{value!r} is neither a positive integer nor "auto"')
    return int(value)


def key_value(value: str) -> tuple[str, str]:
    """An argparse type: KEY=VALUE, as (KEY, VALUE)."""
    key, sep, rest = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    return key, rest


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    """`--dtype` and `--device`, read by `hf_specdec.loading.load_model`."""
    parser.add_argument(
        "--dtype",
        default="auto",
        type=one_of("hf_specdec.loading:DTYPE_CHOICES", "auto"),
        help="model dtype, e.g. bfloat16 (default auto: the checkpoint's own, float32 for a bf16/fp16 "
        "checkpoint on a CPU without native bf16)",
    )
    parser.add_argument(
        "--device",
        default=None,
        type=device,
        help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)",
    )


def device(value: str) -> str:
    """An argparse type: a device torch knows and this machine has (refused before a model loads).
    argparse calls it only for a `--device` given, so torch is imported only then."""
    import torch

    try:
        parsed = torch.device(value)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"{value!r} is not a torch device: {err}") from None
    if parsed.type in ("cpu", "meta"):
        return value
    backend = getattr(torch, parsed.type, None)
    available = getattr(backend, "is_available", lambda: False)()
    count = getattr(backend, "device_count", lambda: 1)() if available else 0
    if not available or (parsed.index is not None and parsed.index >= count):
        raise argparse.ArgumentTypeError(
            f"{value!r}: this machine's torch ({torch.__version__}) has {count} {parsed.type} device(s); "
            "pass --device cpu, or leave --device out"
        )
    return value
