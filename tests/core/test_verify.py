"""Tests of `hf_specdec.core.verify`: the pure functions' acceptance counts, emitted-token layout and
the single-step exactness of `rejection_sample` (every emitted token is distributed as p); and which
rule `accept` applies to a step, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hf_specdec.core.draft import Draft, DraftRequest
from hf_specdec.core.draws import PlainDraws
from hf_specdec.core.processing import ScoreProcessor
from hf_specdec.core.verify import accept, greedy_verify, rejection_sample

ALPHA = 1e-3  # chi-square significance: a correct sampler fails a test about once in a thousand seeds
ROWS = 20_000


# ---------------------------------------------------------------------------------------------
# Shared helpers and invariants
# ---------------------------------------------------------------------------------------------


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of integer `samples` against the distribution `probs` [V].

    Bins with expected count < 5 are pooled into one; a sample in a zero-probability bin is an
    impossible event and gives p = 0.
    """
    vocab = probs.numel()
    observed = torch.bincount(samples.flatten(), minlength=vocab).double()
    expected = probs.double() * samples.numel()
    if bool((observed[probs == 0] > 0).any()):
        return 0.0
    small = expected < 5
    obs = observed[~small].tolist()
    exp = expected[~small].tolist()
    if bool(small.any()) and float(expected[small].sum()) > 0:
        obs.append(float(observed[small].sum()))
        exp.append(float(expected[small].sum()))
    if len(obs) < 2:
        return 1.0
    total = sum(obs)
    exp = [e * total / sum(exp) for e in exp]  # rescale against float rounding
    return float(chisquare(obs, exp).pvalue)


def check_layout(draft_tokens, draft_lengths, accepted, tokens):
    """Invariants of every verifier: 0 <= accepted <= length, and the emitted prefix is the
    accepted drafts followed by one token of the target's."""
    batch, k = draft_tokens.shape
    assert accepted.shape == (batch,)
    assert tokens.shape == (batch, k + 1)
    assert accepted.dtype == torch.int64
    assert bool((accepted >= 0).all()) and bool((accepted <= draft_lengths).all())
    for b in range(batch):
        n = int(accepted[b])
        assert torch.equal(tokens[b, :n], draft_tokens[b, :n])


def scores_for(target_tokens: torch.Tensor, vocab: int = 10) -> torch.Tensor:
    """Scores [B, k + 1, V] whose argmax at each position is `target_tokens` [B, k + 1]."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(*target_tokens.shape, vocab, generator=g)
    scores.scatter_(-1, target_tokens.unsqueeze(-1), 5.0)
    return scores


# ---------------------------------------------------------------------------------------------
# greedy_verify
# ---------------------------------------------------------------------------------------------

# (draft, draft_length, target argmax at k + 1 positions, expected accepted)
GREEDY_CASES = {
    "all": ([1, 2, 3], 3, [1, 2, 3, 4], 3),
    "none": ([1, 2, 3], 3, [7, 2, 3, 4], 0),
    "prefix": ([1, 2, 3], 3, [1, 2, 9, 4], 2),
    "later_match_after_miss_ignored": ([1, 2, 3], 3, [1, 8, 3, 4], 1),
    "ragged_short": ([1, 2, 3], 1, [1, 2, 3, 4], 1),
    "ragged_zero": ([1, 2, 3], 0, [1, 2, 3, 4], 0),
    "padding_would_match": ([1, 0, 0], 1, [1, 0, 0, 4], 1),
    "single": ([5], 1, [5, 6], 1),
    "single_miss": ([5], 1, [4, 6], 0),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES), ids=list(GREEDY_CASES))
def test_greedy_verify_single_row(case):
    draft, length, target_tokens, expected = GREEDY_CASES[case]
    draft_tokens = torch.tensor([draft])
    lengths = torch.tensor([length])
    target = torch.tensor([target_tokens])
    accepted, tokens = greedy_verify(draft_tokens, lengths, scores_for(target))
    check_layout(draft_tokens, lengths, accepted, tokens)
    assert accepted.tolist() == [expected]
    # The emitted tokens are exactly the target's argmax, one step at a time.
    assert tokens[0, : expected + 1].tolist() == target_tokens[: expected + 1]


def test_greedy_verify_batched_equals_rowwise():
    """All cases in one ragged batch give the same answers as each row alone."""
    k = 3
    rows = [c for c in GREEDY_CASES.values() if len(c[0]) == k]
    draft_tokens = torch.tensor([r[0] for r in rows])
    lengths = torch.tensor([r[1] for r in rows])
    target = torch.tensor([r[2] for r in rows])
    accepted, tokens = greedy_verify(draft_tokens, lengths, scores_for(target))
    check_layout(draft_tokens, lengths, accepted, tokens)
    assert accepted.tolist() == [r[3] for r in rows]
    for b, r in enumerate(rows):
        assert tokens[b, : r[3] + 1].tolist() == r[2][: r[3] + 1]


def test_greedy_verify_empty_draft():
    """k = 0 (a plain step): nothing accepted, the one token is the target's argmax."""
    target = torch.tensor([[3], [7]])
    accepted, tokens = greedy_verify(
        torch.zeros(2, 0, dtype=torch.long), torch.tensor([0, 0]), scores_for(target)
    )
    assert accepted.tolist() == [0, 0]
    assert tokens[:, 0].tolist() == [3, 7]


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verify_random_against_reference(seed):
    g = torch.Generator().manual_seed(seed)
    batch, k, vocab = 16, 5, 4  # a small vocab so partial matches are common
    scores = torch.randn(batch, k + 1, vocab, generator=g)
    argmax = scores.argmax(-1)
    draft_tokens = torch.where(
        torch.rand(batch, k, generator=g) < 0.7,
        argmax[:, :k],
        torch.randint(0, vocab, (batch, k), generator=g),
    )
    lengths = torch.randint(0, k + 1, (batch,), generator=g)
    accepted, tokens = greedy_verify(draft_tokens, lengths, scores)
    check_layout(draft_tokens, lengths, accepted, tokens)
    for b in range(batch):
        n = 0
        while n < int(lengths[b]) and int(draft_tokens[b, n]) == int(argmax[b, n]):
            n += 1
        assert int(accepted[b]) == n
        assert torch.equal(tokens[b, : n + 1], argmax[b, : n + 1])


# ---------------------------------------------------------------------------------------------
# rejection_sample: deterministic edge cases
# ---------------------------------------------------------------------------------------------


def test_rejection_sample_accepts_when_p_equals_q_and_rejects_impossible_tokens():
    torch.manual_seed(0)
    vocab, k = 5, 3
    p = torch.softmax(torch.randn(1, k + 1, vocab), -1).expand(64, -1, -1).contiguous()
    draft_tokens = torch.randint(0, vocab, (64, k))
    # p == q: min(1, p/q) = 1, every draft token is accepted.
    accepted, tokens = rejection_sample(draft_tokens, torch.full((64,), k), p[:, :k].clone(), p)
    assert accepted.tolist() == [k] * 64
    check_layout(draft_tokens, torch.full((64,), k), accepted, tokens)
    # p is zero on the first draft token: it is always rejected, never emitted.
    p2 = p.clone()
    p2[:, 0, :] = 0.0
    p2[:, 0, (draft_tokens[0, 0] + 1) % vocab] = 1.0
    same = draft_tokens[:1].expand(64, -1).contiguous()
    accepted, tokens = rejection_sample(same, torch.full((64,), k), None, p2)
    assert accepted.tolist() == [0] * 64
    assert bool((tokens[:, 0] == (draft_tokens[0, 0] + 1) % vocab).all())


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "deterministic"])
def test_rejection_sample_ragged_lengths_layout(with_q):
    torch.manual_seed(1)
    batch, k, vocab = 12, 4, 6
    p = torch.softmax(torch.randn(batch, k + 1, vocab), -1)
    q = torch.softmax(torch.randn(batch, k, vocab), -1)
    draft_tokens = torch.multinomial(q.reshape(-1, vocab), 1).reshape(batch, k)
    lengths = torch.tensor([0, 1, 2, 3, 4, 0, 4, 2, 1, 3, 0, 4])
    accepted, tokens = rejection_sample(draft_tokens, lengths, q if with_q else None, p)
    check_layout(draft_tokens, lengths, accepted, tokens)
    assert bool((accepted[lengths == 0] == 0).all())


# ---------------------------------------------------------------------------------------------
# rejection_sample: statistical exactness of one step
# ---------------------------------------------------------------------------------------------


def _random_step(seed: int, k: int, vocab: int, zeros_in_p: bool):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g), -1)
    q = torch.softmax(2 * torch.randn(k, vocab, generator=g), -1)
    if zeros_in_p:  # like top-k: the target can never emit some tokens the draft proposes
        p[:, :2] = 0.0
        p = p / p.sum(-1, keepdim=True)
    return p, q


def emitted_by_position(accepted, tokens, lengths, k):
    """Per position i, the tokens emitted at i by the rows that emitted one there."""
    return [tokens[accepted >= i, i] for i in range(k + 1)]


def check_positions_follow_p(accepted, tokens, lengths, p, k):
    """Every emitted token at position i is distributed as p[i] (the targets here do not depend on
    the prefix, and draft tokens are drawn independently, so conditioning on acceptance is free)."""
    pvalues = []
    for i, samples in enumerate(emitted_by_position(accepted, tokens, lengths, k)):
        if samples.numel() >= 200:
            pvalues.append(chi2_pvalue(samples, p[i]))
    return pvalues


# (k, zeros in p, draw drafts from q or use a fixed token)
STEP_CASES = {
    "k1_q": (1, False, "q"),
    "k3_q": (3, False, "q"),
    "k3_q_p_has_zeros": (3, True, "q"),
    "k2_fixed_token": (2, False, "fixed"),
    "k2_fixed_token_p_has_zeros": (2, True, "fixed"),
}


@pytest.mark.parametrize("case", list(STEP_CASES), ids=list(STEP_CASES))
def test_rejection_sample_emits_target_distribution(case):
    k, zeros, proposal = STEP_CASES[case]
    vocab = 6
    p, q = _random_step(seed=10 + k, k=k, vocab=vocab, zeros_in_p=zeros)
    torch.manual_seed(1234)
    if proposal == "q":
        draft_tokens = torch.multinomial(q, ROWS, replacement=True).T.contiguous()  # [ROWS, k], x_i ~ q_i
        draft_probs = q.expand(ROWS, -1, -1)
        beta = torch.minimum(p[:k], q).sum(-1)  # acceptance probability per position
    else:
        fixed = torch.tensor([1, 3, 4][:k])  # token 1 has p = 0 when zeros_in_p
        draft_tokens = fixed.expand(ROWS, -1).contiguous()
        draft_probs = None
        beta = p[torch.arange(k), fixed]
    lengths = torch.full((ROWS,), k)
    accepted, tokens = rejection_sample(draft_tokens, lengths, draft_probs, p.expand(ROWS, -1, -1))
    check_layout(draft_tokens, lengths, accepted, tokens)

    pvalues = check_positions_follow_p(accepted, tokens, lengths, p, k)
    assert pvalues and min(pvalues) > ALPHA, pvalues
    # The number accepted follows P(accepted >= j) = prod_{i < j} beta_i.
    survive = torch.cat([torch.ones(1), torch.cumprod(beta, 0)])
    expected = torch.cat([survive[:-1] - survive[1:], survive[-1:]])
    assert chi2_pvalue(accepted, expected) > ALPHA


def test_rejection_sample_mixed_lengths_first_token_follows_p():
    """Rows with draft lengths 0..k side by side: the first emitted token is still ~ p[0]."""
    k, vocab = 3, 6
    p, q = _random_step(seed=3, k=k, vocab=vocab, zeros_in_p=False)
    torch.manual_seed(99)
    draft_tokens = torch.multinomial(q, ROWS, replacement=True).T.contiguous()
    lengths = torch.arange(ROWS) % (k + 1)
    accepted, tokens = rejection_sample(draft_tokens, lengths, q.expand(ROWS, -1, -1), p.expand(ROWS, -1, -1))
    check_layout(draft_tokens, lengths, accepted, tokens)
    assert chi2_pvalue(tokens[:, 0], p[0]) > ALPHA
    # A row's token right after its accepted drafts (correction or bonus) at its own length is ~ p[length].
    for n in range(k + 1):
        rows = (lengths == n) & (accepted == n)
        assert chi2_pvalue(tokens[rows, n], p[n]) > ALPHA


# ---------------------------------------------------------------------------------------------
# Controls: the same test must reject a wrong sampler
# ---------------------------------------------------------------------------------------------


def _always_accept(draft_tokens, draft_lengths, draft_probs, target_probs):
    batch, k = draft_tokens.shape
    bonus = torch.multinomial(target_probs[:, k], 1)
    return draft_lengths.clone(), torch.cat([draft_tokens, bonus], dim=1)


def _residual_is_p(draft_tokens, draft_lengths, draft_probs, target_probs):
    """Correct acceptance, but the correction is drawn from p instead of norm(max(0, p - q))."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    q_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    accept = torch.rand(batch, k) * q_draft < p_draft
    accepted = accept.long().cumprod(-1).sum(-1)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], 1)
    tokens[rows, accepted] = torch.multinomial(target_probs[rows, accepted], 1)[:, 0]
    return accepted, tokens


@pytest.mark.parametrize("wrong", [_always_accept, _residual_is_p], ids=["always_accept", "residual_is_p"])
def test_control_wrong_sampler_is_rejected(wrong):
    k, vocab = 2, 6
    p, q = _random_step(seed=12, k=k, vocab=vocab, zeros_in_p=False)
    torch.manual_seed(1234)
    draft_tokens = torch.multinomial(q, ROWS, replacement=True).T.contiguous()
    lengths = torch.full((ROWS,), k)
    accepted, tokens = wrong(draft_tokens, lengths, q.expand(ROWS, -1, -1), p.expand(ROWS, -1, -1))
    assert chi2_pvalue(tokens[:, 0], p[0]) < ALPHA


# ---------------------------------------------------------------------------------------------
# accept: the rule a step's draft is verified by
# ---------------------------------------------------------------------------------------------


def _request(rows: int = 1, do_sample: bool = False, tree: bool = False, vocab: int = 8) -> DraftRequest:
    return DraftRequest(
        tokens=torch.tensor([[1, 2]]).repeat(rows, 1),
        attention_mask=torch.ones(rows, 2),
        lengths=[2] * rows,
        max_tokens=[2] * rows,
        do_sample=do_sample,
        processor=ScoreProcessor(None, vocab, rows),
        row_ids=list(range(rows)),
        tree=tree,
    )


def _peaked(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Logits [1, len(tokens), V] whose softmax puts all its mass on `tokens[i]` at position i."""
    logits = torch.full((1, len(tokens), vocab), -1e4)
    logits[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


def test_accept_without_a_draft_is_a_plain_greedy_step():
    logits = torch.randn(2, 1, 8)
    verdict = accept(_request(rows=2), Draft.empty(2, torch.device("cpu")), logits)
    assert verdict.accepted == [0, 0] and verdict.paths is None
    assert torch.equal(verdict.tokens, logits.argmax(dim=-1))
    assert verdict.fed(1) == [0]


def test_accept_greedy_keeps_the_prefix_the_target_agrees_with():
    logits = scores_for(torch.tensor([[3, 4, 6]]), vocab=8)
    verdict = accept(_request(), Draft(torch.tensor([[3, 5]]), [2]), logits)
    assert verdict.accepted == [1]
    assert verdict.tokens[0, :2].tolist() == [3, 4]  # the accepted draft, then the target's correction
    assert verdict.fed(0) == [0, 1] and torch.equal(verdict.logits, logits)


def test_accept_samples_by_rejection_sampling():
    """do_sample: a draft the target gives all its mass is kept with the bonus token after it; one
    it gives none is replaced by a draw from the residual."""
    kept = accept(_request(do_sample=True), Draft(torch.tensor([[3, 4]]), [2]), _peaked([3, 4, 6]))
    assert kept.accepted == [2] and kept.tokens[0].tolist() == [3, 4, 6]
    replaced = accept(_request(do_sample=True), Draft(torch.tensor([[3, 5]]), [2]), _peaked([3, 4, 6]))
    assert replaced.accepted == [1] and replaced.tokens[0, :2].tolist() == [3, 4]


def test_accept_declares_the_steps_rejection_sampling_chose():
    """Sampling, a draft chosen without draws is verified with plain's draw at each position; one
    sampled from q (it comes with its probabilities) by rejection sampling, and the verdict says so
    (the statistics count it: a seeded call is then not plain's sample token for token)."""
    request, logits, tokens = _request(do_sample=True), _peaked([3, 4, 6]), torch.tensor([[3, 4]])
    with torch.random.fork_rng():  # the draws move the default generator to a stream of their own
        draws = PlainDraws(1, prompt_width=2, default=torch.default_generator)
        certain = accept(request, Draft(tokens, [2]), logits, draws)
        sampled = accept(request, Draft(tokens, [2], torch.full((1, 2, 8), 1 / 8)), logits, draws)
    assert certain.accepted == [2] and not certain.rejection_sampled
    assert sampled.accepted == [2] and sampled.rejection_sampled
    greedy = accept(_request(), Draft(tokens, [2]), logits)
    assert not greedy.rejection_sampled


def test_accept_walks_a_tree_draft_down_the_targets_choices():
    draft = Draft(torch.tensor([[3, 4, 5]]), [3], parents=torch.tensor([[-1, -1, 1]]))  # 3 | 4 - 5
    # The target's argmax after the last token: 4 (node 1); after node 1 (column 2): 5; after 5: 7.
    verdict = accept(_request(tree=True), draft, _peaked([4, 0, 5, 7]))
    assert verdict.paths == [[1, 2]] and verdict.accepted == [2]
    assert verdict.tokens[0, :3].tolist() == [4, 5, 7]
    assert verdict.fed(0) == [0, 2, 3]  # the fed columns of the path's tokens: after last, node 1, node 2


def test_sampled_tree_drafts_are_refused_rather_than_walked():
    """`tree_verify` is exact for trees chosen without the target's draws; a tree that comes with
    the distributions its tokens were sampled from asks for multi-draft rejection sampling."""
    request = _request(do_sample=True, tree=True)
    draft = Draft(torch.tensor([[3, 4]]), [2], torch.full((1, 2, 8), 1 / 8), parents=torch.tensor([[-1, -1]]))
    with pytest.raises(NotImplementedError, match="multi-draft rejection sampling"):
        accept(request, draft, torch.zeros(1, 3, 8))


@pytest.mark.parametrize("parents", [None, torch.tensor([[-1, 0]])], ids=["chain", "tree"])
def test_sampling_from_no_distribution_raises_as_plain_sampling_does(parents):
    """Where every processed score is -inf (or one is NaN), plain sampling's `torch.multinomial`
    raises; the draws' argmax would read it as token 0. Only emitted positions count: scores past
    a rejected draft, which plain never reaches, may be anything."""
    request, tokens = _request(do_sample=True, tree=parents is not None), torch.tensor([[3, 4]])
    banned = _peaked([3, 4, 6])
    banned[0, 1] = float("-inf")  # after draft token 3, no token is left
    unreached = _peaked([5, 4, 6])  # the target picks 5: draft token 3 is rejected
    unreached[0, 1:] = float("nan")
    with torch.random.fork_rng():
        draws = PlainDraws(1, prompt_width=2, default=torch.default_generator)
        with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan`"):
            accept(request, Draft(tokens, [2], parents=parents), banned, draws)
        overflowed = _peaked([3, 4, 6])
        overflowed[0, 1, 2] = float("nan")  # one NaN logit: softmax is NaN throughout
        with pytest.raises(RuntimeError, match="scores of row 0 leave no token to sample"):
            accept(request, Draft(tokens, [2], parents=parents), overflowed, draws)
        verdict = accept(request, Draft(tokens, [2], parents=parents), unreached, draws)
    assert verdict.accepted == [0] and verdict.tokens[0, 0] == 5
