"""An EAGLE head over a static cache (`StaticKV`: padded widths, rolled back by its write position)
computes what it computes over a dynamic one (`RaggedKV`): its queries sit at the write position,
not at the cache's last columns, and the stale columns after them stay hidden."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_specdec.core.kv import RaggedKV
from hf_specdec.core.static_kv import COMPILED_WIDTHS, StaticKV
from hf_specdec.heads.eagle import EagleHeadConfig, static_cache
from hf_specdec.heads.io import build_head

from ..conftest import tiny_llama


def random_head(variant: str):
    torch.manual_seed(0)
    target = tiny_llama(1, layers=6)
    fields = dict(variant="eagle3", feature_layers=[1, 3, 5]) if variant == "eagle3" else {}
    return build_head(EagleHeadConfig.for_target(target, input_norm=True, **fields), target).eval()


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_a_head_over_a_static_cache_equals_it_over_a_dynamic_one(variant):
    head = random_head(variant)
    size = head.config.hidden_size
    dynamic = RaggedKV(head, DynamicCache(), 1, torch.device("cpu"), boolean_masks=True)
    static = StaticKV(head, static_cache(head.config, 40), 1, torch.device("cpu"), COMPILED_WIDTHS)
    g = torch.Generator().manual_seed(0)
    # A catch-up of 6 tokens, a chain of 3, the chain rolled back, a catch-up of 3 (padded to 4).
    for width, keep in [(6, None), (1, None), (1, None), (1, 6), (3, None), (1, None)]:
        if keep is not None:
            for kv in (dynamic, static):
                kv.truncate(torch.tensor([keep]))
        tokens = torch.randint(0, 64, (1, width), generator=g)
        features = torch.randn(1, width, size, generator=g)
        valid = torch.ones(1, width, dtype=torch.bool)
        want = dynamic.forward(tokens, valid, features=features)
        got = static.forward(tokens, valid, features=features)
        assert got.logits.shape == want.logits.shape and got.hidden_states.shape == want.hidden_states.shape
        torch.testing.assert_close(got.logits, want.logits)
        torch.testing.assert_close(got.hidden_states, want.hidden_states)
    assert static.fed_widths == {1, 4}  # the catch-up of 3 was padded, and its padding cut off
