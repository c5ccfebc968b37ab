"""What `Draft` derives from its tokens and parents."""

from __future__ import annotations

import torch

from hf_specdec.core.draft import Draft


def test_draft_depths_count_each_rows_own_nodes():
    tokens = torch.zeros(2, 5, dtype=torch.long)
    past_its_length = [-1, -1, 0, 9, 9]  # a row of 3 nodes: its parents after them may be anything
    tree = Draft(tokens, [5, 3], parents=torch.tensor([[-1, 0, -1, 2, 1], past_its_length]))
    assert tree.depths() == [3, 2]
    assert Draft(tokens, [5, 2]).depths() == [5, 2]  # a chain: its length
