"""The KV cache of an ONNX decoder: `kv.RaggedKV`'s interface, in IO-bound buffers.

The KV cache lives in preallocated buffers on the session's device, bound with IO binding so
nothing round-trips through the host per step. The Hub layout concatenates past and new keys into
`present`, so each tensor has two buffers that take turns: past is read from one, present is
written into the other. Holes left by rejected drafts in a batch are masked as in `kv.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import torch

from ..core.masks import spanning
from .layout import LOGITS_TO_KEEP, TREE_MASK, io_names

# Tokens fed per session run where a forward is longer (a prompt): exported graphs attend through
# [batch, heads, new, past + new] scores and a 4-D mask as large, which one run over a whole prompt
# materializes at once (memory and time quadratic in its length, where the target's sdpa is not);
# in chunks they stay [..., PREFILL_CHUNK, past + new].
PREFILL_CHUNK = 512


class ExportedDecoder(Protocol):
    """What the cache reads of the decoder it serves (`session.OnnxDecoder`): its session and the
    layout of its graph. A protocol, so that the session module can build caches without a cycle."""

    session: Any  # onnxruntime.InferenceSession
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    has_position_ids: bool
    has_cache_branch: bool
    has_tree_mask: bool
    has_logits_to_keep: bool


class OrtKV:
    """`kv.RaggedKV` for an ONNX decoder: same interface, KV in IO-bound ping-pong buffers."""

    def __init__(self, decoder: ExportedDecoder, batch_size: int) -> None:
        self.decoder = decoder
        device = decoder.device
        self.mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, cache_len]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # real tokens per row
        n = 2 * decoder.num_layers
        start = 64 * batch_size * decoder.kv_heads * decoder.head_dim  # 64 positions per row
        self.buffers = [[self._alloc(start), self._alloc(start)] for _ in range(n)]
        self.current = 0  # which buffer of each pair holds the cache
        self.logits = torch.empty(0, dtype=decoder.dtype, device=device)
        self.binding = decoder.session.io_binding()
        _, out_names = io_names(decoder.num_layers)
        in_names, _ = io_names(decoder.num_layers)
        self.past_names, self.present_names = in_names[3:], out_names[1:]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @property
    def takes_tree_masks(self) -> bool:
        """Whether the graph has our `TREE_MASK` input. Without it (Hub exports, and ours of
        sliding-window models) the graph builds its causal mask from the 2-D `attention_mask`:
        one mask per row, none per token, so tree drafts give each node a row of its own
        (`drafters.decoder.BranchRows`)."""
        return self.decoder.has_tree_mask

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int = 0,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SimpleNamespace:
        """The contract of `drafters.decoder.DecoderCache.forward`, `tree` where `takes_tree_masks`.
        A chain forward longer than `PREFILL_CHUNK` tokens whose last `logits_to_keep` are kept
        runs in chunks of that many, the last one returning the logits."""
        new = tokens.shape[1]
        if tree is None and 0 < logits_to_keep <= PREFILL_CHUNK < new:
            last = new - PREFILL_CHUNK
            for start in range(0, last, PREFILL_CHUNK):
                end = min(start + PREFILL_CHUNK, last)
                self._forward(tokens[:, start:end], valid[:, start:end], 1, None)
            tokens, valid = tokens[:, last:], valid[:, last:]
        return self._forward(tokens, valid, logits_to_keep, tree)

    def _forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        logits_to_keep: int,
        tree: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> SimpleNamespace:
        """One session run over `tokens`."""
        device = self.decoder.device
        tokens, valid = tokens.to(device), valid.to(device)
        if tree is None:
            positions = (self.lengths[:, None] + valid.cumsum(dim=1) - 1).clamp_min(0)
        else:
            positions = self.lengths[:, None] + tree[1].to(device)
        past = self.width
        self.mask = torch.cat([self.mask, valid], dim=1)
        self.lengths = self.lengths + valid.sum(dim=1)
        batch, new = tokens.shape
        self._alive: list[torch.Tensor] = []  # ORT holds only pointers to bound tensors
        feeds = {"input_ids": tokens.contiguous(), "attention_mask": self.mask.long()}
        if self.decoder.has_position_ids:
            feeds["position_ids"] = positions.contiguous()
        if self.decoder.has_cache_branch:
            feeds["use_cache_branch"] = torch.ones(1, dtype=torch.bool, device=device)
        if self.decoder.has_tree_mask:  # bound on every run: a binding outlives the run
            feeds[TREE_MASK] = self._tree_mask(tree)
        for name, tensor in feeds.items():
            self._bind(name, tensor, output=False)
        computed = new  # positions the session computes logits for
        if self.decoder.has_logits_to_keep:
            computed = min(logits_to_keep, new) if logits_to_keep else new
            # Bound on every run (a binding outlives the run; 0 keeps every position). A shape-like
            # input: ONNX Runtime reads it on the host whatever the provider.
            self._bind(LOGITS_TO_KEEP, torch.tensor([computed]), output=False)
        for i, (past_name, present_name) in enumerate(zip(self.past_names, self.present_names)):
            self._bind(past_name, self._view(i, self.current, past), output=False)
            self._bind(present_name, self._view(i, 1 - self.current, self.width), output=True)
        self._bind("logits", self._logits_view(batch, computed), output=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # torch wrote the inputs
        self.decoder.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()
        self.current = 1 - self.current
        logits = self._logits_view(batch, computed)
        return SimpleNamespace(logits=(logits[:, -logits_to_keep:] if logits_to_keep else logits).clone())

    def _tree_mask(self, tree: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """`TREE_MASK` [B, new, cache_len]: a tree's `visible` over its last columns; without a
        tree the [1, 1, 1] True that broadcasts (every column `attention_mask` allows)."""
        device = self.decoder.device
        if tree is None:
            return torch.ones(1, 1, 1, dtype=torch.bool, device=device)
        return spanning(tree[0].to(device), self.width)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep only the first `lengths[b]` real tokens of each row b; the rest become holes."""
        lengths = lengths.to(self.mask.device)
        self.mask &= self.mask.cumsum(dim=1) <= lengths[:, None]
        self.lengths = self.mask.sum(dim=1)
        self._relayout(torch.arange(self.mask.shape[0], device=self.mask.device))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep `rows` (indices into the current batch, in that order; repeats copy a row), e.g.
        when others have finished, or one row per node of a tree draft."""
        rows = rows.to(self.mask.device)
        old_batch = self.mask.shape[0]
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]
        self._relayout(rows, old_batch)

    def _relayout(self, rows: torch.Tensor, old_batch: int | None = None) -> None:
        """Copy the kept rows and the used columns into the other buffer of each pair."""
        old_batch = old_batch or self.mask.shape[0]
        old_width = self.width
        used = torch.nonzero(self.mask.any(dim=0))
        width = 0 if used.numel() == 0 else int(used[-1]) + 1
        unchanged = len(rows) == old_batch and bool(
            (rows == torch.arange(old_batch, device=rows.device)).all()
        )
        if width == old_width and unchanged:
            return
        self.mask = self.mask[:, :width]
        for i in range(len(self.buffers)):
            source = self._view(i, self.current, old_width, batch=old_batch)[:, :, :width]
            # Gathered straight into the other buffer: one copy per tensor, not two.
            torch.index_select(source, 0, rows, out=self._view(i, 1 - self.current, width))
        self.current = 1 - self.current

    def _view(self, i: int, which: int, width: int, batch: int | None = None) -> torch.Tensor:
        """Buffer `which` of KV tensor i as a contiguous [B, kv_heads, width, head_dim], grown if needed."""
        d = self.decoder
        shape = (batch or self.mask.shape[0], d.kv_heads, width, d.head_dim)
        size = int(np.prod(shape))
        if self.buffers[i][which].numel() < size:
            self.buffers[i][which] = self._alloc(max(size, 2 * self.buffers[i][which].numel()))
        return self.buffers[i][which][:size].view(shape)

    def _logits_view(self, batch: int, new: int) -> torch.Tensor:
        size = batch * new * self.decoder.vocab_size
        if self.logits.numel() < size:
            self.logits = torch.empty(size, dtype=self.decoder.dtype, device=self.decoder.device)
        return self.logits[:size].view(batch, new, self.decoder.vocab_size)

    def _alloc(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.decoder.dtype, device=self.decoder.device)

    def _bind(self, name: str, tensor: torch.Tensor, output: bool) -> None:
        device = tensor.device
        args = (
            name,
            device.type,
            device.index or 0,
            _np_dtype(tensor.dtype),
            list(tensor.shape),
            tensor.data_ptr(),
        )
        if output:
            self.binding.bind_output(*args)
        else:
            self.binding.bind_input(*args)
        self._alive.append(tensor)


def _np_dtype(dtype: torch.dtype) -> Any:
    return {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.int64: np.int64,
        torch.bool: np.bool_,
    }[dtype]
