"""What a tree draft's parents imply (`core.tree`): each node's depth and ancestors."""

from __future__ import annotations

import torch

from hf_specdec.core.tree import kept_parents, node_depths, tree_layout

PARENTS = [-1, 0, -1, 2, 1]  # nodes 0-1-4 and 2-3


def test_tree_layout_ancestors_and_depths():
    visible, depths = tree_layout(torch.tensor([PARENTS]))
    assert depths.tolist() == [[0, 1, 2, 1, 2, 3]]
    # fed column 5 (node 4) sees the last token, node 0, node 1 and itself
    assert visible[0, 5].nonzero()[:, 0].tolist() == [0, 1, 2, 5]
    assert visible[0, 4].nonzero()[:, 0].tolist() == [0, 3, 4]


def test_node_depths_on_the_host_are_tree_layouts():
    assert node_depths(PARENTS) == [1, 2, 1, 2, 3] == tree_layout(torch.tensor([PARENTS]))[1][0, 1:].tolist()
    assert node_depths([-1, 0, 1]) == [1, 2, 3]  # a chain
    assert node_depths([]) == []


def test_kept_parents_renumber_a_subtree():
    # keep nodes 2, 0, 3 of nodes 0-1-4 and 2-3: node 3's parent 2 is now node 0, node 0 is node 1
    assert kept_parents(PARENTS, [2, 0, 3]) == [-1, -1, 0]
    assert kept_parents(PARENTS, []) == []
