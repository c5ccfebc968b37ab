"""What a tree draft's `parents` imply (`Draft.parents`: node i's parent node, -1 for a child of the
row's last token, parents before children): each node's depth and its ancestors, on the host
(`node_depths`) and on the device (`tree_layout`), and the parents of a subtree kept of it
(`kept_parents`). The one home of those rules for the loop, the verification, the caches' masks,
the processors, the policy and the drafters; imports nothing of ours, so that `draft` and
everything below it can read it.
"""

from __future__ import annotations

import torch


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth in one row of `Draft.parents`: 1 for a child of the row's last token, its
    parent's plus 1 below it."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def kept_parents(parents: list[int], kept: list[int]) -> list[int]:
    """The parents of the nodes `kept` (indices into a tree's nodes, each one's parent kept before
    it), renumbered to their places in `kept`: the tree those nodes make, as `Draft.parents`."""
    place = {old: new for new, old in enumerate(kept)}
    return [place[parents[i]] if parents[i] >= 0 else -1 for i in kept]


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`node_depths` on the device, with the ancestors it counts: for a forward over [last token,
    tree nodes...] (`parents` [B, T - 1], rows of `Draft.parents`), which fed tokens each one sees
    (its ancestors and itself), [B, T, T], and each one's depth below the last token, [B, T]. A
    parent past a row's length may be anything: such a node sees some earlier column."""
    rows, nodes = parents.shape
    width = nodes + 1
    parent_column = torch.cat([parents.new_zeros(rows, 1), parents + 1], dim=1)  # [B, T]
    visible = torch.eye(width, dtype=torch.bool, device=parents.device).repeat(rows, 1, 1)
    every_row = torch.arange(rows, device=parents.device)
    for i in range(1, width):  # a parent's column comes before its children's
        visible[:, i] |= visible[every_row, parent_column[:, i].clamp(0, i - 1)]
    return visible, visible.sum(dim=-1) - 1
