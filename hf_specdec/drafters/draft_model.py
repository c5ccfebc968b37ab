"""A separate, smaller causal LM that shares the target's tokenizer drafts autoregressively."""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..devices import execution_device
from ..kv import RaggedKV
from ..tokenizer_check import compare_tokenizers_once
from . import register_drafter
from .base import Draft, Drafter, DraftRequest, elapsed, options_to_config
from .heads import chain, real_tokens, right_aligned

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


@dataclass
class DraftModelConfig:
    """Settings of the `draft_model` drafter.

    Args:
        min_confidence: stop a greedy draft early once the draft's own probability of its next
            token falls below this (llama.cpp's `--draft-p-min`); 0 always drafts the full length.
        tokenizer_verified: the pair's tokenizers are known to agree (set by automatic draft
            selection, which compared them), so no vocabulary-size check is needed.
    """

    min_confidence: float = 0.0
    tokenizer_verified: bool = False


# Loaded drafts by (name, dtype, device): loading takes seconds, a generate call should not.
_LOADED: dict[tuple[str, torch.dtype, str], tuple[Any, Any]] = {}


def load_draft(name: str, target: PreTrainedModel) -> tuple[PreTrainedModel, Any]:
    """Load a draft model and its tokenizer with the target's dtype and device (cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = execution_device(target)  # not `target.device`: `meta` when device_map offloads its weights
    key = (str(name), target.dtype, str(device))
    if key not in _LOADED:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=target.dtype).to(device).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError):
            tokenizer = None
        _LOADED.clear()  # keep one draft in memory, not every one ever used
        _LOADED[key] = (model, tokenizer)
    return _LOADED[key]


def check_compatible(
    target: PreTrainedModel, target_tokenizer: Any, draft: PreTrainedModel, draft_tokenizer: Any
) -> None:
    """Refuse a draft whose token ids mean something else; warn when that cannot be checked."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        check = compare_tokenizers_once(target_tokenizer, draft_tokenizer)
        if not check.compatible:
            raise ValueError(
                f"The draft model cannot draft for this target: its {check.explain()}. "
                "Use a draft from the same model family, or method='ngram'."
            )
        return
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"The draft's vocabulary has {draft_vocab} entries but the target's has {target_vocab}, and no "
            "tokenizers were given to compare. Pass `draft_tokenizer=` in the SpeculativeConfig and "
            "`tokenizer=` to generate() so the vocabularies can be compared token by token."
        )
    warnings.warn(
        "Draft compatibility was judged by vocabulary size only. Pass the draft's tokenizer "
        "(`SpeculativeConfig(draft_tokenizer=...)`) and the target's (`generate(tokenizer=...)`) to check "
        "that token ids mean the same strings; a mismatch does not break correctness, only speed.",
        stacklevel=4,
    )


@register_drafter
class DraftModelDrafter:
    """Drafts with a small model, greedily or by sampling from its processed distribution."""

    name: ClassVar[str] = "draft_model"
    supports_sampling: ClassVar[bool] = True

    def __init__(self, draft: PreTrainedModel, config: DraftModelConfig, device: torch.device) -> None:
        self.model = draft
        self.config = config
        self.device = device  # the target's: tokens come in and go out there
        self.kv: RaggedKV | None = None
        self.cached: list[torch.Tensor] = []  # per row: the real tokens the draft cache holds
        self.row_ids: list[int] = []

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        if config.draft is None:
            raise ValueError(
                "method='draft_model' needs a draft: "
                "SpeculativeConfig(method='draft_model', draft='repo/or/path') or draft=<a loaded model>."
            )
        from ..onnx import is_onnx_folder

        if is_onnx_folder(config.draft):  # an exported folder with no PyTorch weights
            from .onnx import OnnxDrafter

            return OnnxDrafter.from_config(config, target, tokenizer)
        if isinstance(config.draft, (str, Path)):
            draft, draft_tokenizer = load_draft(str(config.draft), target)
        else:
            draft, draft_tokenizer = config.draft, config.draft_tokenizer
        if draft is target:
            warnings.warn(
                "The draft is the target itself: every draft is accepted but nothing is gained.", stacklevel=4
            )
        options = options_to_config(DraftModelConfig, config.options)
        if not options.tokenizer_verified:
            if tokenizer is None and draft_tokenizer is not None:
                tokenizer = _local_tokenizer(target)
            check_compatible(target, tokenizer, draft, draft_tokenizer)
        return cls(draft.eval(), options, execution_device(target))

    def propose(self, request: DraftRequest) -> Draft:
        self._follow_rows(request.row_ids)
        draft_device = self.model.device
        real = [real_tokens(request, b) for b in range(len(request.row_ids))]

        # Roll the cache back to what each row still shares with its sequence, then feed the rest.
        keep = [self._shared_prefix(self.cached[b], seq) for b, seq in enumerate(real)]
        self.kv.truncate(torch.tensor(keep, device=draft_device))
        pending = [seq[n:] for seq, n in zip(real, keep)]
        start = time.perf_counter()
        first = self.kv.forward(*right_aligned(pending, draft_device), logits_to_keep=1).logits[:, -1]
        fed = max(len(p) for p in pending)
        catch_up_seconds = elapsed(start, first) if request.is_catch_up(fed) else 0.0

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            if i == 0:
                return first.to(self.device)
            fed = torch.tensor(active, device=draft_device)[:, None]
            return (
                self.kv.forward(previous[:, None].to(draft_device), fed, logits_to_keep=1)
                .logits[:, -1]
                .to(self.device)
            )

        draft = chain(request, request.max_tokens, self.config.min_confidence, logits_at)
        draft.catch_up_seconds = catch_up_seconds
        fed = [max(n - 1, 0) for n in draft.lengths]  # a row's last draft token is never fed
        self.cached = [
            torch.cat([seq, draft.tokens[b, : fed[b]].to(seq.device)]) for b, seq in enumerate(real)
        ]
        return draft

    def probe_seconds(self, batch_size: int) -> float:
        """One draft forward of one token per row on an empty cache of its own: what a draft token
        costs at least, known before the catch-up over the prompt is paid. Best of two runs, since
        a fresh model's or ONNX session's first run is slow."""
        kv = self._new_kv(batch_size)
        tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=self.model.device)
        valid = torch.ones(batch_size, 1, dtype=torch.bool, device=self.model.device)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            kv.forward(tokens, valid, logits_to_keep=1).logits.cpu()  # .cpu(): wait for the device
            best = min(best, time.perf_counter() - start)
        return best

    def observe(self, draft: Draft, accepted: list[int]) -> None:
        pass  # the next propose() rolls back by comparing sequences, which also survives EOS and restarts

    def _follow_rows(self, row_ids: list[int]) -> None:
        if self.kv is None:
            self.kv = self._new_kv(len(row_ids))
            self.cached = [torch.zeros(0, dtype=torch.long, device=self.device) for _ in row_ids]
        elif row_ids != self.row_ids:
            where = [self.row_ids.index(r) for r in row_ids]
            self.kv.select_rows(torch.tensor(where, device=self.model.device))
            self.cached = [self.cached[i] for i in where]
        self.row_ids = list(row_ids)

    def _new_kv(self, batch_size: int) -> RaggedKV:
        return RaggedKV(self.model, None, batch_size, self.model.device)

    @staticmethod
    def _shared_prefix(cached: torch.Tensor, seq: torch.Tensor) -> int:
        """Length of the common prefix, leaving at least one token of `seq` to feed."""
        n = min(len(cached), len(seq) - 1)
        if n <= 0:
            return 0
        differs = torch.nonzero(cached[:n] != seq[:n].to(cached.device))
        return int(differs[0]) if differs.numel() else n


def _local_tokenizer(model: PreTrainedModel) -> Any:
    """The target's tokenizer when it was loaded from a local folder that has one, else None."""
    folder = Path(getattr(model, "name_or_path", "") or "")
    files = [folder / f for f in ("tokenizer.json", "tokenizer_config.json") if (folder / f).exists()]
    if not folder.is_dir() or not files:
        return None
    # Loading takes ~150 ms and happens on every generate call: keep it while the files are unchanged.
    return _load_tokenizer(str(folder.resolve()), tuple(f.stat().st_mtime_ns for f in files))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(folder: str, mtimes: tuple[int, ...]) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None
