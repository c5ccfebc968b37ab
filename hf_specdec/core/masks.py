"""Attention masks built outside a model, for what its own masks cannot say (holes in a row's cache,
a tree draft's nodes, a draft head's queries): the rules every builder shares. `kv.RaggedKV`'s masks
(sliding windows, trees), our draft heads', an assistant's over its target's cache and the tree mask
of our ONNX exports are made of these; what differs between them is said where they are built.

Imports nothing of ours; pure tensor functions.
"""

from __future__ import annotations

import torch


def allowed_keys(
    real: torch.Tensor,  # [B, K] bool: which key columns hold real tokens
    queries: torch.Tensor,  # [Q] the column each query sits at
    visible: torch.Tensor | None = None,  # [B, Q, K] bool, or broadcast to it: a tree's (`spanning`)
) -> torch.Tensor:
    """Which keys each query sees, [B, Q, K]: the real ones up to its own column (a tree draft's node:
    of those, only the `visible` ones, the cache and its ancestors) and itself always, so that no
    row of the softmax is empty whatever holes a row has (a hole or a padding query sees itself)."""
    columns = torch.arange(real.shape[1], device=real.device)
    allowed = real[:, None, :] & (columns[None, None, :] <= queries[None, :, None])
    if visible is not None:
        allowed = allowed & visible
    return allowed | (columns[None, None, :] == queries[None, :, None])


def spanning(visible: torch.Tensor, width: int) -> torch.Tensor:
    """A tree draft's `visible` [B, Q, F], which of the last F of `width` columns each node sees (the
    tree's columns fed so far), over all `width`: the columns before are the cache, which every node
    sees (as far as `allowed_keys` lets it)."""
    before = visible.new_ones(*visible.shape[:2], width - visible.shape[2])
    return torch.cat([before, visible], dim=2)


def cache_places(real: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Each column's place in its row's sequence as plain decoding's cache lays it out, [B, K]: the
    prompt's first `prompt_width` columns, its padding included (transformers counts a sliding
    window in cache columns), then the real tokens; a hole takes no place (it shares the one
    before). Where a sliding window is counted from."""
    counted = real.clone()
    counted[:, :prompt_width] = True
    return counted.cumsum(dim=1) - 1


def in_attention_format(
    allowed: torch.Tensor, implementation: str, dtype: torch.dtype | None
) -> torch.Tensor:
    """`allowed` [B, Q, K] as the 4D mask [B, 1, Q, K] a model's attention takes: eager adds a mask of
    `dtype` to its scores (0 where a key is seen, the dtype's lowest where not); sdpa, and our draft
    heads, take the booleans as they are (True: attend; `dtype` unread)."""
    allowed = allowed[:, None]
    if implementation != "eager":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
