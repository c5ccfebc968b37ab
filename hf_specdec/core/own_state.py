"""State a logits processor or stopping criterion of the user's own keeps from call to call: plain
`generate` calls it once a step for the whole batch, speculation at draft positions and per row, so
one whose state changes would answer otherwise than under plain decoding (`StateGuard`)."""

from __future__ import annotations

import random
import types
from typing import Any

import torch

# What a processor or criterion of one's own may hold without it counting as state it keeps: the
# models, tokenizers and transformers objects it reads (their own state is not the call's).
_READ_ONLY_PACKAGES = ("torch", "transformers", "tokenizers")
# Tensors up to this size are kept by value (one recomputed alike each call is no change), larger
# ones by identity and in-place version; containers past this length by their length (or keys).
_BY_VALUE = 4096


class _TensorState:
    """A small tensor's values, equal to another's where `torch.equal`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().clone()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _TensorState)
            and self.tensor.shape == other.tensor.shape
            and self.tensor.dtype == other.tensor.dtype
            and torch.equal(self.tensor, other.tensor)
        )


def _state(value: Any, depth: int = 4) -> Any:
    """What `value` holds, to compare with `_kept`: plain values, devices and dtypes as they are,
    tensors and random generators by value (large tensors by identity and in-place version),
    containers item by item, functions by what their closures hold, objects of one's own by their
    attributes; anything else by identity."""
    # Devices by value: `tensor.device` is a new object at every access, equal to the last.
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.device, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() <= _BY_VALUE and value.device.type == "cpu":
            return _TensorState(value)
        return ("tensor", id(value), value._version, tuple(value.shape))
    # A generator by its state, before torch's objects go by identity: one the user's code draws
    # from (noise of its own) answers otherwise at every call.
    if isinstance(value, torch.Generator):
        return _TensorState(value.get_state())
    if isinstance(value, random.Random):
        return value.getstate()
    if depth == 0 or type(value).__module__.split(".")[0] in _READ_ONLY_PACKAGES:
        return ("object", id(value))
    if isinstance(value, (list, tuple)):
        if len(value) > _BY_VALUE:
            return (type(value), id(value), len(value))
        return (type(value), tuple(_state(item, depth - 1) for item in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(value))
    if isinstance(value, dict):
        if len(value) > _BY_VALUE:
            return dict.fromkeys(value)
        return {key: _state(item, depth - 1) for key, item in value.items()}
    if isinstance(value, types.MethodType):
        return (_state(value.__func__, depth), _state(value.__self__, depth - 1))
    if isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        return ("function", id(value), tuple(_state(_cell(c), depth - 1) for c in cells))
    if hasattr(value, "__dict__"):
        return (type(value), _state(vars(value), depth - 1))
    return ("object", id(value))


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not bound yet
        return None


def _kept(old: Any, new: Any) -> bool:
    """Whether state `new` is state `old`, or `old` with entries added to its dicts: a cache of
    answers keyed by what was asked (a constrained decoder's state per prefix) changes no answer."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(key in new and _kept(item, new[key]) for key, item in old.items())
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return all(_kept(a, b) for a, b in zip(old, new))
    return old == new


class KeepsState(ValueError):
    """A logits processor or stopping criterion of one's own whose state changed from one call to the
    next (`StateGuard`). Seen only as the call runs, so `speculative=True` raises it too rather than
    decoding the call plainly, as it does for what `checks.Unsupported` refuses up front."""


class StateGuard:
    """Refuses a logits processor or stopping criterion of one's own whose state changes from one
    call to the next after its first, which may set it up (a processor's first call is plain's, on
    the whole batch: `ScoreProcessor._plain_step`; a criterion's, in a batch, one row's): plain
    `generate` calls it once a step for the whole batch, speculation at draft positions that may be
    rejected and once per row, so from then on its state, and what it answers, would not be plain's."""

    def __init__(self, owner: object, watched: object, why: str) -> None:
        self.owner, self.watched, self.why = owner, watched, why
        self.state: Any = None
        self.called = False

    def check(self) -> None:
        """After each call: raise `KeepsState` where the state changed since the last."""
        state = _state(self.watched)
        if self.called and not _kept(self.state, state):
            raise KeepsState(
                f"speculative= cannot be combined with {type(self.owner).__name__}, which keeps state of "
                f"its own: it changed from one call to the next. {self.why} Make it a function of the "
                "ids and scores it is shown (a cache keyed by them is fine; keep counters and logs outside "
                "it), or drop speculative=."
            )
        self.state, self.called = state, True


def own_state(callable_: object) -> object | None:
    """What of a logits processor or stopping criterion may keep the user's state: a callable of
    one's own, or the function `prefix_allowed_tokens_fn` gave transformers' processor; None for
    transformers' own (those that keep state are refused up front: `checks.check_processors`)."""
    kind = type(callable_)
    if not kind.__module__.startswith("transformers."):
        return callable_
    if kind.__name__ == "PrefixConstrainedLogitsProcessor":
        return callable_._prefix_allowed_tokens_fn
    return None
