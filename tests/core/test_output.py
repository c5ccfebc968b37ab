"""`OutputCollector`: stopping criteria of one's own, called row by row in a batch."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_specdec.core.own_state import KeepsState
from hf_specdec.core.processing import as_row

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


def test_a_criterion_shown_one_row_reads_every_steps_scores_as_views():
    """`as_row` shows a criterion the tuple of every step's scores as views of the ones kept, not
    copied again at every token (a cost quadratic in the tokens)."""
    kept = tuple(torch.randn(1, 8) for _ in range(4))
    shown = []
    as_row(
        lambda ids, scores: shown.append(scores) or torch.zeros(3, dtype=torch.bool),
        1,
        3,
        torch.ones(1, 5),
        kept,
    )
    assert [s.data_ptr() for s in shown[0]] == [s.data_ptr() for s in kept]
    assert all(s.shape == (3, 8) for s in shown[0])
