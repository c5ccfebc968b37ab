"""The drafter protocol: one signature for every draft source."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig
    from ..draft import Draft, DraftRequest


def elapsed(start: float, result: torch.Tensor) -> float:
    """Seconds since `start` once the device has finished computing `result`."""
    if result.is_cuda:
        torch.cuda.synchronize(result.device)
    return time.perf_counter() - start


def options_to_config(config_cls: type, options: dict[str, Any]) -> Any:
    """Build a drafter's config dataclass from `SpeculativeConfig.options`, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown option(s) {unknown} for {config_cls.__name__}; valid: {sorted(known)}.")
    return config_cls(**options)


class Drafter(Protocol):
    """A draft source. Implementations live one per module in `hf_specdec/drafters/`."""

    name: ClassVar[str]
    supports_sampling: ClassVar[bool]
    # Target layers whose hidden states the drafter reads (EAGLE/Medusa-style heads); () for none.
    # Indices into the model's `hidden_states` output (0 = embeddings, -1 = last).
    hidden_state_layers: ClassVar[tuple[int, ...]] = ()

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        """Build the drafter for one `generate` call (state lives in the instance, i.e. the call)."""
        ...

    def propose(self, request: DraftRequest) -> Draft:
        """Propose up to `request.max_tokens[b]` tokens for each row b."""
        ...

    def observe(self, draft: Draft, accepted: list[int]) -> None:
        """Learn that row b of `draft` (as verified, possibly cut shorter than proposed) had its
        first `accepted[b]` tokens accepted. Drafters without anything to learn do nothing."""
        ...

    # Optional: `probe_seconds(batch_size) -> float`, the seconds one draft token costs for
    # `batch_size` rows, timed without touching the drafter's state. Drafters whose tokens cost a
    # model forward define it, so that a draft too slow to ever pay is never explored (exploring
    # also pays the draft's catch-up over the prompt).
