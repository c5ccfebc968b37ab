"""Counting a target's forwards, to hold a drafter to transformers' own generator on the same model."""

from __future__ import annotations

from typing import Any

import torch


def outputs_and_forwards(target, inputs: dict, runs: dict[str, dict[str, Any]], **kwargs) -> dict[str, tuple]:
    """Per run name: (the sequences greedy `generate(**inputs, **kwargs, **run)` returns, how many
    forwards of `target` it took)."""
    forwards = []
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    counted = {}
    try:
        with torch.no_grad():
            for name, extra in runs.items():
                forwards.clear()
                out = target.generate(**inputs, do_sample=False, **kwargs, **extra)
                counted[name] = (out, len(forwards))
    finally:
        hook.remove()
    return counted


def assert_drafts_as_theirs(
    target, inputs: dict, theirs: dict[str, Any], ours: dict[str, Any], same: bool = True, **kwargs
) -> None:
    """Ours (`generate(speculative=...)`'s arguments `ours`) and transformers' own generator (`theirs`)
    both return plain greedy's output, ours in as many target forwards as theirs (`same`), or in no
    more, and both in fewer than plain's."""
    counted = outputs_and_forwards(target, inputs, {"plain": {}, "theirs": theirs, "ours": ours}, **kwargs)
    (plain, plain_forwards), (their_out, their_forwards), (our_out, our_forwards) = counted.values()
    assert torch.equal(their_out, plain) and torch.equal(our_out, plain)
    assert our_forwards == their_forwards if same else our_forwards <= their_forwards, (
        our_forwards,
        their_forwards,
    )
    assert max(our_forwards, their_forwards) < plain_forwards
