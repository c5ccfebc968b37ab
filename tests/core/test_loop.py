"""The decoding loop's contract with drafters: what a drafter is shown, step by step."""

from __future__ import annotations

import time
import warnings
from typing import ClassVar

import pytest
import torch

from hf_specdec import SpeculativeConfig, register_drafter
from hf_specdec.core.draft import Draft, DraftRequest
from hf_specdec.core.kv import RaggedKV
from hf_specdec.core.policy import FixedDraftLength
from hf_specdec.core.processing import ScoreProcessor
from hf_specdec.drafters import DRAFTERS, Drafter
from hf_specdec.integration import _ORIGINAL_GENERATE

from ..conftest import random_batch


class _FeatureRecorder(Drafter):
    """Proposes nothing useful (the target's own token 7 every time), records what it is shown."""

    name: ClassVar[str] = "_feature_recorder"
    hidden_state_layers = (-1,)
    seen: ClassVar[list] = []

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        rows = [
            request.row(b)[0][request.attention_mask[b, : request.lengths[b]].bool()].clone()
            for b in range(len(request.row_ids))
        ]
        self.seen.append((list(request.row_ids), rows, request.hidden_states))
        width = max(request.max_tokens)
        return Draft(torch.full((len(request.row_ids), width), 7), list(request.max_tokens))


def test_drafter_receives_target_hidden_states_of_every_cached_token(target):
    register_drafter(_FeatureRecorder)
    try:
        _FeatureRecorder.seen.clear()
        input_ids, attention_mask = random_batch(3, 2, min_len=4, max_len=9)
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=6,
            do_sample=False,
            speculative=dict(method="_feature_recorder", num_draft_tokens=2),
        )
    finally:
        DRAFTERS.pop("_feature_recorder")
    collected: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for row_ids, rows, hidden in _FeatureRecorder.seen:
        for b, row in enumerate(row_ids):
            collected[row].append(hidden[b])
            features = torch.cat(collected[row])
            sequence = rows[b]
            # Features cover every token the target has cached: all of the sequence but its last.
            assert features.shape[0] == len(sequence) - 1
            with torch.no_grad():
                ref = target(input_ids=sequence[None], output_hidden_states=True).hidden_states[-1][0]
            torch.testing.assert_close(features, ref[:-1], atol=1e-4, rtol=1e-4)


class _Counting(Drafter):
    """Drafts the target's token 7 every step and counts, in counters of its own, its drafts and
    the calls it was told had finished; its end-of-call work takes FINISH_SECONDS."""

    name: ClassVar[str] = "_counting"
    FINISH_SECONDS: ClassVar[float] = 0.02

    def __init__(self) -> None:
        self.drafts, self.finished = 0, 0

    @classmethod
    def from_config(cls, config, target, tokenizer):
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        self.drafts += len(request.row_ids)
        return Draft(torch.full((len(request.row_ids), max(request.max_tokens)), 7), list(request.max_tokens))

    def finish(self, sequences, prompt_lengths) -> None:
        self.finished += 1
        time.sleep(self.FINISH_SECONDS)

    def counters(self) -> dict[str, int]:
        return {"drafts": self.drafts, "finished": self.finished}


def test_the_stats_report_the_drafters_own_counters_and_time_its_finish(target):
    register_drafter(_Counting)
    try:
        input_ids, attention_mask = random_batch(5, 2)
        out = target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=6,
            do_sample=False,
            speculative=dict(method="_counting", num_draft_tokens=2),
            return_dict_in_generate=True,
        )
    finally:
        DRAFTERS.pop("_counting")
    stats = out.speculative_stats
    # Read after `finish`: every row of every step drafted (a fixed length), and the call finished once.
    assert stats.drafter_counters == {"drafts": stats.steps, "finished": 1}
    assert stats.finish_seconds >= _Counting.FINISH_SECONDS


def test_a_drafter_must_subclass_the_base_class():
    class Loose:
        name = "_loose"

    with pytest.raises(TypeError, match="subclass hf_specdec.drafters.Drafter"):
        register_drafter(Loose)
    assert "_loose" not in DRAFTERS


def test_register_drafter_refuses_a_taken_name_unless_replace():
    class _Ngram2(_FeatureRecorder):
        name: ClassVar[str] = "ngram"

    builtin = DRAFTERS["ngram"]
    try:
        with pytest.raises(ValueError, match=r"'ngram' is already registered.*NgramDrafter.*replace=True"):
            register_drafter(_Ngram2)
        assert DRAFTERS["ngram"] is builtin
        assert register_drafter(replace=True)(_Ngram2) is _Ngram2
        assert DRAFTERS["ngram"] is _Ngram2
        assert register_drafter(_Ngram2) is _Ngram2  # the same class again is not a clash
    finally:
        DRAFTERS["ngram"] = builtin


def test_the_old_name_of_the_processor_reads_it_with_a_warning():
    processor = ScoreProcessor(None, 8, 1)
    request = DraftRequest(
        tokens=torch.zeros(1, 4, dtype=torch.long),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        lengths=[4],
        max_tokens=[2],
        do_sample=False,
        processor=processor,
        row_ids=[0],
    )
    with pytest.warns(DeprecationWarning, match=r"read DraftRequest.processor"):
        assert request.score is processor
    with pytest.raises(AttributeError):
        request.score = processor  # read-only: the field is `processor`


def test_the_loop_and_the_drafters_read_the_processor_by_its_name(target):
    input_ids, attention_mask = random_batch(4, 2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="DraftRequest.score")
        for tree in (False, True):
            target.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=6,
                do_sample=False,
                speculative=dict(method="draft_model", draft=target, num_draft_tokens=2, tree=tree),
            )


class _KeepsShape(FixedDraftLength):
    """A fixed draft length that keeps the target's batch shape (a device paying per new shape)."""

    def keeps_batch_shape(self) -> bool:
        return True


def test_finished_rows_leave_the_forward_unless_the_policy_keeps_its_shape(target, monkeypatch):
    """Rows that finished leave the target's batch once half of it has (their compute spared); a
    policy that keeps the batch's shape keeps them as holes, since a batch of another size is a
    new shape at every width. The output is plain greedy's either way."""
    dropped: list[int] = []
    select_rows = RaggedKV.select_rows
    monkeypatch.setattr(
        RaggedKV, "select_rows", lambda kv, rows: (dropped.append(len(rows)), select_rows(kv, rows))[1]
    )
    input_ids, attention_mask = random_batch(3, 8)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False)
    plain = _ORIGINAL_GENERATE(target, **kwargs)
    leaving = target.generate(
        **kwargs, speculative=SpeculativeConfig(method="ngram", policy=FixedDraftLength(3))
    )
    assert torch.equal(leaving, plain) and dropped  # rows finished early (EOS) and left
    dropped.clear()
    kept = target.generate(**kwargs, speculative=SpeculativeConfig(method="ngram", policy=_KeepsShape(3)))
    assert torch.equal(kept, plain) and not dropped


class _Widens(FixedDraftLength):
    """A fixed draft length whose drafts, and plain steps, are fed four columns wider, the rest holes
    (`Draft.widened`), as the adaptive policy feeds them at a wider width the device has paid for."""

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return draft.widened(draft.tokens.shape[1] + 4)


@pytest.mark.parametrize("batch", [1, 3])
def test_drafts_fed_with_holes_past_them_give_plain_greedy_output(target, batch):
    """Holes after a row's draft are masked and verified at no position: the tokens are plain
    greedy's, in one row (where the holes are the whole forward's tail and leave the cache after
    a whole draft is kept) and in a batch, and so are the scores and logits (compared in one row:
    in a batch a finished row's are -inf, docs/limitations.md)."""
    input_ids, attention_mask = random_batch(5, batch, min_len=6)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    plain = _ORIGINAL_GENERATE(target, **kwargs)
    fed: list[tuple[int, int]] = []  # per forward: (holes past the longest row, its tokens)
    forward = RaggedKV.forward_rows

    def recording(kv, slots, tokens, valid, *args, **kw):
        longest = tokens.shape[1] if valid is None else int(valid.sum(dim=1).max())
        fed.append((tokens.shape[1] - longest, longest))
        return forward(kv, slots, tokens, valid, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RaggedKV, "forward_rows", recording)
        spec = target.generate(**kwargs, speculative=SpeculativeConfig(method="ngram", policy=_Widens(3)))
    assert max(fed)[0] >= 4 and (4, 1) in fed  # holes were fed, past drafts and past plain steps
    assert torch.equal(spec.sequences, plain.sequences)
    if batch == 1:
        for ours, theirs in zip(spec.scores + spec.logits, plain.scores + plain.logits, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_static_cache_is_fed_no_holes_past_a_draft(target):
    """A static cache pads its widths itself (a compiled one, to a few fixed widths), and a mask
    at batch 1 would be a new compiled graph at every width: it declares that it feeds no holes
    (`VerifyShape.feeds_holes`), the adaptive policy widens no draft there, and a policy that
    widens one anyway is refused with what to do (fed with them, near its end the forward passed
    the cache's room, and holes kept after whole drafts cost compactions)."""
    from hf_specdec.core.static_kv import StaticKV

    input_ids, attention_mask = random_batch(5, 1, min_len=6)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        cache_implementation="static",
    )
    plain = _ORIGINAL_GENERATE(target, **kwargs)
    masked: list[bool] = []
    forward = StaticKV.forward_rows

    def recording(kv, slots, tokens, valid, *args, **kw):
        masked.append(valid is not None and not bool(valid.all()))
        return forward(kv, slots, tokens, valid, *args, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StaticKV, "forward_rows", recording)
        spec = target.generate(
            **kwargs, speculative=SpeculativeConfig(method="ngram", policy=_WidensWhereFed(3))
        )
    assert torch.equal(spec, plain)
    assert masked and not any(masked)
    with pytest.raises(ValueError, match=r"_Widens widened a draft .*feeds_holes is False.*no wider than"):
        target.generate(**kwargs, speculative=SpeculativeConfig(method="ngram", policy=_Widens(3)))


class _WidensWhereFed(_Widens):
    """`_Widens` where the cache declares it feeds holes, as the adaptive policy does."""

    def begin_call(self, shape, draft_cost, context) -> None:
        self.feeds_holes = shape.feeds_holes

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return super().trim(draft, batch_size, remaining) if self.feeds_holes else draft


class _ToldShape(FixedDraftLength):
    """A fixed draft length recording what the loop tells it: once a call, then each step's batch."""

    def begin_call(self, shape, draft_cost, context) -> None:
        self.told = (shape, draft_cost, context)
        self.batches: list[int] = []

    def draft_length(self, batch_size: int) -> int:
        self.batches.append(batch_size)
        return super().draft_length(batch_size)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_policy_is_told_the_caches_verify_shape_and_the_drafters_cost(target, cache):
    """Declared once a call, not probed: the cache's `VerifyShape` (a static cache feeds no holes and
    keeps its batch), the drafter's `draft_cost` (n-gram: free) and the prompt's length; each step's
    batch size is the rows the verify forward holds."""
    from hf_specdec.core.draft import DraftCost
    from hf_specdec.core.verify_shape import VerifyShape

    input_ids, attention_mask = random_batch(5, 3, min_len=6)
    policy = _ToldShape(3)
    static = {"cache_implementation": "static"} if cache == "static" else {}
    target.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
        speculative=SpeculativeConfig(method="ngram", policy=policy), **static,
    )  # fmt: skip
    shape = VerifyShape(feeds_holes=False, fixed_batch=True) if cache == "static" else VerifyShape()
    assert policy.told == (shape, DraftCost.FREE, input_ids.shape[1])
    assert policy.batches[0] == 3 and all(b in (1, 2, 3) for b in policy.batches)


@pytest.mark.parametrize("method", ["ngram", "auto"])
def test_a_prompt_of_int32_ids_gets_plains_int64_sequences(target, method):
    """Plain generate appends each step's int64 tokens to the prompt, so a prompt of int32 ids (from
    a tokenizer's NumPy output, say) comes back as int64 sequences; speculation returned int32 ones."""
    prompt = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]], dtype=torch.int32)
    greedy = dict(max_new_tokens=8, do_sample=False)
    plain = target.generate(prompt, **greedy)
    out = target.generate(prompt, **greedy, speculative=method)
    assert plain.dtype == torch.int64
    assert out.dtype == plain.dtype and torch.equal(out, plain)
