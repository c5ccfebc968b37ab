"""The drafter base class: one signature for every draft source, with documented defaults."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..timing import clock

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig
    from ..draft import Draft, DraftRequest


def elapsed(start: float, result: torch.Tensor) -> float:
    """Seconds since `start` (a `timing.clock` read) once `result`'s device has finished computing it."""
    return clock(result.device) - start


def options_to_config(config_cls: type, options: dict[str, Any]) -> Any:
    """Build a drafter's config dataclass from `SpeculativeConfig.options`, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"Unknown option(s) {unknown} for {config_cls.__name__}; valid: {sorted(known)}.")
    return config_cls(**options)


class Drafter:
    """A draft source: subclass it, one per module in `hf_specdec/drafters/`, and register it by name.

    The loop calls every method below on every drafter; the defaults say what a drafter without the
    capability does, so that nothing is probed with `getattr`.
    """

    name: ClassVar[str]
    # Whether `propose` can sample (`DraftRequest.do_sample`) and return the distributions it
    # sampled from; a greedy-only drafter is refused before generating with do_sample=True.
    supports_sampling: ClassVar[bool] = True
    # Target layers whose hidden states the drafter reads (EAGLE/Medusa-style heads); () for none.
    # Indices into the model's `hidden_states` output (0 = embeddings, -1 = last). A drafter that
    # learns them from its head sets them on the instance.
    hidden_state_layers: tuple[int, ...] = ()
    # Whether `propose` can answer `DraftRequest.tree` with a tree of candidates (`Draft.parents`);
    # `SpeculativeConfig(tree=True)` is refused for drafters that only draft chains.
    supports_tree: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        """Build the drafter for one `generate` call (state lives in the instance, i.e. the call)."""
        raise NotImplementedError

    def propose(self, request: DraftRequest) -> Draft:
        """Propose up to `request.max_tokens[b]` tokens for each row b."""
        raise NotImplementedError

    def observe(self, draft: Draft, accepted: list[int]) -> None:
        """Learn that row b of `draft` (as verified, possibly cut shorter than proposed) had its
        first `accepted[b]` tokens accepted. By default nothing is learnt."""

    def probe_seconds(self, batch_size: int) -> float | None:
        """The seconds one draft token costs for `batch_size` rows, timed without touching the
        drafter's state, so that a draft too slow to ever pay is never explored (exploring also pays
        the draft's catch-up over the prompt). None (the default): it cannot be timed up front, as
        for drafters whose tokens cost next to nothing."""
        return None
