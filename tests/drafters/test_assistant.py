"""An official assistant (`method="assistant"`, Gemma 4's `*-assistant`) drafts through our loop from
the target's own hidden state and KV cache: lossless in ragged batches, chains and trees, sampling
exact, and drafting what transformers' own `assistant_model=` drafts. `tests/helpers/assistant.py`
says how the tiny pair is made to agree part of the time."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma4ForCausalLM
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import build_drafter

from ..conftest import assert_greedy_match, tiny_llama
from ..helpers import assistant
from ..helpers.forwards import assert_drafts_as_theirs
from ..helpers.sampling import (
    ALPHA,
    SETTINGS,
    VOCAB,
    chi2_pvalue,
    continuation_index,
    exact_distribution,
    sample,
)
from ..properties.test_output_contract import EVERYTHING, assert_close_steps


@pytest.fixture(scope="module")
def pair():
    return assistant.pair()  # a sliding window of 4: the prompts and outputs run past it


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 6, "tree"])
def test_greedy_matches_plain_generate(pair, batch, length):
    target, helper = pair
    inputs = assistant.prompts(batch)
    kwargs = dict(**inputs, max_new_tokens=24, do_sample=False)
    drafts = dict(tree=True, num_draft_tokens=6) if length == "tree" else dict(num_draft_tokens=length)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(
            **kwargs, speculative=dict(draft=helper, **drafts), return_dict_in_generate=True
        )
    assert_greedy_match(target, plain, out.sequences, inputs["attention_mask"])
    stats = out.speculative_stats
    assert stats.method == "assistant" and 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("ordered", [False, True], ids=["whole-vocabulary", "centroids"])
def test_no_more_target_forwards_than_transformers_assistant_model(ordered, monkeypatch):
    """Batch 1, the assistant's attention to the target's KV counting fully (`own=1`), scoring the
    whole vocabulary or its best centroids' tokens (E2B's and E4B's `use_ordered_embeddings`).
    After a rejected draft transformers' generator crops the target's KV to the sequence's length,
    one past what the target has verified, so its assistant also reads the rejected draft's key at
    the bonus token's position; ours does not. So no more target forwards than theirs, and exactly
    as many as theirs with that crop one shorter: the same drafts."""
    target, helper = assistant.pair(window=64, own=1.0, ordered=ordered)
    helper.generation_config.num_assistant_tokens = 3
    theirs = dict(assistant_model=helper)
    ours = dict(speculative=dict(method="assistant", draft=helper, num_draft_tokens=3))
    assert_drafts_as_theirs(target, assistant.prompts(1), theirs, ours, same=False, max_new_tokens=30)

    generator = SinglePositionMultiTokenCandidateGenerator
    get_candidates = generator.get_candidates

    def verified_kv_only(self, input_ids, model_kwargs, model_outputs, *args, **kwargs):
        if model_outputs is not None and model_outputs.shared_kv_states is not None:
            cached = input_ids.shape[1] - 1  # the bonus token is not in the target's cache yet
            model_outputs.shared_kv_states = {
                kind: (k[:, :, :cached], v[:, :, :cached])
                for kind, (k, v) in model_outputs.shared_kv_states.items()
            }
        return get_candidates(self, input_ids, model_kwargs, model_outputs, *args, **kwargs)

    monkeypatch.setattr(generator, "get_candidates", verified_kv_only)
    assert_drafts_as_theirs(target, assistant.prompts(1), theirs, ours, max_new_tokens=30)


def test_sampling_is_exact():
    target, helper = assistant.pair(vocab_size=VOCAB)
    exact = exact_distribution(target, SETTINGS["topk_topp"])
    speculative = SpeculativeConfig(method="assistant", draft=helper, num_draft_tokens=3)
    with torch.no_grad():
        samples = sample(target, SETTINGS["topk_topp"], seed=0, speculative=speculative)
    assert chi2_pvalue(continuation_index(samples), exact) > ALPHA


@pytest.mark.parametrize("drafts", [dict(num_draft_tokens=3), dict(num_draft_tokens=4, tree=True)])
def test_scores_logits_and_hidden_states_like_plain(drafts):
    """generate's per-token outputs in a ragged batch, eager attention. (Attentions are left out:
    Gemma 4's KV-shared sliding layers return theirs over the window in plain decoding, over the
    whole cache in ours, for every method: a gap of the output slicing, not of the drafter.)"""
    target, helper = assistant.pair(attention="eager")
    returned = {**EVERYTHING, "output_attentions": False}
    inputs = assistant.prompts(3)
    with torch.no_grad():
        plain = target.generate(**inputs, max_new_tokens=8, do_sample=False, **returned)
        spec = SpeculativeConfig(method="assistant", draft=helper, **drafts)
        out = target.generate(**inputs, max_new_tokens=8, do_sample=False, speculative=spec, **returned)
    assert torch.equal(out.sequences, plain.sequences) and out.speculative_stats.accepted > 0
    for field in ("scores", "logits"):
        assert_close_steps(getattr(out, field), getattr(plain, field), field)
    for step, (layers, expected) in enumerate(zip(out.hidden_states, plain.hidden_states, strict=True)):
        assert_close_steps(layers, expected, f"hidden_states[{step}]")


@pytest.mark.parametrize("in_bf16", ["target", "assistant"])
def test_an_assistant_in_another_dtype_than_its_target(in_bf16):
    """A bf16 target with an fp32 assistant, and the reverse: the assistant attends to the target's
    keys and values in its own dtype."""
    target, helper = assistant.pair()
    (target if in_bf16 == "target" else helper).to(torch.bfloat16)
    inputs = assistant.prompts(3)
    kwargs = dict(**inputs, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        spec = dict(method="assistant", draft=helper, num_draft_tokens=3)
        out = target.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    assert_greedy_match(target, plain, out.sequences, inputs["attention_mask"])
    assert out.speculative_stats.accepted > 0


def test_an_assistant_is_recognised_as_one(pair, tmp_path):
    """As draft= with method 'auto' or 'draft_model', loaded or saved: it drafts as an assistant."""
    target, helper = pair
    helper.save_pretrained(tmp_path)
    inputs = assistant.prompts(1)
    for draft, method in ((helper, "auto"), (helper, "draft_model"), (str(tmp_path), "auto")):
        out = target.generate(
            **inputs,
            max_new_tokens=6,
            speculative=dict(method=method, draft=draft),
            return_dict_in_generate=True,
        )
        assert out.speculative_stats.method == "assistant"
        assert out.speculative_stats.selection in ("", "the official assistant given as draft=")


def test_what_cannot_work_is_refused(pair):
    target, helper = pair
    inputs = assistant.prompts(1)
    with pytest.raises(ValueError, match="only Gemma 4 targets"):
        tiny_llama(0, vocab_size=assistant.VOCAB).generate(
            **inputs, max_new_tokens=3, speculative=dict(method="assistant", draft=helper)
        )
    other, _ = assistant.pair(hidden_size=48)
    with pytest.raises(ValueError, match="hidden size 32; this target's is 48"):
        other.generate(**inputs, max_new_tokens=3, speculative=dict(method="assistant", draft=helper))
    with pytest.raises(ValueError, match="static cache"):
        target.generate(
            **inputs,
            max_new_tokens=3,
            cache_implementation="static",
            speculative=dict(method="assistant", draft=helper),
        )
    with pytest.raises(ValueError, match="is not one: use method='draft_model'"):
        target.generate(**inputs, max_new_tokens=3, speculative=dict(method="assistant", draft=target))


def test_an_assistant_off_the_targets_device_is_refused_naming_both():
    """It reads the target's cache and hidden states at every draft token, so it must be where the
    target computes; one given elsewhere is refused before drafting, not left to fail in a forward.
    Two real devices here: the assistant on the CPU, the target on `meta` (built there, never run:
    the refusal comes first); and an assistant on `meta`, which holds no weights at all."""
    target, helper = assistant.pair()
    on_meta = copy.deepcopy(target).to("meta")
    with pytest.raises(
        ValueError,
        match=r"assistant Gemma4Assistant\w* is on cpu, and must run on meta: .*"
        r"assistant\.to\('meta'\)",
    ):
        build_drafter(SpeculativeConfig(method="assistant", draft=helper), on_meta, None)
    with pytest.raises(ValueError, match=r"assistant Gemma4Assistant\w* has no weights: .*meta device"):
        target.generate(
            **assistant.prompts(1), max_new_tokens=3, speculative=dict(draft=copy.deepcopy(helper).to("meta"))
        )


@pytest.mark.parametrize(
    "other",
    [dict(num_key_value_heads=4), dict(head_dim=16, global_head_dim=16), "full attention only"],
    ids=["kv-heads", "head-size", "layer-kinds"],
)
def test_an_assistant_of_another_attention_layout_is_refused(pair, other):
    """Of the same hidden size, but attending to keys and values of another shape, or of a kind of
    layer (sliding) the target keeps none of: another model's assistant, refused before drafting."""
    target, helper = pair
    if other == "full attention only":
        config = assistant.text_config(4, ["full_attention"] * 4, 4, num_kv_shared_layers=2)
        target = Gemma4ForCausalLM._from_config(config).eval()
        match = "sliding_attention layers, and the target keeps no such layer's keys and values"
    else:
        helper = assistant.pair(**other)[1]
        shape = "(4 key-value heads of size 8|2 key-value heads of size 16)"
        match = rf"sliding_attention layers to {shape}; the target's are 2 of size 8"
    with pytest.raises(ValueError, match=match + ".*another model's assistant"):
        target.generate(
            **assistant.prompts(1), max_new_tokens=3, speculative=dict(method="assistant", draft=helper)
        )


def test_rows_that_finish_early_leave_the_batch(pair):
    """EOS ends two of three rows early: the assistant reads the target's cache rows of the others."""
    target, helper = pair
    inputs = assistant.prompts(3, seed=14)
    kwargs = dict(**inputs, max_new_tokens=30, do_sample=False, eos_token_id=14)
    with torch.no_grad():
        plain = target.generate(**kwargs)
        out = target.generate(**kwargs, speculative=dict(draft=helper, num_draft_tokens=3))
    assert (plain[:, 10:] == 14).any(dim=1).tolist() == [False, True, True]
    assert_greedy_match(target, plain, out, inputs["attention_mask"])


def test_an_assistant_given_keeps_its_training_mode():
    """Run in the mode it is in, as transformers runs one: it was switched to eval for good."""
    target, helper = assistant.pair()
    helper.train()
    target.generate(**assistant.prompts(1), max_new_tokens=4, speculative=dict(draft=helper))
    assert all(m.training for m in helper.modules())
