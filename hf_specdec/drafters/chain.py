"""Drafting token by token, shared by every drafter that chains its own predictions (draft models,
EAGLE, Medusa): processing each position's logits exactly as the target's will be, picking or
sampling the token, and stopping a row early."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.draft import Draft, DraftRequest


def next_tokens(
    request: DraftRequest, drafted: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's next draft token, the draft's probability of it, whether the row could draft at
    all (a processor may allow only tokens outside a head's draft vocabulary), and, when sampling,
    the processed distribution the token was drawn from (None when greedy).

    `drafted` [B, i] holds the tokens drafted so far this step: processors that read the context
    (repetition penalty) must see them, exactly as the target's processing will.
    """
    if request.processor.reads_context:
        contexts = [torch.cat([request.row(b), drafted[b : b + 1]], dim=1) for b in range(drafted.shape[0])]
    else:  # nothing reads the context: skip building it once per draft token
        contexts = []
    scores = request.processor(contexts, request.row_ids, logits.float())
    if not request.do_sample:
        # Greedy: one pass for the token and its score, one for the normaliser; no [B, V] softmax.
        top, token = scores.max(dim=-1)
        possible = top > float("-inf")
        confidence = torch.where(possible, (top - torch.logsumexp(scores, dim=-1)).exp(), 0.0)
        return token, confidence, possible, None
    # A row whose scores leave nothing to sample (all -inf, or a NaN or +inf from a draft that
    # overflowed: softmax would be NaN) stops drafting, as greedy's does; no NaN meanwhile.
    possible = scores.logsumexp(dim=-1).isfinite()
    scores = torch.where(possible[:, None], scores, 0.0)
    dist = scores.softmax(dim=-1)
    token = torch.multinomial(dist, 1).squeeze(1)
    return token, dist.gather(1, token[:, None]).squeeze(1), possible, dist


def real_tokens(request: DraftRequest, b: int) -> torch.Tensor:
    """Row b's tokens without its left padding, [n]."""
    return request.row(b)[0][request.attention_mask[b, : request.lengths[b]].bool()]


def arrived(
    request: DraftRequest, b: int, done: int, name: str
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """Row b's tokens [n] (no padding), the target's hidden states of the tokens it cached since
    the row's last request (None: none), where they start (`done`: how many the drafter had) and how
    many there are. Every cached token but the newest must then have its hidden states: a row out of
    step is refused."""
    real = real_tokens(request, b)
    new = request.hidden_states[b]
    count = 0 if new is None else len(new)
    if done + count != len(real) - 1:
        raise RuntimeError(
            f"The {name} drafter is out of step: row {request.row_ids[b]} has {len(real)} tokens "
            f"but the target's hidden states of {done + count} reached it."
        )
    return real, new, done, count


def chain(
    request: DraftRequest,
    max_tokens: list[int],
    min_confidence: float,
    logits_at: Callable[[int, torch.Tensor | None, list[bool]], torch.Tensor],
) -> Draft:
    """Draft token by token: `logits_at(i, previous_token, active)` gives the full-vocabulary logits
    [B, V] of position i (rows not `active` any more are ignored). Row b stops after
    `max_tokens[b]` tokens, or, when greedy, once its token's probability is below `min_confidence`."""
    batch, steps = len(max_tokens), max(max_tokens, default=0)
    drafted = torch.zeros(batch, steps, dtype=torch.long, device=request.tokens.device)
    confidence = torch.zeros(batch, steps, device=request.tokens.device)
    probs: list[torch.Tensor] = []
    lengths = [0] * batch
    active = [n > 0 for n in max_tokens]
    token = None
    for i in range(steps):
        token, p_token, possible, dist = next_tokens(request, drafted[:, :i], logits_at(i, token, active))
        drafted[:, i] = token
        confidence[:, i] = p_token
        if dist is not None:
            probs.append(dist)
        can_draft, p_tokens = torch.stack([possible.to(p_token.dtype), p_token]).tolist()  # one sync
        for b, (can, p) in enumerate(zip(can_draft, p_tokens)):
            if active[b] and not can:
                active[b] = False
            elif active[b]:
                lengths[b] = i + 1
                active[b] = i + 1 < max_tokens[b] and (request.do_sample or p >= min_confidence)
        if not any(active):
            break
    width = max(lengths, default=0)
    stacked = torch.stack(probs, dim=1)[:, :width] if request.do_sample and probs else None
    return Draft(drafted[:, :width], lengths, stacked, confidence[:, :width])


def right_aligned(
    chunks: list[torch.Tensor], device: torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged chunks [n_b, ...] as [B, T, ...], right-aligned so that every row's newest entry is
    in the last column, and which entries are real, [B, T]."""
    width = max(len(c) for c in chunks)
    stacked = torch.zeros(
        len(chunks), width, *chunks[0].shape[1:], dtype=dtype or chunks[0].dtype, device=device
    )
    valid = torch.zeros(len(chunks), width, dtype=torch.bool, device=device)
    for b, chunk in enumerate(chunks):
        if len(chunk):
            stacked[b, width - len(chunk) :] = chunk.to(device, stacked.dtype)
            valid[b, width - len(chunk) :] = True
    return stacked, valid
