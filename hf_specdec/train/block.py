"""Training a DFlash block draft: many blocks per sequence, each anchored at a token of the target's
answer, trained in one forward with a mask that keeps every block to its own context.

As in the DFlash recipe (Chen et al. 2026, §4): block j anchored at position a_j sees the context of
positions < a_j (the target's hidden states there) and its own block [x_{a_j}, mask, ..., mask],
whole; block position i >= 1 learns the target's greedy token at a_j + i, weighted by
exp(-(i - 1) / γ) so that the early positions, which every accepted draft passes through, count most.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..heads.dflash import attention_masks


def default_target_layers(num_layers: int, count: int = 5) -> list[int]:
    """The decoder layers a draft reads when none are given: `count` of them evenly from layer 1 to
    layer L - 3, the rule behind z-lab's published drafts (Qwen3-8B, 36 layers: 1, 9, 17, 25, 33;
    Llama-3.1-8B, 32 layers: 1, 8, 15, 22, 29)."""
    first = min(1, num_layers - 1)
    last = max(first, num_layers - 3)
    count = min(count, last - first + 1)
    if count == 1:
        return [last]
    return sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)})


def block_loss(
    head: Any,
    ids: torch.Tensor,  # [B, T]
    features: torch.Tensor,  # [B, T, layers * H]
    labels: torch.Tensor,  # [B, T] draft-vocabulary index of the target's greedy next token, -100 outside
    valid: torch.Tensor,  # [B, T]
    answer: torch.Tensor,  # [B, T] positions of the target's own answer
    anchors: int,
    gamma: float,
    every_anchor: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted cross-entropy of `anchors` random blocks per row (every possible one with
    `every_anchor`), and for judging: which block positions predicted their label [B, A, D] and
    which had one [B, A, D]."""
    config = head.config
    size, drafts = config.block_size, config.drafts_per_block
    batch, length = ids.shape
    device = ids.device
    # A block can start at any real token whose next token is in the answer.
    starts = valid & torch.cat([answer[:, 1:], answer.new_zeros(batch, 1)], dim=1)
    chosen = _anchor_positions(starts, anchors, every_anchor)  # [B, A], -1 for none
    count = chosen.shape[1]
    if count == 0:
        nothing = torch.zeros(batch, 0, drafts, dtype=torch.bool, device=device)
        return head.fc.weight.sum() * 0.0, nothing, nothing
    used = chosen >= 0
    at = chosen.clamp(min=0)

    positions = torch.arange(length, device=device)[None].expand(batch, -1)
    block_at = (at[:, :, None] + torch.arange(size, device=device)).flatten(1)  # [B, A * S]
    embeds = head.embed_block(ids.gather(1, at).flatten()).reshape(batch, count * size, -1)
    context = head.context_keys(features, positions)
    # Keys: the sequence's context, then every block; block j's queries see context before its
    # anchor and block j itself (the layers' windows and causality on top, as when drafting).
    keys_at = torch.cat([positions, block_at], dim=1)
    # Blocks of rows with fewer anchors are padding, but still see themselves: no query attends to
    # nothing (whose NaN would reach the gradients).
    key_valid = torch.cat([valid, torch.ones_like(block_at, dtype=torch.bool)], dim=1)
    masks = attention_masks(config, block_at, keys_at, key_valid, length)
    own = torch.arange(count, device=device).repeat_interleave(size)  # [A * S] each query's block
    before_anchor = positions[:, None, :] < at.repeat_interleave(size, dim=1)[:, :, None]
    same_block = (own[:, None] == own[None, :])[None].expand(batch, -1, -1)
    sees = torch.cat([before_anchor, same_block], dim=2)
    masks = {kind: mask & sees for kind, mask in masks.items()}
    hidden = head.run_block(embeds, block_at, context, masks).reshape(batch, count, size, -1)
    hidden = head.drafting_outputs(hidden.flatten(0, 1)).reshape(batch, count, drafts, -1)

    # Draft i of block j is token a_j + i + 1, whichever block position drafts it: its label is the
    # target's choice after position a_j + i.
    target_at = at[:, :, None] + torch.arange(drafts, device=device)  # [B, A, D] where the label is read
    inside = (target_at + 1 < length) & used[:, :, None]
    label = labels.gather(1, target_at.clamp(max=length - 1).flatten(1)).reshape(batch, count, drafts)
    drafted = answer.gather(1, (target_at + 1).clamp(max=length - 1).flatten(1)).reshape(batch, count, drafts)
    inside &= drafted
    inside = inside.int().cumprod(dim=2).bool()  # a block is judged up to its first unusable label
    scored = inside & (label != -100)
    logits = head.logits(hidden[scored])
    weights = torch.exp(-torch.arange(drafts, device=device, dtype=torch.float) / gamma)
    weights = weights[None, None].expand(batch, count, -1)[scored]
    if logits.shape[0]:
        losses = F.cross_entropy(logits.float(), label[scored], reduction="none")
        loss = (losses * weights).sum() / weights.sum()
    else:
        loss = hidden.sum() * 0.0
    correct = torch.zeros_like(inside)
    correct[scored] = logits.argmax(-1) == label[scored]
    return loss, correct, inside


def _anchor_positions(starts: torch.Tensor, anchors: int, every: bool) -> torch.Tensor:
    """Per row, `anchors` distinct positions where `starts` holds, in order ([B, A], -1 padding)."""
    if every:
        count = int(starts.sum(dim=1).max())
        order = torch.where(starts, torch.arange(starts.shape[1], device=starts.device), starts.shape[1])
    else:
        count = min(anchors, int(starts.sum(dim=1).max()))
        noise = torch.rand(starts.shape, device=starts.device)
        order = torch.where(starts, noise.argsort(dim=1).argsort(dim=1), starts.shape[1])
    picked = order.argsort(dim=1)[:, :count]  # positions with the lowest keys
    return torch.where(starts.gather(1, picked), picked, -1)


def acceptance(correct: torch.Tensor, inside: torch.Tensor) -> dict[str, Any]:
    """Greedy acceptance of judged blocks: per position, how often it is right given the positions
    before it were, and τ = 1 + the mean run of right positions from a block's start."""
    judged = inside[..., 0]
    if not bool(judged.any()):
        return {"acceptance": [], "tau": 1.0}
    run = (correct & inside).int().cumprod(dim=-1)[judged]  # [N, D]
    reached = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=1)  # positions before all right
    possible = inside[judged] & reached.bool()
    rates = [
        round(float(run[:, i][possible[:, i]].float().mean()), 4) if bool(possible[:, i].any()) else 0.0
        for i in range(run.shape[1])
    ]
    return {"acceptance": rates, "tau": round(1 + float(run.sum(dim=1).float().mean()), 3)}


def loss_decay(block_size: int) -> float:
    """γ of the position weights: DFlash's 7 for blocks of 16, 5 for 10, 4 for 8, scaled between."""
    return max(1.0, round(7 * math.sqrt(block_size / 16), 1))
