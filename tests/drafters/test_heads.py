"""EAGLE and Medusa drafting is lossless: greedy token-identical, sampling exact, batches ragged.

The heads are built by hand so that they really agree with their target part of the time
(`tests/helpers/heads.py` says how).
"""

from __future__ import annotations

import pytest
import torch

from hf_specdec.heads.io import save_head

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.heads import copied_layer_eagle, identity_medusa
from ..helpers.sampling import (
    ALPHA,
    NEW,
    PROMPT,
    SETTINGS,
    VOCAB,
    chi2_pvalue,
    continuation_index,
    exact_distribution,
    sample,
)


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(30, layers=1)


@pytest.fixture(scope="module")
def heads(one_layer):
    subset = torch.arange(4, 64)  # a draft vocabulary without a few tokens: drafts never use them
    return {"eagle": copied_layer_eagle(one_layer, subset), "medusa": identity_medusa(one_layer, subset)}


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("length", [1, 3, "auto"])
def test_greedy_matches_plain_generate(one_layer, heads, method, batch, length):
    input_ids, attention_mask = random_batch(seed=batch * 7 + 1, batch=batch)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False)
    plain = one_layer.generate(**kwargs)
    spec = dict(method=method, draft=heads[method], num_draft_tokens=length)
    out = one_layer.generate(**kwargs, speculative=spec, return_dict_in_generate=True)
    assert_greedy_match(one_layer, plain, out.sequences, attention_mask)
    if method == "eagle" and length != "auto":
        stats = out.speculative_stats
        assert 0 < stats.accepted < stats.drafted  # both paths ran: accepted and rolled back


def test_eagle_head_round_trips_through_a_folder(one_layer, heads, tmp_path):
    save_head(heads["eagle"], tmp_path / "head")
    input_ids, attention_mask = random_batch(seed=3, batch=2)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    by_object = one_layer.generate(**kwargs, speculative=dict(method="eagle", draft=heads["eagle"]))
    by_folder = one_layer.generate(**kwargs, speculative=dict(method="eagle", draft=str(tmp_path / "head")))
    assert torch.equal(by_object, by_folder)


@pytest.fixture(scope="module")
def sampling_target():
    return tiny_llama(31, vocab_size=VOCAB, layers=1, eos_token_id=None)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("setting", ["temp", "rep_penalty"])
def test_sampling_follows_the_target_distribution(sampling_target, method, setting):
    subset = torch.tensor([0, 1, 2, 3, 5, 6])  # tokens 4 and 7 can only come from the target
    head = (copied_layer_eagle if method == "eagle" else identity_medusa)(sampling_target, subset)
    exact = exact_distribution(sampling_target, SETTINGS[setting])
    spec = dict(method=method, draft=head, num_draft_tokens=2)
    samples = sample(sampling_target, SETTINGS[setting], seed=11, speculative=spec)
    assert samples.shape[1] == len(PROMPT) + NEW
    pvalue = chi2_pvalue(continuation_index(samples), exact)
    assert pvalue > ALPHA, f"{method}/{setting}: p = {pvalue:.2e}"


def test_method_needs_a_head(one_layer):
    ids = torch.tensor([[6, 7, 8]])
    with pytest.raises(ValueError, match="needs a trained head.*train-draft"):
        one_layer.generate(input_ids=ids, max_new_tokens=4, speculative="eagle")


def test_a_head_for_another_target_is_refused(one_layer, tmp_path):
    other = tiny_llama(32, layers=3)  # same hidden size and vocab, more layers
    save_head(copied_layer_eagle(other), tmp_path / "other")
    ids = torch.tensor([[6, 7, 8]])
    with pytest.raises(ValueError, match="layer count 3.*has 1"):
        one_layer.generate(
            input_ids=ids, max_new_tokens=4, speculative=dict(method="eagle", draft=str(tmp_path / "other"))
        )


def test_a_medusa_head_is_not_an_eagle_head(one_layer, heads, tmp_path):
    save_head(heads["medusa"], tmp_path / "medusa")
    ids = torch.tensor([[6, 7, 8]])
    with pytest.raises(ValueError, match="is a medusa head.*method='medusa'"):
        one_layer.generate(
            input_ids=ids, max_new_tokens=4, speculative=dict(method="eagle", draft=str(tmp_path / "medusa"))
        )


def test_corrupt_checkpoints_say_so(one_layer, heads, tmp_path):
    folder = save_head(heads["eagle"], tmp_path / "head")
    data = (folder / "head.safetensors").read_bytes()
    (folder / "head.safetensors").write_bytes(data[: len(data) // 2])
    ids = torch.tensor([[6, 7, 8]])
    with pytest.raises(ValueError, match="corrupt"):
        one_layer.generate(
            input_ids=ids, max_new_tokens=4, speculative=dict(method="eagle", draft=str(folder))
        )
    (folder / "head_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        one_layer.generate(
            input_ids=ids, max_new_tokens=4, speculative=dict(method="eagle", draft=str(folder))
        )


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_processors_that_allow_only_tokens_outside_the_draft_vocabulary(one_layer, heads, method):
    """The head cannot propose any allowed token: it drafts nothing instead of failing (sampling) or
    proposing a forbidden token (greedy), and the target alone decides."""
    input_ids, attention_mask = random_batch(seed=5, batch=2)
    allowed = [1, 2, 3]  # not in the heads' draft vocabulary (4..63)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=12,
        prefix_allowed_tokens_fn=lambda batch_id, ids: allowed,
    )
    spec = dict(method=method, draft=heads[method], num_draft_tokens=2)
    torch.manual_seed(0)
    sampled = one_layer.generate(**kwargs, do_sample=True, speculative=spec)
    assert set(sampled[:, input_ids.shape[1] :].flatten().tolist()) <= set(allowed)
    plain = one_layer.generate(**kwargs, do_sample=False)
    assert torch.equal(one_layer.generate(**kwargs, do_sample=False, speculative=spec), plain)


def test_eagle_reports_its_catch_up_over_the_prompt(one_layer, heads, monkeypatch):
    """The head's first draft reads the features of the whole prompt: a one-off the policy must not
    take for the cost of draft tokens (it would switch drafting off for the rest of the call)."""
    from hf_specdec.drafters.eagle import EagleDrafter

    seen = []
    propose = EagleDrafter.propose

    def recording(self, request):
        draft = propose(self, request)
        seen.append(draft.catch_up_seconds)
        return draft

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    input_ids = torch.randint(6, 64, (1, 200), generator=torch.Generator().manual_seed(5))
    spec = dict(method="eagle", draft=heads["eagle"], num_draft_tokens=3)
    one_layer.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12, speculative=spec
    )
    assert seen[0] > 0 and seen[1] == 0.0  # then steady steps (near the end, shorter drafts may count)
