"""`ScoreProcessor`: the batched path for set-based processors (repetition penalty) and length-based
ones (min length, min new tokens, exponential decay) gives, bit for bit, what each row and position
gets alone, as plain `generate` would process it."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    ExponentialDecayLengthPenalty,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec.core.own_state import KeepsState
from hf_specdec.core.processing import ScoreProcessor, path_tokens, prefixes

from ..conftest import random_batch, tiny_llama

VOCAB, BATCH, K = 16, 3, 5


def _penalty(penalty=1.3, ignore=None):
    return RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=ignore)


# Thresholds inside the lengths the tests show (1 to 12 tokens of context, then up to K drafted):
# some positions on each side of them.
def _min_length():
    return MinLengthLogitsProcessor(15, eos_token_id=[2, 5])


def _min_new_tokens():
    return MinNewTokensLengthLogitsProcessor(8, 6, eos_token_id=[2, 5])


def _decay():
    return ExponentialDecayLengthPenalty((2, 1.5), eos_token_id=[2, 5], input_ids_seq_length=8)


CASES = {
    "penalty": lambda: [_penalty()],
    "reward": lambda: [_penalty(0.7)],
    "penalty_then_warpers": lambda: [
        _penalty(),
        TemperatureLogitsWarper(0.9),
        TopKLogitsWarper(6),
        TopPLogitsWarper(0.9),
    ],
    # read the scores alone (suppress_tokens, remove_invalid_values, top_h, renormalize_logits)
    "score_only": lambda: [
        _penalty(),
        SuppressTokensLogitsProcessor([3, 5]),
        InfNanRemoveLogitsProcessor(),
        TopHLogitsWarper(0.4),
        LogitNormalization(),
    ],
    "two_penalties": lambda: [_penalty(1.2), TemperatureLogitsWarper(0.7), _penalty(1.5)],
    # generate's own: each row's left-padding length, one entry per row of the user's batch
    "ignore_per_row": lambda: [_penalty(ignore=torch.tensor([0, 3, 7]))],
    "ignore_one_for_all": lambda: [_penalty(ignore=torch.tensor([4]))],
    # longer than some contexts: the cut reaches into the draft's path
    "ignore_int": lambda: [_penalty(ignore=9)],
    # read the length alone (min_length, min_new_tokens, exponential_decay_length_penalty)
    "min_length": lambda: [_min_length()],
    "min_new_tokens": lambda: [_min_new_tokens()],
    "decay": lambda: [_decay()],
    "min_new_tokens_penalty_warpers": lambda: [
        _penalty(),
        _min_new_tokens(),
        TemperatureLogitsWarper(0.9),
        TopKLogitsWarper(6),
    ],
    "decay_between_penalties": lambda: [_penalty(ignore=torch.tensor([0, 3, 7])), _decay(), _penalty(0.8)],
    "every_length_rule": lambda: [
        _min_length(),
        _penalty(ignore=9),
        _decay(),
        _min_new_tokens(),
        TopPLogitsWarper(0.9),
        LogitNormalization(),
    ],
}


def _contexts(seed: int, row_ids: list[int], padded: bool = False) -> list[torch.Tensor]:
    """Each row's context: of random lengths, or (`padded`) all of one length, as a left-padded
    batch's rows are while they move in step."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (len(row_ids),), generator=g).tolist()
    if padded:
        lengths = [12] * len(row_ids)
    lengths[0] = 12  # longer than any prompt_ignore_length above: something is penalised
    return [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]


def _logits(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 3  # both signs: the penalty divides or multiplies
    logits[torch.rand(*shape, generator=g) < 0.1] = float("-inf")
    return logits


def _tree(seed: int, batch: int) -> tuple[torch.Tensor, list[int]]:
    """Random parents, each before its child; past a row's length, rubbish."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, K + 1, (batch,), generator=g).tolist()
    parents = torch.randint(-3, K + 2, (batch, K), generator=g)
    for b, n in enumerate(lengths):
        for i in range(n):
            parents[b, i] = int(torch.randint(-1, i, (1,), generator=g))
    return parents, lengths


def _draft(seed: int, rows: int, tree: bool):
    """Draft tokens [rows, K], each row's length, and parents for a tree (else None)."""
    g = torch.Generator().manual_seed(100 + seed)
    # a draft with a larger vocabulary: ids the target cannot emit; rubbish past each row's length
    draft_tokens = torch.randint(0, VOCAB + 4, (rows, K), generator=g)
    if tree:
        parents, lengths = _tree(seed, rows)
    else:
        parents, lengths = None, torch.randint(0, K + 1, (rows,), generator=g).tolist()
    for b, n in enumerate(lengths):
        draft_tokens[b, n:] = -1
    return draft_tokens, lengths, parents


@pytest.mark.parametrize("padded", [False, True], ids=["ragged", "padded"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", range(4))
def test_batched_positions_equal_row_by_row(case, tree, seed, padded):
    row_ids = [[0, 1, 2], [2, 0], [1]][seed % 3]
    processor = ScoreProcessor(LogitsProcessorList(CASES[case]()), VOCAB, BATCH)
    assert processor.batched and not processor.context_free
    contexts = _contexts(seed, row_ids, padded)
    draft_tokens, lengths, parents = _draft(seed, len(row_ids), tree)
    logits = _logits(seed, len(row_ids), K + 1, VOCAB + 2 * (seed % 2))  # and a padded vocabulary
    args = (contexts, row_ids, draft_tokens, lengths, logits, parents)
    batched = processor.positions(*args)
    assert torch.equal(batched, processor.positions_row_by_row(*args))
    assert not torch.equal(batched, processor.fit_vocab(logits))  # something was processed


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_call_equals_row_by_row(case):
    processor = ScoreProcessor(LogitsProcessorList(CASES[case]()), VOCAB, BATCH)
    row_ids = [2, 0, 1, 1]  # a tree's frontier: one row of the user's batch at several nodes
    contexts = _contexts(7, row_ids)
    logits = _logits(7, len(row_ids), VOCAB)
    assert torch.equal(processor(contexts, row_ids, logits), processor.row_by_row(contexts, row_ids, logits))


def test_prefixes_lay_each_path_after_its_context():
    contexts = [torch.tensor([[7, 8, 9]]), torch.tensor([[5]])]
    tokens = torch.tensor([[1, 2, 3], [4, 6, 10]])
    parents = torch.tensor([[-1, -1, 1], [-1, 0, 1]])
    ids, lengths = prefixes(contexts, tokens, parents, filler=99)
    assert ids.shape == (2, 4, 6)
    assert lengths.tolist() == [[3, 4, 4, 5], [1, 2, 3, 4]]
    assert ids[0].tolist() == [
        [7, 8, 9, 99, 99, 99],
        [7, 8, 9, 1, 99, 99],
        [7, 8, 9, 2, 99, 99],  # node 1 is a root child too
        [7, 8, 9, 2, 3, 99],
    ]
    assert ids[1].tolist() == [
        [5, 99, 99, 99, 99, 99],
        [5, 4, 99, 99, 99, 99],
        [5, 4, 6, 99, 99, 99],
        [5, 4, 6, 10, 99, 99],
    ]
    for b in range(2):
        for node in range(3):
            sequence = contexts[b][0].tolist() + path_tokens(tokens[b], parents[b], node)[0].tolist()
            assert ids[b, node + 1, : len(sequence)].tolist() == sequence
    chain, lengths = prefixes(contexts, tokens, None, filler=99)
    assert chain[0, 3].tolist() == [7, 8, 9, 1, 2, 3]
    assert lengths.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4]]


@pytest.mark.parametrize(
    "processors",
    [
        [NoRepeatNGramLogitsProcessor(2)],  # reads the order
        [_penalty(), _min_length(), NoRepeatNGramLogitsProcessor(2)],
        [type("MyPenalty", (RepetitionPenaltyLogitsProcessor,), {})(1.3)],  # a subclass may read more
        [type("MyMinLength", (MinLengthLogitsProcessor,), {})(5, eos_token_id=2)],
        [_penalty(ignore=torch.tensor([1, 2]))],  # neither one entry per row nor one for all
    ],
)
def test_other_processors_stay_row_by_row(processors):
    assert not ScoreProcessor(LogitsProcessorList(processors), VOCAB, BATCH).batched


class _Calls:
    """The sequence lengths each length-based processor is called with (`ScoreProcessor` calls
    transformers' own classes by exact type, so their `__call__` is wrapped where it is defined)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lengths: dict[str, list[int]] = {}
        for kind in (
            MinLengthLogitsProcessor,
            MinNewTokensLengthLogitsProcessor,
            ExponentialDecayLengthPenalty,
        ):
            monkeypatch.setattr(kind, "__call__", self._counted(kind.__name__, kind.__call__))

    def _counted(self, name, call):
        def counted(processor, input_ids, scores):
            self.lengths.setdefault(name, []).append(input_ids.shape[-1])
            return call(processor, input_ids, scores)

        return counted


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("padded", [False, True], ids=["ragged", "padded"])
def test_length_based_processors_are_called_once_per_length(monkeypatch, tree, padded):
    """Row by row, each length-based processor is called at every position; batched, once per
    sequence length shown at the positions processed."""
    row_ids = [0, 1, 2, 1]
    processor = ScoreProcessor(LogitsProcessorList(CASES["every_length_rule"]()), VOCAB, BATCH)
    contexts = _contexts(5, row_ids, padded)
    draft_tokens = torch.randint(0, VOCAB, (len(row_ids), K), generator=torch.Generator().manual_seed(5))
    lengths = [K, K, K - 2, K]  # several positions share a length: the rows or the tree's levels
    parents = torch.tensor([[-1, -1, 0, 0, 2]]).expand(len(row_ids), K) if tree else None
    logits = _logits(5, len(row_ids), K + 1, VOCAB)
    args = (contexts, row_ids, draft_tokens, lengths, logits, parents)
    shown = [  # the sequence length at each processed position, as `positions_row_by_row` builds it
        ctx.shape[1] + (i if parents is None else path_tokens(draft_tokens[b], parents[b], i - 1).shape[1])
        for b, ctx in enumerate(contexts)
        for i in range(lengths[b] + 1)
    ]
    calls = _Calls(monkeypatch)
    processor.positions_row_by_row(*args)
    assert {name: sorted(seen) for name, seen in calls.lengths.items()} == dict.fromkeys(
        ["MinLengthLogitsProcessor", "ExponentialDecayLengthPenalty", "MinNewTokensLengthLogitsProcessor"],
        sorted(shown),
    )
    calls.lengths.clear()
    processor.positions(*args)
    assert len(set(shown)) < len(shown)
    assert {name: sorted(seen) for name, seen in calls.lengths.items()} == dict.fromkeys(
        ["MinLengthLogitsProcessor", "ExponentialDecayLengthPenalty", "MinNewTokensLengthLogitsProcessor"],
        sorted(set(shown)),
    )


def test_processors_that_may_index_rows_are_shown_the_whole_batch():
    from transformers import LogitsProcessor, PrefixConstrainedLogitsProcessor

    from hf_specdec.core.processing import indexes_rows

    class Mine(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    assert indexes_rows(Mine()) and indexes_rows(PrefixConstrainedLogitsProcessor(lambda b, ids: [1], 1))
    assert not indexes_rows(MinLengthLogitsProcessor(5, eos_token_id=2))
    assert not indexes_rows(_penalty())


@pytest.mark.parametrize(
    "option", [dict(encoder_repetition_penalty=3.0), dict(encoder_no_repeat_ngram_size=1)], ids=str
)
def test_the_sequences_of_one_prompt_read_that_prompts_encoder_ids(target, option):
    """With num_return_sequences, generate's encoder-id processors hold one row a prompt and treat
    row r of the batch as prompt r // num_return_sequences: each row verified apart reads its own
    prompt's ids, so a seeded call samples what plain samples."""
    input_ids, attention_mask = random_batch(1, 2, min_len=8, max_len=8)
    common = dict(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True,
        num_return_sequences=2, **option,
    )  # fmt: skip
    torch.manual_seed(3)
    plain = target.generate(**common)
    torch.manual_seed(3)
    ours = target.generate(**common, speculative="ngram")
    assert torch.equal(ours, plain)


class _CountingBias(LogitsProcessor):
    """Keeps state from call to call: boosts another token at each call it counts. Plain `generate`
    calls it once a step; verification would call it at every draft position, rejected ones too."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores + 6.0 * (torch.arange(scores.shape[-1]) == self.calls * 11 % scores.shape[-1])


class _History(LogitsProcessor):
    """Keeps a history of the last tokens it was shown, and penalises them."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.seen] -= 3.0
        self.seen.append(int(input_ids[0, -1]))
        return scores


class _Jitter(LogitsProcessor):
    """Adds noise from a generator of its own, whose state advances at every call."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, input_ids, scores):
        return scores + 3.0 * torch.rand(scores.shape, generator=self.generator)


def _counting_closure():
    """A plain function keeping its count in a closure."""
    state = {"calls": 0}

    def bias(input_ids, scores):
        state["calls"] += 1
        return scores + 6.0 * (torch.arange(scores.shape[-1]) == state["calls"] % scores.shape[-1])

    return bias


class _PromptLength(LogitsProcessor):
    """Sets itself up at its first call (the prompt's length), then reads only the tokens: what it
    is shown at its first call is what plain shows it, so it stays as plain's from then on."""

    def __init__(self) -> None:
        self.prompt_len: int | None = None

    def __call__(self, input_ids, scores):
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        new = input_ids.shape[1] - self.prompt_len
        return scores + 5.0 * (torch.arange(scores.shape[-1]) == (7 * new + 9) % scores.shape[-1])


class _Memo(LogitsProcessor):
    """Memoises a pure function of the sequence in a dict that only gains keys (as constrained
    decoding libraries keep their automaton's state per prefix)."""

    def __init__(self) -> None:
        self.banned: dict[tuple[int, ...], int] = {}

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b, row in enumerate(input_ids.tolist()):
            key = tuple(row)
            if key not in self.banned:
                self.banned[key] = (3 * sum(row)) % scores.shape[-1]
            scores[b, self.banned[key]] = float("-inf")
        return scores


class _OnDevice(LogitsProcessor):
    """Moves its bias to the scores' device, noting the device at every call (`tensor.device` is a
    new object each time): the same device, no state that changes what it answers."""

    def __init__(self) -> None:
        self.bias = 4.0 * (torch.arange(64) % 7 == 3)
        self.device: torch.device | None = None

    def __call__(self, input_ids, scores):
        if self.device != scores.device:
            self.bias = self.bias.to(scores.device)
        self.device = scores.device
        return scores + self.bias


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "auto"])
@pytest.mark.parametrize("make", [_CountingBias, _History, _counting_closure, _Jitter])
def test_a_processor_of_ones_own_that_keeps_state_is_refused(target, good_draft, make, method, batch):
    """Its state after a verify would be that of calls at rejected draft positions, which plain never
    makes: the output would differ from plain's without a word. Refused once its state is seen to
    change, `speculative=True` too (it shows only once the call runs)."""
    input_ids, attention_mask = random_batch(3, batch)
    spec = dict(method=method, num_draft_tokens=3)
    if method != "ngram":
        spec["draft"] = good_draft
    with pytest.raises(KeepsState, match="keeps state"):
        target.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=20,
            do_sample=False,
            logits_processor=LogitsProcessorList([make()]),
            speculative=spec,
        )


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("make", [_PromptLength, _Memo, _OnDevice])
def test_a_processor_set_up_at_its_first_call_memoising_or_noting_its_device_speculates_as_plain(
    target, make, do_sample
):
    input_ids, attention_mask = random_batch(3, 3)
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=do_sample)
    torch.manual_seed(0)
    plain = target.generate(**common, logits_processor=LogitsProcessorList([make()]))
    torch.manual_seed(0)
    ours = target.generate(**common, logits_processor=LogitsProcessorList([make()]), speculative="ngram")
    assert torch.equal(ours, plain)


class _OwnPrompt(LogitsProcessor):
    """Notes each row's prompt at its first call, then bans the tokens of the row's own prompt: its
    first call must be shown plain's first batch, every row's own prompt."""

    def __init__(self) -> None:
        self.prompts: torch.Tensor | None = None

    def __call__(self, input_ids, scores):
        if self.prompts is None:
            self.prompts = input_ids.clone()
        return scores.scatter(1, self.prompts, float("-inf"))


def test_a_processor_set_up_from_each_rows_prompt_at_its_first_call_speculates_as_plain(target):
    """Row by row, a batch's first call showed every row one row's prompt (`as_row`), and the guard
    let that call set state up: rows 1 and 2 banned row 0's prompt, silently. The first call is now
    plain's, on the whole batch (`ScoreProcessor._plain_step`)."""
    input_ids, attention_mask = random_batch(3, 3)
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    plain = target.generate(**common, logits_processor=LogitsProcessorList([_OwnPrompt()]))
    ours = target.generate(
        **common, logits_processor=LogitsProcessorList([_OwnPrompt()]), speculative="ngram"
    )
    assert torch.equal(ours, plain)


class _SeenAsKeys(LogitsProcessor):
    """Penalises every token it was shown last, kept as the keys of a dict: a set in all but type,
    read whole, not a cache read by the sequence it was asked about."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, list(self.seen)] -= 3.0
        self.seen[int(input_ids[0, -1])] = True
        return scores


@pytest.mark.xfail(
    strict=True,
    reason="StateGuard lets a dict gain entries (a cache keyed by the sequence) and cannot tell a dict "
    "read whole from one read by key: the entries added at rejected draft positions change its answers.",
)
def test_a_dict_of_tokens_seen_read_whole_is_refused_or_speculates_as_plain():
    target = tiny_llama(0, eos_token_id=None)  # no end before the drafts' rejected entries tell
    input_ids, attention_mask = random_batch(3, 1)
    common = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    plain = target.generate(**common, logits_processor=LogitsProcessorList([_SeenAsKeys()]))
    try:
        ours = target.generate(
            **common,
            logits_processor=LogitsProcessorList([_SeenAsKeys()]),
            speculative=dict(method="ngram", num_draft_tokens=4),
        )
    except KeepsState:
        return
    assert torch.equal(ours, plain)
