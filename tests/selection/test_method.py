"""`method="auto"` with a draft given runs it as what it is: transformers' `MtpModel` of the target's
own MTP layers, and our EAGLE / MTP / Medusa heads, loaded or saved, draft with their own method
rather than being loaded as a draft model (block drafts and assistants: `test_block.py`,
`tests/drafters/test_assistant.py`)."""

from __future__ import annotations

import torch

from hf_specdec.heads.io import save_head

from ..conftest import assert_greedy_match, tiny_llama
from ..helpers import mtp
from ..helpers.heads import copied_layer_eagle, identity_medusa


def _method_of(target, draft, inputs) -> str:
    kwargs = dict(**inputs, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(**kwargs, speculative=dict(draft=draft), return_dict_in_generate=True)
    assert_greedy_match(target, plain, out.sequences, inputs.get("attention_mask"))
    return out.speculative_stats.method


def test_a_models_own_mtp_layers_given_as_draft_draft_as_mtp():
    target, layers = mtp.target_and_layers(num_hidden_layers=2, first_k_dense_replace=2)
    assert _method_of(target, layers, mtp.prompts(2)) == "mtp"


def test_a_head_of_ours_given_as_draft_drafts_with_its_method(tmp_path):
    target = tiny_llama(30, layers=1)
    inputs = {"input_ids": torch.tensor([[3, 4, 5, 6, 3, 4]])}
    heads = {
        "mtp": copied_layer_eagle(target, method="mtp", output_norm=True),
        "eagle": copied_layer_eagle(target),
        "medusa": identity_medusa(target),
    }
    for method, head in heads.items():
        assert _method_of(target, head, inputs) == method
    save_head(heads["mtp"], tmp_path / "mtp")
    assert _method_of(target, str(tmp_path / "mtp"), inputs) == "mtp"
