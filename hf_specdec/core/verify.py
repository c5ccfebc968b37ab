"""Accepting draft tokens: the rule (`accept`) and the pure tensor functions it chooses from.

`accept` scores a step's draft with the target's logits and picks the rule: the longest prefix of
the target's own picks (greedy; sampling a draft chosen without draws), rejection sampling (a draft
sampled from q), or the walk down a tree draft; it refuses what no rule here verifies exactly.

The functions after it are batched over rows and share one vocabulary. Each takes the draft of a
step and the target's *processed* scores at the k + 1 positions the target just computed (after
each draft prefix, and one past the whole draft) and returns, per row, how many draft tokens were
accepted and the tokens to append: the accepted drafts followed by one token of the target's own
(the correction after a rejection, or the bonus token when every draft token was accepted). So a
step never gains fewer than one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .tree import node_depths

if TYPE_CHECKING:
    from .draft import Draft, DraftRequest
    from .draws import PlainDraws


NO_TOKEN = -1  # a sampled pick where the scores leave nothing to sample; no draft token equals it


@dataclass
class Verdict:
    """What the target made of one step's draft, row by row."""

    accepted: list[int]  # [B] draft tokens accepted per row
    tokens: torch.Tensor  # [B, k + 1] row b emits tokens[b, : accepted[b] + 1]
    scores: torch.Tensor  # [B, k + 1, V] processed target scores at those positions
    logits: torch.Tensor  # [B, k + 1, V] raw target logits
    paths: list[list[int]] | None = None  # tree drafts: the accepted nodes of each row, root first
    # Rejection sampling chose the tokens (a draft sampled from q): exact in distribution, but not
    # plain sampling's draws, so a seeded call's output is not plain's seeded sample token for token.
    rejection_sampled: bool = False

    def fed(self, b: int) -> list[int]:
        """The fed positions row b's emitted tokens were chosen at: along the accepted path of a tree."""
        if self.paths is None:
            return list(range(self.accepted[b] + 1))
        return [0] + [1 + node for node in self.paths[b]]


def accept(
    request: DraftRequest,
    draft: Draft,
    logits: torch.Tensor,  # [B, k + 1, V] the target's, after the row's last token and each draft token
    draws: PlainDraws | None = None,
) -> Verdict:
    """Score each row's draft with the target's `logits` and keep the longest prefix equal to the
    target's own picks (greedy: its argmax; sampling: plain decoding's draw at that position, from
    `draws`, or a fresh one), walking a tree down them; a draft sampled from a distribution q
    (or any sampled chain where `draws` is None: a device whose default generator is not known)
    goes through rejection sampling, which the verdict declares (`rejection_sampled`)."""
    # Only processors that read tokens need each row's sequence (plain greedy has none).
    reads = request.processor.reads_context
    contexts = [request.row(b) for b in range(len(request.row_ids))] if reads else []
    scores = request.processor.positions(
        contexts, request.row_ids, draft.tokens, draft.lengths, logits, draft.parents
    )
    if draft.parents is not None:
        if draft.probs is not None:  # the walk is exact only for trees chosen without draws
            raise NotImplementedError("Sampled tree drafts need multi-draft rejection sampling.")
        picks = _picks(request, draft, scores, draws)
        paths, tokens = tree_verify(draft.tokens, draft.lengths, draft.parents, picks)
        return _sampleable(Verdict([len(path) for path in paths], tokens, scores, logits, paths), request)
    if not request.do_sample and not any(draft.lengths):  # nothing drafted: a plain greedy step
        return Verdict([0] * len(draft.lengths), scores.argmax(dim=-1), scores, logits)
    draft_lengths = torch.tensor(draft.lengths, device=logits.device)
    if request.do_sample and (draft.probs is not None or draws is None):
        accepted, tokens = rejection_sample(draft.tokens, draft_lengths, draft.probs, scores.softmax(-1))
        return Verdict(accepted.tolist(), tokens, scores, logits, rejection_sampled=True)
    accepted, tokens = prefix_verify(draft.tokens, draft_lengths, _picks(request, draft, scores, draws))
    return _sampleable(Verdict(accepted.tolist(), tokens, scores, logits), request)


def _sampleable(verdict: Verdict, request: DraftRequest) -> Verdict:
    """`verdict`, unless a token it emits was sampled from no distribution (`_picks` marks such
    picks `NO_TOKEN`): plain sampling's `torch.multinomial` refuses those scores. Only the positions
    whose tokens the step emits count: plain never reaches one past a rejected draft."""
    if request.do_sample and bool((verdict.tokens == NO_TOKEN).any()):
        for b, row in enumerate(request.row_ids):
            if NO_TOKEN in verdict.tokens[b, : verdict.accepted[b] + 1].tolist():
                raise RuntimeError(
                    "probability tensor contains either `inf`, `nan` or element < 0: the processed "
                    f"scores of row {row} leave no token to sample (all -inf, or NaN logits), as "
                    "plain sampling would raise; check the processors' bans (suppress_tokens, "
                    "bad_words_ids, ...) and the model's logits."
                )
    return verdict


def _picks(
    request: DraftRequest, draft: Draft, scores: torch.Tensor, draws: PlainDraws | None
) -> torch.Tensor:
    """The target's own token at each fed position [B, n + 1]: greedy, its argmax; sampling, a draw
    from its processed distribution there: plain decoding's (`draws`: a chain's column j is j
    tokens past the row's next, a tree's node as deep as it lies), else an independent one."""
    if not request.do_sample:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    if draws is None:
        return torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
    width = scores.shape[1]
    steps = draws.step(request.lengths)
    if draft.parents is None:
        positions = [[t + j for j in range(width)] for t in steps]
    else:
        positions = []
        for t, row, n in zip(steps, draft.parents.tolist(), draft.lengths):
            # column 0: after the row's last token; column 1 + i: as deep below it as node i (holes: 1)
            depths = [0, *node_depths(row[:n]), *[1] * (width - 1 - n)]
            positions.append([t + d for d in depths])
    picks = draws.picks(request.row_ids, positions, probs)
    # Scores that leave nothing to sample (all -inf, or a NaN or +inf) have NaN probabilities, which
    # a draw's argmax would read as a token: marked instead, and refused where emitted (`_sampleable`).
    return torch.where(probs.gather(-1, picks[..., None]).squeeze(-1) > 0, picks, NO_TOKEN)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_lengths: torch.Tensor,  # [B], real draft tokens per row (<= k)
    target_scores: torch.Tensor,  # [B, k + 1, V] processed target scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: keep the longest draft prefix equal to the target's own argmax.

    Returns `accepted` [B] and `tokens` [B, k + 1], of which row b emits `tokens[b, :accepted[b] + 1]`.
    Because accepted drafts equal the target's argmax, the emitted tokens are exactly what the
    target would have chosen one step at a time.
    """
    return prefix_verify(draft_tokens, draft_lengths, target_scores.argmax(dim=-1))


def prefix_verify(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_lengths: torch.Tensor,  # [B], real draft tokens per row (<= k)
    picks: torch.Tensor,  # [B, k + 1] the target's own token at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the longest draft prefix equal to the target's `picks`; emit it and the next pick. The
    emitted tokens are the target's picks, whatever the draft: greedy's argmax, or, where each pick
    is plain sampling's draw at that position, plain sampling's tokens."""
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=draft_tokens.device)
    matches = (draft_tokens == picks[:, :k]) & (positions < draft_lengths[:, None])
    accepted = matches.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    return accepted, picks


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_lengths: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, k, V], or None for a deterministic proposal
    target_probs: torch.Tensor,  # [B, k + 1, V] processed target distribution p
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Draft token x_i, drawn from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)). At
    the first rejection the replacement is drawn from norm(max(0, p_i - q_i)); if all k are
    accepted a bonus token is drawn from p_{k+1}. Each emitted token is then distributed exactly
    as p. A drafter without probabilities (n-gram lookup) proposed x_i with certainty: q_i is
    one-hot, so acceptance is p_i(x_i) and the residual is p_i with x_i removed.

    Returns `accepted` [B] and `tokens` [B, k + 1] as `greedy_verify` does.
    """
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    in_draft = torch.arange(k, device=device) < draft_lengths[:, None]  # [B, k]

    # Acceptance test for every position at once; only the prefix before the first failure counts.
    p_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    uniform = torch.rand(batch, k, device=device, dtype=p_draft.dtype)
    accept = (uniform * q_draft < p_draft) & in_draft
    accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B]

    # The one target token of the step, drawn at position n = accepted from the residual
    # max(0, p_n - q_n); past the draft q_n is zero and the residual is p_n itself (the bonus).
    p_next = target_probs[rows, accepted]  # [B, V]
    residual = p_next.clone()
    rejected = accepted < draft_lengths  # rows whose draft ended in a rejection
    if rejected.any():
        n = accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual[rows[rejected], draft_tokens[rows, n][rejected]] = 0.0
        else:
            q_next = draft_probs[rows, n]
            residual[rejected] = (p_next[rejected] - q_next[rejected]).clamp_min(0.0)
    # p == q leaves a zero residual only where rejection had probability zero; keep p then.
    empty = residual.sum(dim=-1) <= 0
    if empty.any():
        residual[empty] = p_next[empty]
    next_token = torch.multinomial(residual, num_samples=1).squeeze(-1)  # [B]

    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    tokens[rows, accepted] = next_token
    return accepted, tokens


def tree_verify(
    draft_tokens: torch.Tensor,  # [B, n] tree nodes, each after its parent
    draft_lengths: list[int],  # [B] real nodes per row
    parents: torch.Tensor,  # [B, n] node i's parent node, -1 for a child of the last token
    picks: torch.Tensor,  # [B, n + 1] the target's token after the last token, then after node i
) -> tuple[list[list[int]], torch.Tensor]:
    """Walk each row's draft tree down the target's own choices (SpecInfer, Miao et al. 2024).

    At each node the target picks its token: greedy, its argmax; sampling, a draw from its
    processed distribution there. If a child of the node carries that token, the child is
    accepted and the walk continues from it; otherwise the picked token is the row's last of the
    step. Every emitted token is thus the target's own choice after the tokens before it, so
    greedy output is plain greedy's and samples follow the target's distribution exactly. (This is
    exact for trees chosen without drawing: n-gram tries, and draft-model trees of the top-k
    children by draft probability, a function of the context alone. Drafts sampled from a
    distribution q would be better served by SpecInfer's multi-draft residuals.) `picks` holds the
    target's choice after every node: only those on the walked path are used, each independent of
    the others (sampled, nodes of one depth may share their draw: no path holds two of them).

    Returns per row the accepted path (node indices, root first) and `tokens` [B, n + 1], of which
    row b emits `tokens[b, : len(path_b) + 1]`.
    """
    batch, n_plus_1 = picks.shape
    picks_host, tokens_host, parents_host = picks.tolist(), draft_tokens.tolist(), parents.tolist()
    paths, emitted = [], []
    for b in range(batch):
        children = {
            (parents_host[b][i], tokens_host[b][i]): i for i in range(draft_lengths[b])
        }  # a trie: siblings carry distinct tokens
        path, node = [], -1
        while (child := children.get((node, picks_host[b][node + 1]))) is not None:
            path.append(child)
            node = child
        paths.append(path)
        emitted.append([tokens_host[b][i] for i in path] + [picks_host[b][node + 1]])
    tokens = picks.new_zeros(batch, n_plus_1)
    for b, row in enumerate(emitted):
        tokens[b, : len(row)] = torch.tensor(row, dtype=tokens.dtype)
    return paths, tokens
