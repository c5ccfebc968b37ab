"""The drafter registry: `method="..."` is a look-up in `DRAFTERS`."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from .base import Drafter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig

# Kept across a reload of this module (notebook autoreload): the drafters registered themselves when
# their modules were imported, and a fresh dict would forget them all.
DRAFTERS: dict[str, type[Drafter]] = globals().get("DRAFTERS", {})


def register_drafter(cls: type[Drafter] | None = None, *, replace: bool = False) -> Any:
    """Class decorator: make a drafter available as `SpeculativeConfig(method=cls.name)`.

    A name already taken by another class is refused; `@register_drafter(replace=True)` replaces it.
    """
    if cls is None:
        return functools.partial(register_drafter, replace=replace)
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(
            f"{cls!r} is not a drafter: subclass hf_specdec.drafters.Drafter, whose defaults cover what "
            "a drafter does not need (observe, probe_seconds, hidden_state_layers)."
        )
    existing = DRAFTERS.get(cls.name)
    if existing is not None and _same_definition(existing, cls):
        replace = True  # its module was reloaded (importlib.reload, notebook autoreload)
    if existing is not None and existing is not cls and not replace:
        raise ValueError(
            f"A drafter named {cls.name!r} is already registered ({existing.__module__}."
            f"{existing.__qualname__}); give {cls.__qualname__} another `name`, or pass replace=True "
            "to replace it."
        )
    DRAFTERS[cls.name] = cls
    return cls


def _same_definition(a: type, b: type) -> bool:
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def build_drafter(config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
    """Instantiate the drafter `config.method` names (after "auto" has been resolved)."""
    try:
        cls = DRAFTERS[config.method]
    except KeyError:
        valid = ", ".join(sorted(["auto", *DRAFTERS]))
        # No method is named with a slash: a repo id or a path, which goes in `draft`.
        draft = "/" in config.method or os.sep in config.method
        where = (
            f" A draft goes in draft=: speculative=dict(draft={config.method!r}), which method 'auto' "
            "runs by what it is."
            if draft
            else ""
        )
        raise ValueError(
            f"Unknown speculative method {config.method!r}; valid methods: {valid}.{where}"
        ) from None
    if config.draft is not None and not cls.takes_draft:
        given = (
            repr(config.draft)
            if isinstance(config.draft, (str, os.PathLike))
            else type(config.draft).__name__
        )
        raise ValueError(
            f"method={config.method!r} drafts without a draft of yours, and draft={given} would go "
            "unused: drop draft= (and draft_tokenizer=), or pass method='draft_model' to draft with it "
            "(method='auto' chooses the method for the draft given)."
        )
    if config.draft_tokenizer is not None and not cls.takes_draft_tokenizer:
        raise ValueError(
            f"method={config.method!r} drafts in the target's own tokens, and draft_tokenizer= would go "
            "unused: drop it (it is for a draft model with a tokenizer of its own, method='draft_model')."
        )
    return cls.from_config(config, target, tokenizer)
