"""Drafts and costs to drive a draft-length policy with, by hand or under an emulated profile's fake clock."""

from __future__ import annotations

import torch

from hf_specdec.core.draft import Draft

CPU = torch.device("cpu")
# A draft model's token at 5% of a plain step: too dear to ask for a draft every step.
DRAFT_TOKEN = 0.05
CPU_COSTS = {1: 1.0, 5: 1.55}  # verify of 5 tokens ~1.55x one token, as measured on SmolLM2 / CPU
# Memory-bound verifying (a GPU at batch 1): each extra token fed costs 1% of a step.
FLAT_COSTS = {w: 1.0 + 0.01 * (w - 1) for w in range(1, 18)}
# An 8-node tree, best first: 0 | 1 | 0-2 | 0-3 | 0-2-4 | 1-5 | 0-2-4-6 | 0-3-7
TREE_PARENTS = [-1, -1, 0, 0, 2, 1, 4, 3]
# The accepted paths of ten steps: node 0 on 7 of them, node 1 on 2, node 2 on 4, ...
TREE_PATHS = [[0, 2, 4], [0, 2, 4, 6], [0, 2], [0, 2], [0, 3], [0, 3, 7], [0], [1], [1, 5], []]


def draft(
    lengths: list[int], confidence: float | list[list[float]] | None = None, sampled: bool = False
) -> Draft:
    """Rows of `lengths` tokens (ids 0), with these confidences, sampled (uniform over 8) or greedy."""
    if not any(lengths):
        return Draft.empty(len(lengths), CPU)
    width = max(lengths)
    conf = None
    if isinstance(confidence, float):
        conf = torch.full((len(lengths), width), confidence)
    elif confidence is not None:
        conf = torch.tensor(confidence)
    probs = torch.full((len(lengths), width, 8), 1 / 8) if sampled else None
    return Draft(torch.zeros(len(lengths), width, dtype=torch.long), lengths, probs, conf)


def tree(lengths: list[int], parents: list[int] = TREE_PARENTS) -> Draft:
    width = max(lengths)
    rows = torch.tensor([parents[:width]] * len(lengths))
    return Draft(torch.arange(width).repeat(len(lengths), 1), lengths, parents=rows)


def power_law(width: int, lo: tuple[int, float], hi: tuple[int, float]) -> float:
    """The cost at `width` on the power law through two (width, seconds) points."""
    import math

    (a, ca), (b, cb) = lo, hi
    return ca * (width / a) ** (math.log(cb / ca) / math.log(b / a))
