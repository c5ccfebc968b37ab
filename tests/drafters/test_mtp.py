"""MTP drafting (`method="mtp"`) is lossless and drafts what transformers' own MTP drafting does.

Targets of two DeepSeek-V3 layers with 1-3 MTP layers (transformers' `MtpModel`) built in memory and
given as `draft=`; loading them out of checkpoints in the published layouts is tested in
`tests/heads/test_mtp.py`. `tests/helpers/mtp.py` says how the layers are made to agree with
their target part of the time (`agree`), and to read their own context too (`own`).
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import MtpModel

from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import build_drafter
from hf_specdec.drafters.mtp import MtpDrafter
from hf_specdec.drafters.tree import ChainTreeConfig
from hf_specdec.heads.mtp import MtpDepth

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers import mtp
from ..helpers.forwards import assert_drafts_as_theirs
from ..helpers.heads import copied_layer_eagle
from ..helpers.sampling import (
    ALPHA,
    SETTINGS,
    VOCAB,
    chi2_pvalue,
    continuation_index,
    exact_distribution,
    sample,
)
from ..properties.test_output_contract import assert_like_plain

SMALL = dict(num_hidden_layers=2, first_k_dense_replace=2)


def target_and_layers(depths: int, **kwargs):
    return mtp.target_and_layers("deepseek_v3", depths=depths, agree=0.03, own=0.3, **SMALL, **kwargs)


@pytest.fixture(scope="module", params=[1, 3], ids=lambda n: f"{n}-depths")
def pair(request):
    return target_and_layers(request.param)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [2, 5, "tree"])
def test_greedy_matches_plain_generate(pair, batch, length):
    """Chains shorter than the layers (3 of them), longer (the last layer reapplied), and trees; in
    a left-padded batch the rows accept different numbers of drafts."""
    target, layers = pair
    inputs = mtp.prompts(batch)
    kwargs = dict(**inputs, max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        tree = dict(tree=True, num_draft_tokens=6) if length == "tree" else dict(num_draft_tokens=length)
        out = target.generate(
            **kwargs, speculative=dict(method="mtp", draft=layers, **tree), return_dict_in_generate=True
        )
    assert_greedy_match(target, plain, out.sequences, inputs["attention_mask"])
    stats = out.speculative_stats
    assert 0 < stats.accepted < stats.drafted  # drafts accepted and rolled back
    assert stats.method == "mtp" and len(stats.per_position_acceptance) == (6 if length == "tree" else length)


@pytest.mark.parametrize("depths", [1, 2, 3])
def test_as_many_tokens_per_target_forward_as_transformers_use_mtp(depths, monkeypatch):
    """transformers' `generate(use_mtp=True)` (MTPCandidateGenerator and its MtpCache) drafts one
    token per MTP layer each step; drafting as many, ours proposes the same tokens from the same
    layers, so that both take the same target forwards (counted), with the same output."""
    target, layers = target_and_layers(depths)
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(lambda cls, model, **kw: layers))
    theirs, ours = (
        dict(use_mtp=True),
        dict(speculative=dict(method="mtp", draft=layers, num_draft_tokens=depths)),
    )
    assert_drafts_as_theirs(target, mtp.prompts(1), theirs, ours, max_new_tokens=30)


def test_sampling_is_exact():
    """Two depths and chains of three (the last depth reapplied): every 3-token continuation of a
    vocabulary-8 target enumerated, thousands of speculative samples chi-square-tested against it
    (tests/properties/test_sampling.py shows that the test rejects samples from a wrong distribution)."""
    target, layers = target_and_layers(2, vocab_size=VOCAB)
    exact = exact_distribution(target, SETTINGS["topk_topp"])
    speculative = SpeculativeConfig(method="mtp", draft=layers, num_draft_tokens=3)
    with torch.no_grad():
        samples = sample(target, SETTINGS["topk_topp"], seed=0, speculative=speculative)
    assert chi2_pvalue(continuation_index(samples), exact) > ALPHA


@pytest.mark.parametrize("batch", [1, 3])
def test_every_output_like_plain(batch):
    """generate's whole output contract (scores, logits, attentions, hidden states, and at batch 1 the
    cache), in eager attention, for chains past the layers and for trees."""
    target, layers = target_and_layers(2, attn_implementation="eager")
    inputs = mtp.prompts(batch)
    for speculative in (dict(num_draft_tokens=3), dict(num_draft_tokens=4, tree=True)):
        spec = SpeculativeConfig(method="mtp", draft=layers, **speculative)
        _, out = assert_like_plain(
            target, inputs, spec, compare_cache=batch == 1 and not speculative.get("tree")
        )
        assert out.speculative_stats.accepted > 0


def test_over_a_static_cache():
    target, layers = target_and_layers(2)
    inputs = mtp.prompts(3)
    kwargs = dict(**inputs, max_new_tokens=20, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(**kwargs, speculative=dict(method="mtp", draft=layers, num_draft_tokens=3))
    assert_greedy_match(target, plain, out, inputs["attention_mask"])


def test_a_draft_that_is_no_mtp_layers_is_refused():
    target, _ = target_and_layers(1)
    with pytest.raises(ValueError, match="own MTP layers.*MtpModel"):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp", draft=target))


@pytest.mark.parametrize("other", [dict(hidden_size=48), dict(vocab_size=24)], ids=["hidden", "vocab"])
def test_mtp_layers_of_another_model_are_refused(other):
    """transformers' MtpModel built for a target of another hidden or vocabulary size: refused
    before drafting, naming the sizes."""
    target, _ = target_and_layers(1)
    _, layers = target_and_layers(1, **other)
    ((field, size),) = other.items()
    match = rf"{field}={size}; this target's is (32|16).*from_pretrained\(target\)"
    with pytest.raises(ValueError, match=match):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp", draft=layers))


def test_mtp_layers_of_another_model_of_the_same_sizes_are_refused():
    """Built for another model of the same sizes (another seed here, or another architecture), the
    layers would embed and score with that model's embedding and LM head: were taken silently."""
    target, _ = target_and_layers(1)
    _, layers = target_and_layers(1, seed=5)
    llama = tiny_llama(0, vocab_size=mtp.VOCAB, eos_token_id=None)
    for model in (target, llama):
        with pytest.raises(ValueError, match=r"built for another model of the same sizes.*from_pretrained"):
            model.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp", draft=layers))


def test_mtp_layers_off_the_targets_last_layer_are_refused_naming_both():
    """transformers puts a model's MTP layers beside its last decoder layer; ones given elsewhere are
    refused before drafting, naming both devices and how to move them without the shared embedding
    and head. Two real devices: the layers on the CPU with the target's last layer on `meta` (never
    run: the refusal comes first); and layers on `meta`, which hold no weights."""
    target, layers = target_and_layers(1)
    target.get_decoder().layers[-1].to("meta")
    with pytest.raises(
        ValueError,
        match=r"MtpModel given as draft= is on cpu, and must run on meta: .*"
        r"device_map=\{'': 'meta'\}.*draft\.layers\.to\('meta'\); not draft\.to\(\)",
    ):
        build_drafter(SpeculativeConfig(method="mtp", draft=layers), target, None)
    target, layers = target_and_layers(1)
    layers.layers.to("meta")
    with pytest.raises(ValueError, match="MtpModel given as draft= has no weights"):
        target.generate(**mtp.prompts(1), max_new_tokens=3, speculative=dict(method="mtp", draft=layers))


def test_the_layers_are_fed_where_their_weights_are():
    """Each depth computes on its layer's device, read from its parameters, not on the device the
    target computes on (which a device_map may make another: its first, where the layers sit beside
    its last); the drafts' logits go back to the target's. The layers on `meta` here: where the
    drafter puts its caches and inputs is all this checks, since a `meta` layer computes nothing."""
    target, layers = target_and_layers(2)
    layers.layers.to("meta")
    drafter = MtpDrafter([MtpDepth(layers, k) for k in range(2)], ChainTreeConfig(), target)
    assert drafter.device == torch.device("meta") and drafter.target_device == torch.device("cpu")
    assert [depth.embed_device for depth in drafter.depths] == [torch.device("cpu")] * 2


def test_rows_that_finish_early_leave_the_batch():
    """EOS ends two of three rows early: the finished rows leave the layers' caches with the target's."""
    target, layers = target_and_layers(2)
    inputs = mtp.prompts(3, seed=4)
    kwargs = dict(**inputs, max_new_tokens=30, do_sample=False, eos_token_id=4)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(**kwargs, speculative=dict(method="mtp", draft=layers, num_draft_tokens=4))
    assert (plain[:, 10:] == 4).any(dim=1).tolist() == [True, False, True]
    assert_greedy_match(target, plain, out, inputs["attention_mask"])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_an_mtp_head_of_ours_in_a_ragged_batch(tree):
    """An MTP head we trained (one depth: an EAGLE head with DeepSeek-V3's output norm, drafting over
    a draft vocabulary) drafts as EAGLE's head does: chains past its one depth, trees, and rows that
    accept different numbers of drafts."""
    target = tiny_llama(30, layers=1)
    head = copied_layer_eagle(target, torch.arange(4, 64), method="mtp", output_norm=True)
    input_ids, attention_mask = random_batch(seed=22, batch=3)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    plain = target.generate(**kwargs)
    spec = dict(method="mtp", draft=head, num_draft_tokens=6 if tree else 3, tree=tree)
    out = target.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    assert_greedy_match(target, plain, out.sequences, attention_mask)
    # The head copies the target's layer: drafted right, it is accepted often (a third to two thirds
    # here); its draft vocabulary mapped wrong, or its cache out of step, it is accepted next to never.
    stats = out.speculative_stats
    assert stats.drafted / 5 < stats.accepted < stats.drafted
