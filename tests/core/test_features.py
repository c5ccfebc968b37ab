"""The target's hidden states a drafter reads (`core/features.py`)."""

from __future__ import annotations

import pytest

from hf_specdec.heads.dflash import BlockDraftConfig
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head

from ..properties.test_output_contract import model, prompts


@pytest.mark.parametrize("method", ["eagle", "dflash"])
def test_hidden_states_with_streams_first_are_refused_naming_what_drafts(method):
    """Gemma 3n returns its hidden states as [AltUp streams, batch, positions, hidden]: a head or block
    draft reading them was an IndexError from inside the loop."""
    target = model("gemma3n_text")
    config = (
        EagleHeadConfig.for_target(target)
        if method == "eagle"
        else BlockDraftConfig.for_target(target, [0, 3])
    )
    head = build_head(config, target).eval()
    with pytest.raises(
        ValueError, match=r"shape \(2, 1, 10, 16\), not \[batch, positions, hidden\].*draft_model"
    ):
        target.generate(
            **prompts("gemma3n_text", 1), max_new_tokens=3, speculative=dict(method=method, draft=head)
        )
