"""The drafter registry: `method="..."` is a look-up in `DRAFTERS`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a drafter available as `SpeculativeConfig(method=cls.name)`."""
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(
            f"{cls!r} is not a drafter: subclass hf_specdec.drafters.Drafter, whose defaults cover what "
            "a drafter does not need (observe, probe_seconds, hidden_state_layers)."
        )
    DRAFTERS[cls.name] = cls
    return cls


def build_drafter(config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
    """Instantiate the drafter `config.method` names (after "auto" has been resolved)."""
    try:
        cls = DRAFTERS[config.method]
    except KeyError:
        valid = ", ".join(sorted(["auto", *DRAFTERS]))
        raise ValueError(f"Unknown speculative method {config.method!r}; valid methods: {valid}.") from None
    return cls.from_config(config, target, tokenizer)
