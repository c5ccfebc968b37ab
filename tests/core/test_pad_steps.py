"""A row that stops before the batch's last (`core/pad_steps.py`): plain `generate` keeps decoding it,
fed its last token then its pad token, and returns the model's scores, logits, attentions and hidden
states at those steps; speculation returns the same, so that `compute_transition_scores` gives what
it gives for plain output (finite values or -inf, never NaN)."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch
from transformers import DynamicCache, RepetitionPenaltyLogitsProcessor, StaticCache

from hf_specdec import SpeculativeConfig, register_drafter
from hf_specdec.core.draft import Draft, DraftRequest
from hf_specdec.core.kv import RaggedKV, holds_holes
from hf_specdec.core.policy import FixedDraftLength
from hf_specdec.drafters import DRAFTERS, Drafter
from hf_specdec.integration import _ORIGINAL_GENERATE

from ..conftest import random_batch, tiny_llama
from ..helpers.architectures import VOCAB, tiny
from ..properties.test_output_contract import EVERYTHING, assert_close_steps

MAX_NEW = 12


def _inputs(seed: int = 2) -> dict[str, torch.Tensor]:
    input_ids, attention_mask = random_batch(seed, 3, vocab=VOCAB, min_len=3, max_len=9)
    return dict(input_ids=input_ids, attention_mask=attention_mask)


def _eos_ending_rows_apart(model, inputs, **kwargs) -> int:
    """A token of plain output that, made the EOS, ends rows at middle steps (as many as it can) and
    leaves another running to the end: those rows are then padded while the batch goes on (two of
    three: half the batch, where finished rows would leave the verify forward)."""
    plain = _ORIGINAL_GENERATE(model, **inputs, max_new_tokens=MAX_NEW, eos_token_id=None, **kwargs)
    new = plain[:, inputs["input_ids"].shape[1] :].tolist()
    ended = {}
    for token in sorted({t for row in new for t in row}):
        firsts = [row.index(token) if token in row else None for row in new]
        if None in firsts:
            ended[token] = sum(f is not None and 1 <= f <= MAX_NEW - 4 for f in firsts)
    token = max(ended, key=ended.get, default=None)
    assert token is not None and ended[token], "no token of plain output ends a row early, another not at all"
    return token


def _assert_like_plain(model, inputs, speculative, **kwargs):
    eos = _eos_ending_rows_apart(model, inputs, do_sample=False, **kwargs)
    given = dict(inputs, max_new_tokens=MAX_NEW, eos_token_id=eos, **EVERYTHING, **kwargs)
    plain = _ORIGINAL_GENERATE(model, **given)
    spec = model.generate(**given, speculative=speculative)
    assert torch.equal(spec.sequences, plain.sequences)
    assert int((plain.sequences[:, -1] == model.config.pad_token_id).sum()) == 2  # rows padded
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)
    for field in ("attentions", "hidden_states"):
        assert len(getattr(spec, field)) == len(getattr(plain, field))
        for step, (ours, theirs) in enumerate(zip(getattr(spec, field), getattr(plain, field))):
            assert_close_steps(ours, theirs, f"{field}[{step}]")
    for normalize in (False, True):
        ours = model.compute_transition_scores(spec.sequences, spec.scores, normalize_logits=normalize)
        theirs = model.compute_transition_scores(plain.sequences, plain.scores, normalize_logits=normalize)
        assert not ours.isnan().any()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    return spec


@pytest.mark.parametrize("name", ["llama", "mistral"])
@pytest.mark.parametrize("tree", [False, True])
def test_a_padded_row_returns_plain_outputs_at_its_later_steps(name, tree):
    """Chains (prompt lookup: mostly rejected, holes in the cache) and trees (the model as its own
    draft: accepted, rows stopping inside a step's drafts), rows stopping at different steps; on a
    sliding-window model each padded step's attentions are cut to the window."""
    window = {"sliding_window": 4} if name == "mistral" else {}
    model = tiny(name, 0, attn_implementation="eager", eos_token_id=None, **window)
    if tree:
        speculative = SpeculativeConfig(method="draft_model", draft=model, num_draft_tokens=3, tree=True)
    else:
        speculative = SpeculativeConfig(method="ngram", options=dict(min_ngram=1), policy=FixedDraftLength(3))
    spec = _assert_like_plain(model, _inputs(), speculative)
    assert spec.speculative_stats.accepted > 0 or not tree


def test_a_padded_row_is_processed_after_its_pads_as_plain():
    """A processor reading the tokens (repetition penalty) sees the padded row's sequence and its pads
    up to each step, as plain shows it; sampled, with plain's draws (prompt lookup takes no draws)."""
    model = tiny("llama", 0, eos_token_id=None)
    processors = [RepetitionPenaltyLogitsProcessor(1.5)]
    speculative = SpeculativeConfig(method="ngram", options=dict(min_ngram=1), policy=FixedDraftLength(3))
    inputs = _inputs(5)
    eos = _eos_ending_rows_apart(model, inputs, do_sample=False, logits_processor=processors)
    given = dict(inputs, max_new_tokens=MAX_NEW, eos_token_id=eos, return_dict_in_generate=True)
    given.update(output_scores=True, logits_processor=processors, do_sample=True, top_k=0, temperature=0.1)
    torch.manual_seed(0)
    plain = _ORIGINAL_GENERATE(model, **given)
    torch.manual_seed(0)
    spec = model.generate(**given, speculative=speculative)
    assert torch.equal(spec.sequences, plain.sequences)
    assert bool((plain.sequences[:, -1] == model.config.pad_token_id).any())
    assert_close_steps(spec.scores, plain.scores, "scores")


def test_a_padded_row_over_a_static_cache_returns_plain_scores():
    """A static cache retires no row that stopped early while outputs are kept; its pad steps run
    through a copy of its rows, which has room past the batch's longest."""
    model = tiny("llama", 0, eos_token_id=None)
    inputs = _inputs()
    eos = _eos_ending_rows_apart(model, inputs, do_sample=False)
    given = dict(inputs, max_new_tokens=MAX_NEW, eos_token_id=eos, cache_implementation="static")
    given.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = _ORIGINAL_GENERATE(model, **given)
    speculative = SpeculativeConfig(method="draft_model", draft=tiny("llama", 1), num_draft_tokens=3)
    spec = model.generate(**given, speculative=speculative)
    assert torch.equal(spec.sequences, plain.sequences)
    assert bool((plain.sequences[:, -1] == model.config.pad_token_id).any())
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)


class _AheadInRowZero(Drafter):
    """Drafts plain output's next tokens for the batch's `ahead` rows (all accepted; row 0 by
    default) and none for the others, so that those reach max_new_tokens while the others decode."""

    name: ClassVar[str] = "_ahead_in_row_zero"
    plain: ClassVar[torch.Tensor]  # plain's sequences [B, prompt + MAX_NEW]
    ahead: ClassVar[tuple[int, ...]] = (0,)

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        drafts = [
            self.plain[row, request.lengths[b] :][: max(request.max_tokens[b], 0)]
            if row in self.ahead
            else self.plain.new_zeros(0)
            for b, row in enumerate(request.row_ids)
        ]
        tokens = torch.zeros(len(drafts), max(map(len, drafts)), dtype=torch.long)
        for b, draft in enumerate(drafts):
            tokens[b, : len(draft)] = draft
        return Draft(tokens, [len(draft) for draft in drafts])


def test_a_row_at_max_length_frees_its_static_cache_while_outputs_are_kept():
    """The row of the widest prompt reaches max_new_tokens first, its cache then filling all of the
    room plain static decoding takes (prompt + max_new_tokens - 1). It is never padded, so its
    columns are given back to the rows still decoding, as where no outputs are kept."""
    model = tiny("llama", 0, eos_token_id=None)
    inputs = _inputs()
    order = inputs["attention_mask"].sum(dim=1).argsort(descending=True)  # the widest prompt first
    inputs = {name: value[order] for name, value in inputs.items()}
    assert bool(inputs["attention_mask"][0].all())
    given = dict(inputs, max_new_tokens=MAX_NEW, do_sample=False, cache_implementation="static")
    given.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = _ORIGINAL_GENERATE(model, **given)
    _AheadInRowZero.plain = plain.sequences
    register_drafter(_AheadInRowZero)
    try:
        spec = model.generate(**given, speculative=dict(method="_ahead_in_row_zero", num_draft_tokens=4))
    finally:
        DRAFTERS.pop("_ahead_in_row_zero")
    assert torch.equal(spec.sequences, plain.sequences)
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)


def test_rows_at_max_length_leave_a_dynamic_cache_while_outputs_are_kept(monkeypatch):
    """Two of three rows reach max_new_tokens first: with every per-token output asked for, they
    leave the batch's cache as where none is (they are never padded, so nothing reads their rows
    again), and the outputs at the steps the last row decodes alone are still plain's."""
    model = tiny("llama", 0, attn_implementation="eager", eos_token_id=None)
    inputs = _inputs()
    given = dict(inputs, max_new_tokens=MAX_NEW, do_sample=False, **EVERYTHING)
    plain = _ORIGINAL_GENERATE(model, **given)
    kept = []
    select_rows = RaggedKV.select_rows
    monkeypatch.setattr(
        RaggedKV, "select_rows", lambda kv, rows: kept.append(rows.tolist()) or select_rows(kv, rows)
    )
    monkeypatch.setattr(_AheadInRowZero, "plain", plain.sequences)
    monkeypatch.setattr(_AheadInRowZero, "ahead", (0, 1))
    register_drafter(_AheadInRowZero)
    try:
        spec = model.generate(**given, speculative=dict(method="_ahead_in_row_zero", num_draft_tokens=4))
    finally:
        DRAFTERS.pop("_ahead_in_row_zero")
    assert kept == [[0, 1], [2]]  # rows 0 and 1 left, set aside for the cache handed back (`rows_apart`)
    assert torch.equal(spec.sequences, plain.sequences)
    for field in ("scores", "logits"):
        assert_close_steps(getattr(spec, field), getattr(plain, field), field)
    for field in ("attentions", "hidden_states"):
        assert len(getattr(spec, field)) == len(getattr(plain, field)), field
        for step, (ours, theirs) in enumerate(zip(getattr(spec, field), getattr(plain, field))):
            assert_close_steps(ours, theirs, f"{field}[{step}]")


# Batches of three left-padded rows that end at different steps under prompt lookup.
ENDING_APART = {
    "an EOS in one row": 3,  # row 1 stops at the EOS, then plain feeds it pads
    "max_new_tokens reached in fewer steps": 2,  # two rows leave the batch before the third
}
# The cache: returned (return_dict_in_generate), the user's own (passed in, no output dict), static
# with room for a next turn, static as small as the call allows (compacted mid-call).
CACHES = ["returned", "passed in", "static", "tight static"]


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("case", ENDING_APART)
def test_a_batch_ending_at_different_steps_hands_back_plain_decodings_cache(case, cache):
    """The rows that stopped early are fed what plain decoding fed them (their last token, then
    pads) and the rows that left the batch join it again: each row's keys and values are plain's,
    column for column, and a next turn continued from the cache is plain's next turn."""
    model = tiny_llama(0)
    input_ids, attention_mask = random_batch(ENDING_APART[case], 3)
    prompt, new = input_ids.shape[1], 12

    def first_turn(speculative):
        cache_of = {
            "returned": lambda: None,
            "passed in": lambda: DynamicCache(config=model.config),
            "static": lambda: StaticCache(config=model.config, max_cache_len=prompt + 2 * new),
            "tight static": lambda: StaticCache(config=model.config, max_cache_len=prompt + new - 1),
        }[cache]()
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=cache != "passed in",
            speculative=speculative,
            **({} if cache_of is None else {"cache": cache_of}),
        )
        sequences = out if cache == "passed in" else out.sequences
        return sequences, cache_of if cache_of is not None else out.cache

    plain, theirs = first_turn(None)
    spec, ours = first_turn(SpeculativeConfig(method="ngram", num_draft_tokens=4))
    assert torch.equal(spec, plain)
    assert not holds_holes(ours)
    length = int(theirs.get_seq_length())
    assert int(ours.get_seq_length()) == length == plain.shape[1] - 1
    real = torch.cat([attention_mask.bool(), torch.ones(3, length - prompt, dtype=torch.bool)], dim=1)
    for i, (layer, expected) in enumerate(zip(ours.layers, theirs.layers)):
        for row in range(3):
            for name in ("keys", "values"):
                got, want = (getattr(c, name)[row, :, :length][:, real[row]] for c in (layer, expected))
                where = f"{name}[{i}] row {row}"
                torch.testing.assert_close(got, want, msg=lambda m, w=where: f"{w}: {m}")
    if cache == "tight static":
        return  # no room for a next turn
    turn = torch.cat([plain, torch.tensor([[7, 9, 3]] * 3)], dim=1)
    mask = torch.cat([attention_mask, torch.ones(3, turn.shape[1] - prompt, dtype=torch.long)], dim=1)
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    expected = model.generate(turn, cache=theirs, **options).tolist()
    if "static" not in cache:  # a filled StaticCache is continued plainly only
        continued = model.generate(turn, cache=copy.deepcopy(ours), speculative="ngram", **options)
        assert continued.tolist() == expected
    assert model.generate(turn, cache=ours, **options).tolist() == expected


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_cache_already_laid_out_as_plains_is_handed_back_without_a_copy(monkeypatch, cache):
    """One row, every draft's holes rolled back: the cache is plain's already, so handing it back
    copies nothing (a static cache's copy would double its memory for an instant)."""
    from hf_specdec.core.static_kv import StaticKV

    copies = []
    for cls in (RaggedKV, StaticKV):
        monkeypatch.setattr(
            cls, "rows_apart", lambda self, rows, f=cls.rows_apart: copies.append(rows) or f(self, rows)
        )
    model = tiny_llama(0)
    prompt = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]])
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    out = model.generate(prompt, **kw, speculative="ngram")
    assert torch.equal(out.sequences, model.generate(prompt, **kw).sequences)
    assert not holds_holes(out.past_key_values) and copies == []
