"""`hf-specdec bench --sample`: seeded rows classified against plain's sample of the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from hf_specdec.bench import run_bench, runner, to_markdown
from hf_specdec.bench.result import PLAIN
from hf_specdec.bench.suites import Prompt

MAX_NEW = 24
NUM_DRAFT_TOKENS = 4  # fixed: on a CPU in fp32 the adaptive length may never draft
IDENTICAL_ROW = {"identical": 1, "tie": 0, "mismatch": 0}
# The bench seeds item i with i: two items, seeds 0 and 1, each a prompt whose sample repeats itself
# enough for the n-gram drafter to draft and get tokens accepted.
PROMPTS = [
    Prompt("a", "qa", "Say something about cats, cats, cats."),
    Prompt("b", "qa", "Say it about cats, cats."),
]


@pytest.fixture(scope="module")
def peaked_folder(tiny_folder: Path, tmp_path_factory) -> Path:
    """`tiny_folder`'s model with its final norm scaled up: distributions of about one nat of entropy
    a token, so its samples repeat and drafts get accepted, while each token is still a real draw."""
    folder = tmp_path_factory.mktemp("peaked-smol")
    model = LlamaForCausalLM.from_pretrained(tiny_folder)
    model.model.norm.weight.data.fill_(5.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(folder)
    return folder


def _bench(folder: Path, **kwargs):
    settings = dict(max_new_tokens=MAX_NEW, num_draft_tokens=NUM_DRAFT_TOKENS, sample=True, progress=False)
    return run_bench(folder, **{**settings, **kwargs})


def test_rows_that_take_plains_draws_are_classified_and_rejection_sampled_ones_not(peaked_folder):
    """ngram drafts without draws and is verified with plain's: its seeded sample is plain's (fp32:
    identical, not a tie). The draft model's sampled drafts go through rejection sampling, counted in
    its statistics, and transformers' rows have none: exact in distribution only, left unclassified."""
    result = _bench(peaked_folder, prompts=PROMPTS, methods=["ngram", "draft_model"], draft=peaked_folder)
    rows = {m.row for m in result.measurements}
    assert rows == {PLAIN, "ngram", "draft_model", "transformers_prompt_lookup", "transformers_assisted"}
    ngram = [m for m in result.measurements if m.row == "ngram"]
    assert sum(m.stats.accepted for m in ngram) > 0  # drafts were verified, not only plain steps
    for m in result.measurements:
        assert m.error is None, m.error
        if m.row in (PLAIN, "ngram"):
            assert m.lossless == IDENTICAL_ROW and m.differences == [], m.row
        else:
            assert m.lossless is None, m.row
    for m in ngram:
        assert m.stats.rejection_sampled_steps == 0
    assert result.settings["outputs_checked"]
    for m in (m for m in result.measurements if m.row == "draft_model"):
        assert 0 < m.stats.rejection_sampled_steps <= m.stats.steps
    markdown = to_markdown(result)
    assert "plain `generate`'s sample with the same seed" in markdown
    assert "exact in distribution, not token for token" in markdown
    table = {line.split(" | ")[0]: line for line in markdown.splitlines() if line.startswith("| ")}
    assert table["| ngram"].endswith("| 2 / 0 / 0 |  |")  # identical/tie/mismatch, then no errors
    assert table["| draft_model"].endswith("| – |  |")


def _tamper(row_name: str, change):
    """`runner._time_row` with `change(model, out, inputs)` applied to `row_name`'s timed output."""
    real = runner._time_row

    def tampered(model, row, inputs, generation, seed):
        measurement, out = real(model, row, inputs, generation, seed)
        if row.name == row_name and generation["max_new_tokens"] == MAX_NEW:  # not the warm-up
            change(model, out, inputs)
        return measurement, out

    return tampered


def test_a_tampered_sample_is_a_mismatch(peaked_folder, monkeypatch):
    """Control: the ngram row's second generated token replaced by the target's least likely one
    there, which no rounding makes plain's draw."""

    def least_likely(model, out, inputs):
        at = inputs["input_ids"].shape[1] + 1
        with torch.no_grad():
            logits = model(out.sequences[:, :at]).logits[0, -1]
        out.sequences[0, at] = logits.argmin()

    monkeypatch.setattr(runner, "_time_row", _tamper("ngram", least_likely))
    result = _bench(peaked_folder, prompts=PROMPTS[:1], methods=["ngram"], transformers_baselines=False)
    (ngram,) = [m for m in result.measurements if m.row == "ngram"]
    assert ngram.lossless == {"identical": 0, "tie": 0, "mismatch": 1}
    (difference,) = ngram.differences
    assert difference["prompt_id"] == "a" and difference["position"] == 1
    assert difference["gap"] > difference["bound"]
    assert "| **0 / 0 / 1** |" in to_markdown(result)


def test_a_plain_row_seeded_otherwise_leaves_the_rows_unclassified(peaked_folder, monkeypatch):
    """Control: the timed plain row seeded with another seed than the one the check reproduces (the
    bench's own seeding broken, or GPU kernels that do not repeat): no row is judged against a
    sample it did not time, with a warning, and the timings are kept."""
    real = runner._time_row

    def misseeded(model, row, inputs, generation, seed):
        return real(model, row, inputs, generation, seed + (row.name == PLAIN))

    monkeypatch.setattr(runner, "_time_row", misseeded)
    with pytest.warns(UserWarning, match="unclassified: plain sampling seeded with 0 gave other tokens"):
        result = _bench(peaked_folder, prompts=PROMPTS[:1], methods=["ngram"], transformers_baselines=False)
    assert all(m.error is None and m.seconds > 0 and m.lossless is None for m in result.measurements)


def test_rows_are_checked_at_the_temperature_they_were_sampled_at(peaked_folder, tmp_path, monkeypatch):
    """A model whose generation config samples at temperature 0.7 (as many chat models' do): the
    bench samples at it, and `check_sampled` is told so, since its scores are the logits over it
    and its rounding bound scales alike."""
    model = LlamaForCausalLM.from_pretrained(peaked_folder)
    model.generation_config.update(do_sample=True, temperature=0.7)  # saved only with do_sample set
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(peaked_folder).save_pretrained(tmp_path)
    temperatures, real = [], runner.check_sampled

    def recorded(*args, **kwargs):
        temperatures.append(kwargs.get("temperature"))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "check_sampled", recorded)
    result = _bench(tmp_path, prompts=PROMPTS[:1], methods=["ngram"], transformers_baselines=False)
    assert temperatures and set(temperatures) == {0.7}
    assert all(m.lossless == IDENTICAL_ROW for m in result.measurements)


def test_no_row_is_classified_where_the_draws_are_not_reproduced(peaked_folder, monkeypatch):
    """On a device whose default generator `check_sampled` does not know (not CPU or CUDA), rows are
    left unclassified and the header says why, rather than the check crashing or misjudging."""
    monkeypatch.setattr(runner, "can_check_sampled", lambda device: False)
    result = _bench(peaked_folder, prompts=PROMPTS[:1], methods=["ngram"], transformers_baselines=False)
    assert not result.settings["outputs_checked"]
    assert all(m.error is None and m.lossless is None for m in result.measurements)
    assert "Outputs not classified: on cpu plain sampling's draws are not reproduced" in to_markdown(result)


def test_a_check_that_raises_leaves_the_rows_unclassified_and_keeps_the_timings(peaked_folder, monkeypatch):
    """A check that cannot finish (here: `check_sampled` refusing, as at a tie within fp32's own
    rounding; an out-of-memory error for plain's scores alike) warns and leaves the batch
    unclassified; the run goes on with its timings."""

    def refuses(*args, **kwargs):
        raise ValueError("Row 0: plain's token at generated position 3 is not the argmax")

    monkeypatch.setattr(runner, "check_sampled", refuses)
    with pytest.warns(UserWarning, match="unclassified: Row 0: plain's token"):
        result = _bench(peaked_folder, prompts=PROMPTS[:1], methods=["ngram"], transformers_baselines=False)
    assert all(m.error is None and m.seconds > 0 and m.lossless is None for m in result.measurements)
