"""`OutputCollector`: stopping criteria of one's own, called row by row in a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_specdec.core.output import OutputCollector
from hf_specdec.core.own_state import KeepsState

from ..conftest import random_batch, tiny_llama


class _CountingStop(StoppingCriteria):
    """Stops every row at its `after`-th call: plain `generate` calls it once a step for the batch."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.after, dtype=torch.bool)


@pytest.fixture(scope="module")
def target_no_eos():
    return tiny_llama(0, eos_token_id=None)


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_a_criterion_that_keeps_state_is_refused_in_a_batch(target_no_eos, method):
    """Rows are verified apart, so a criterion of one's own is called once per row and token where
    plain calls it once per step: one that counts its calls would stop the batch elsewhere."""
    input_ids, attention_mask = random_batch(3, 3)
    with pytest.raises(KeepsState, match="keeps state"):
        target_no_eos.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([_CountingStop(8)]),
            speculative=dict(method=method, num_draft_tokens=3) if method == "ngram" else True,
        )


def test_a_criterion_that_keeps_state_stops_one_row_as_plain(target_no_eos):
    """One row is shown each token once, in order, as plain shows it: its state stays plain's."""
    input_ids, attention_mask = random_batch(3, 1)
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    plain = target_no_eos.generate(**common, stopping_criteria=StoppingCriteriaList([_CountingStop(8)]))
    ours = target_no_eos.generate(
        **common, stopping_criteria=StoppingCriteriaList([_CountingStop(8)]), speculative="ngram"
    )
    assert torch.equal(ours, plain) and plain.shape[1] == input_ids.shape[1] + 8


def test_a_criterion_shown_one_row_in_a_batch_is_shown_each_steps_scores_built_once(target_no_eos):
    """A criterion of one's own at batch > 1 reads every step's scores so far, at each token of each
    row, as [B, V] views of the row's (`as_row`), not copies: the earlier steps' views are the ones
    made when their token came, not made again at every token, which made a long generation's step
    cost grow with every token (quadratic in the call)."""
    shown: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    class _Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            shown.setdefault(input_ids.shape[1], []).append(scores)  # a list outside it: no state of its own
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    input_ids = torch.full((2, 4), 7)
    target_no_eos.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=12,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        stopping_criteria=StoppingCriteriaList([_Never()]),
        speculative=dict(method="ngram", num_draft_tokens=3),
    )
    lengths = sorted(shown)
    assert len(lengths) == 12 and all(len(shown[n]) == 2 for n in lengths)  # each row at each length
    for shorter, longer in zip(lengths, lengths[1:]):
        for row in range(2):
            before, after = shown[shorter][row], shown[longer][row]
            assert len(after) == len(before) + 1 and all(a is b for a, b in zip(after, before))
            assert all(s.shape == (2, 64) and s.stride(0) == 0 for s in after)  # views of one row


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages `tensors` keep alive."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_the_per_token_outputs_kept_during_a_call_hold_what_plain_keeps(
    target_no_eos, weak_draft, monkeypatch
):
    """Scores, logits and hidden states kept for the tokens emitted so far hold those tokens' values
    only, as plain's do: views of each verify forward's tensors would hold every row's every
    position, rejected drafts included, so that a long call with drafts mostly rejected held several
    times plain's memory until it ended."""
    held = {}

    def finish(self, stats, cache):
        held["tokens"] = sum(len(row) for row in self.scores)
        held["scores"] = _storage_bytes(s for row in self.scores for s in row)
        held["logits"] = _storage_bytes(s for row in self.logits for s in row)
        held["hidden"] = _storage_bytes(h for row in self.hidden_states for token in row for h in token)
        held["accepted"] = stats.accepted / stats.drafted
        return real_finish(self, stats, cache)

    real_finish = OutputCollector.finish
    monkeypatch.setattr(OutputCollector, "finish", finish)
    input_ids, attention_mask = random_batch(5, 3)
    target_no_eos.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=40,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        output_hidden_states=True,
        speculative=dict(method="draft_model", draft=weak_draft, num_draft_tokens=4),
    )
    config = target_no_eos.config
    assert held["tokens"] == 3 * 40 and held["accepted"] < 0.5  # most drafts rejected
    assert held["scores"] == held["logits"] == held["tokens"] * config.vocab_size * 4  # fp32
    # Per layer (the embeddings' output, then each layer's): the prompt's forward whole for the first
    # token, as plain keeps it, then one position a token.
    layers, positions = config.num_hidden_layers + 1, input_ids.numel() + held["tokens"] - 3
    assert held["hidden"] == layers * positions * config.hidden_size * 4
