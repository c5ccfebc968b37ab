"""The rules attention masks are built by (`core.masks`), on their own."""

from __future__ import annotations

import torch

from hf_specdec.core.masks import allowed_keys, cache_places, in_attention_format, spanning


def test_allowed_keys_see_real_keys_up_to_their_column_and_themselves():
    real = torch.tensor([[True, False, True, True, False]])  # a hole at column 1, and at the query 4
    allowed = allowed_keys(real, torch.tensor([3, 4]))
    assert allowed[0].int().tolist() == [[1, 0, 1, 1, 0], [1, 0, 1, 1, 1]]  # a hole sees itself


def test_allowed_keys_of_a_tree_see_only_visible_columns_among_the_last():
    real = torch.ones(1, 4, dtype=torch.bool)
    visible = torch.tensor([[[True, False], [False, True]]])  # two siblings after the last token
    assert spanning(visible, 4)[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    allowed = allowed_keys(real, torch.tensor([2, 3]), spanning(visible, 4))
    assert allowed[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    broadcast = allowed_keys(real, torch.tensor([2, 3]), torch.ones(1, 1, 1, dtype=torch.bool))
    assert broadcast[0].int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]  # no tree: causal


def test_cache_places_count_the_prompt_whole_and_skip_holes():
    real = torch.tensor([[False, True, True, False, True]])  # padding, prompt, a hole, a token
    assert cache_places(real, prompt_width=3).tolist() == [[0, 1, 2, 2, 3]]
    assert real.tolist() == [[False, True, True, False, True]]  # not written


def test_in_attention_format_is_booleans_for_sdpa_and_a_mask_added_for_eager():
    allowed = torch.tensor([[[True, False]]])
    assert in_attention_format(allowed, "sdpa", None).tolist() == [[[[True, False]]]]
    eager = in_attention_format(allowed, "eager", torch.bfloat16)
    assert eager.dtype == torch.bfloat16 and eager.shape == (1, 1, 1, 2)
    assert eager.tolist() == [[[[0.0, torch.finfo(torch.bfloat16).min]]]]
