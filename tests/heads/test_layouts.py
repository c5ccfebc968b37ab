"""EAGLE-3 heads written in the serving layouts (speculators for vLLM, the original EAGLE-3 layout for
SGLang) load back through our own loader unchanged: same tensors, same drafts, same greedy output."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.heads.checkpoint import load_head
from hf_specdec.heads.eagle import EagleHeadConfig
from hf_specdec.heads.io import build_head
from hf_specdec.heads.layouts import save_eagle3, save_speculators

from ..conftest import tiny_llama

SAVERS = {
    "speculators": lambda head, folder: save_speculators(
        head, folder, verifier="HuggingFaceTB/SmolLM2-135M-Instruct", num_speculative_tokens=3
    ),
    "eagle3": save_eagle3,
}


@pytest.fixture(scope="module")
def target8():
    return tiny_llama(0, layers=8)


def eagle3_head(target, layers=(2, 4, 5), draft_vocab: int = 40):
    torch.manual_seed(3)
    config = EagleHeadConfig.for_target(
        target, draft_vocab_size=draft_vocab, variant="eagle3", feature_layers=list(layers), input_norm=True
    )
    head = build_head(config, target)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))  # norms away from 1, so a swap shows
    kept = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values
    head.draft_vocab = kept
    return head


def _generate(model, head_or_folder):
    out = model.generate(
        input_ids=torch.tensor([[1, 17, 42, 9, 33, 17, 42]]),
        do_sample=False,
        max_new_tokens=16,
        speculative=dict(method="eagle", draft=head_or_folder, num_draft_tokens=3),
        return_dict_in_generate=True,
    )
    return out.sequences, out.speculative_stats


@pytest.mark.parametrize("layers", [(2, 4, 5), (1, 3, 6)], ids=["default-layers", "own-layers"])
@pytest.mark.parametrize("layout", list(SAVERS))
def test_eagle3_head_round_trips_through_the_serving_layout(tmp_path, target8, layout, layers):
    head = eagle3_head(target8, layers)
    folder = SAVERS[layout](head, tmp_path / layout)
    loaded = load_head(str(folder), target8, method="eagle")
    assert loaded.feature_layers == head.feature_layers
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    theirs = loaded.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(theirs[name], tensor), name
    sequences, stats = _generate(target8, head)
    sequences_back, stats_back = _generate(target8, str(folder))
    assert torch.equal(sequences, sequences_back)
    assert (stats.drafted, stats.accepted) == (stats_back.drafted, stats_back.accepted)  # same drafts


def test_speculators_config_has_what_vllm_reads(tmp_path, target8):
    head = eagle3_head(target8, (1, 3, 6))
    config = json.loads(
        (
            save_speculators(head, tmp_path / "s", verifier="org/target", num_speculative_tokens=4)
            / "config.json"
        ).read_text()
    )
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # vLLM assumes true when it is missing
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert config["draft_vocab_size"] == 40
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0] == {
        "proposal_type": "greedy",
        "speculative_tokens": 4,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    assert spec["verifier"]["name_or_path"] == "org/target"
    assert config["transformer_layer_config"]["vocab_size"] == target8.config.vocab_size
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(40) + state["d2t"], head.draft_vocab)
    assert int(state["t2d"].sum()) == 40 and bool(state["t2d"][head.draft_vocab].all())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"} <= set(state)
    assert not any(name.startswith("midlayer.") for name in state)


def test_sglang_layout_writes_its_own_layer_ids_one_less(tmp_path, target8):
    config = json.loads(
        (save_eagle3(eagle3_head(target8, (1, 3, 6)), tmp_path / "e") / "config.json").read_text()
    )
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    default = json.loads((save_eagle3(eagle3_head(target8), tmp_path / "d") / "config.json").read_text())
    assert "eagle_config" not in default  # the reference's own layers: SGLang's default


@pytest.mark.parametrize("layout", list(SAVERS))
def test_our_eagle1_style_head_is_refused(tmp_path, layout):
    target = tiny_llama(0)
    head = build_head(EagleHeadConfig.for_target(target, input_norms=True), target)
    with pytest.raises(ValueError, match="EAGLE-1-style head .* would draft differently"):
        SAVERS[layout](head, tmp_path / layout)
    assert not (tmp_path / layout).exists()


@pytest.mark.parametrize(
    "change, named",
    [
        ({"norm_before_residual": None}, "norm_before_residual"),  # vLLM reads a missing one as true
        ({"norm_before_fc": True}, "norm_before_fc"),
        ({"fc_norm": True}, "fc_norm"),
        ({"norm_output": True}, "norm_output"),
    ],
)
def test_a_speculators_head_normalising_otherwise_is_refused(tmp_path, target8, change, named):
    folder = save_speculators(eagle3_head(target8), tmp_path / "s", verifier="a/b", num_speculative_tokens=3)
    config = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        config.pop(key) if value is None else config.update({key: value})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"in ways the original EAGLE-3 does not \\({named}\\)"):
        load_head(str(folder), target8)


def test_a_speculators_head_saved_by_transformers_5_keeps_its_rope(tmp_path, target8):
    """transformers 5 writes `rope_parameters` instead of the legacy `rope_theta` / `rope_scaling`."""
    folder = save_speculators(eagle3_head(target8), tmp_path / "s", verifier="a/b", num_speculative_tokens=3)
    config = json.loads((folder / "config.json").read_text())
    layer = config["transformer_layer_config"]
    del layer["rope_theta"], layer["rope_scaling"]
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (folder / "config.json").write_text(json.dumps(config))
    assert load_head(str(folder), target8).config.rope_parameters["rope_theta"] == 500000.0
