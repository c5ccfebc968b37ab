"""Checking a settings dataclass against its own annotations: every field of the annotated type,
within its range or among its choices, or an error naming the field and what it accepts.

The settings of every drafter (`options=`) and every head config call `check_fields` from
`__post_init__`, so a wrong value is refused where it is given instead of failing later inside a
comparison or a tensor shape. A leaf: it imports nothing of ours.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any

Range = tuple[float | None, float | None]  # (lowest, highest) allowed, inclusive; None: unbounded


def check_fields(
    settings: Any, ranges: dict[str, Range] | None = None, choices: dict[str, Iterable[Any]] | None = None
) -> None:
    """Raise TypeError for a field whose value is not of its annotated type, ValueError for one
    outside `ranges` or not among `choices`; each message names the field and the valid values."""
    owner = type(settings).__name__
    hints = typing.get_type_hints(type(settings))
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        expected = hints[field.name]
        if not _matches(value, expected):
            got = f"{value!r} ({type(value).__name__})"
            raise TypeError(f"`{field.name}` of {owner} must be {_describe(expected)}, got {got}.")
        low, high = (ranges or {}).get(field.name, (None, None))
        if (low is not None and value < low) or (high is not None and value > high):
            raise ValueError(
                f"`{field.name}` of {owner} must be {_describe(expected)} {_describe_range(low, high)}, "
                f"got {value!r}."
            )
        allowed = list((choices or {}).get(field.name, ()))
        if allowed and value not in allowed:
            raise ValueError(
                f"`{field.name}` of {owner} must be one of {', '.join(map(repr, allowed))}, got {value!r}."
            )


def _matches(value: Any, expected: Any) -> bool:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in args)
    if origin is typing.Literal:
        return value in args
    if expected is type(None):
        return value is None
    if expected is bool:
        return type(value) is bool
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(key, args[0]) for key in value)
    return isinstance(value, origin or expected)


def _describe(expected: Any) -> str:
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm) for arm in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    names = {bool: "True or False", int: "an integer", float: "a number", str: "a string", dict: "a dict"}
    return names.get(origin or expected, getattr(expected, "__name__", str(expected)))


def _describe_range(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"from {low} to {high}"
    return f">= {low}" if low is not None else f"<= {high}"
