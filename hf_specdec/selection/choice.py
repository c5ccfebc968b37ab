"""What a draft selection answers (`DraftChoice`), shared by the registry look-up (`selection`) and
the Hub search (`hub_search`)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

DRAFT_FREE_METHOD = "ngram"
# What `speculative=True` drafts with where no draft model is chosen: prompt lookup, plus the model's
# corpus of earlier calls wherever its replays show that it beats prompt lookup alone
# (`drafters/suffix.py`); until then its drafts are prompt lookup's.
DRAFT_FREE_AUTO = "suffix"
# `DRAFT_FREE_AUTO` in a reason: the method, and what it drafts from.
DRAFT_FREE_AUTO_WORDS = f"{DRAFT_FREE_AUTO!r} (prompt lookup, plus earlier calls' outputs once they pay)"


def auto_method(method: str) -> str:
    """The drafter `speculative=True` runs for a choice of `method`: `DRAFT_FREE_AUTO` for draft-free."""
    return DRAFT_FREE_AUTO if method == DRAFT_FREE_METHOD else method


# The target's own draft heads (its MTP layers, its official assistant): chosen before any other draft.
OWN_HEAD_METHODS = ("mtp", "assistant")
_SIZE = re.compile(r"(?:^|[-_])(?:\d+x)?(\d+(?:\.\d+)?)([MmBb])(?=$|[-_])")
_SCALE = {"m": 1e6, "b": 1e9}


class DraftSelectionError(RuntimeError):
    """The target itself cannot be examined (gated, private, missing); the message says what to do."""


class DraftUnavailableError(RuntimeError):
    """A chosen draft cannot be loaded safely, or is no longer what was checked; the message says why.

    `lasting`: whether it will fail the same way next time (a deleted repo or revision, remote code,
    another tokenizer) rather than maybe work (offline without the files, the Hub unreachable)."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


@dataclass
class DraftChoice:
    """How to speculate for one target, and why.

    Attributes:
        method: a drafter name: `"draft_model"`, `"mtp"` (the target's own MTP layers), or a
            draft-free method such as `"ngram"`.
        draft: the draft's repo id or local folder; None for draft-free methods.
        reason: one sentence for humans.
        target: the repo id the decision was made for (None for a local folder with no Hub origin).
        source: where the answer came from: `"checkpoint"` (the target's own draft heads, in its
            checkpoint), `"registry"`, `"hub"`, `"cache"`, `"offline"` (not in the
            registry, no cached decision, Hub not searched) or `"local"` (a folder with no Hub origin).
        size_ratio: draft parameters / target parameters, when known.
        tokenizer_check: how the tokenizers were compared, and the outcome.
        revision: the commit (sha) of `draft` that the Hub search checked; the draft is always
            loaded at it, whatever the repo's `main` is now. None for registry drafts (reviewed
            repos, loaded at the commit `main` is at) and draft-free choices.
        tokenizer_fingerprint: `tokenizer_check.tokenizer_fingerprint` of the draft tokenizer the
            search compared with the target's; a draft whose tokenizer differs from it is not used.
        rejected: candidates the Hub search looked at and why each was not taken.
        heads: published draft heads trained on the target (registry `[[head]]` entries), each a dict
            with `method` ("eagle" or "medusa"), `head` (its Hub repo), `layout` and `source`; use one
            with `speculative=dict(method=h["method"], draft=h["head"])`.
        translation: None for a draft that shares the target's tokenizer; "intersection" for one of
            another tokenizer, chosen only where none shares it, which drafts over the tokens both
            vocabularies share (`DraftModelConfig.translation`).
    """

    method: str
    draft: str | None
    reason: str
    target: str | None = None
    source: str = "registry"
    size_ratio: float | None = None
    tokenizer_check: str | None = None
    rejected: list[str] = field(default_factory=list)
    heads: list[dict[str, str]] = field(default_factory=list)
    revision: str | None = None
    tokenizer_fingerprint: str | None = None
    translation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> DraftChoice:
        """The choice `to_dict` wrote; ValueError naming the first field of the wrong type (or
        missing) when `data` is not one. Unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"a draft choice is a JSON object, not {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.name not in data:
                if required:
                    raise ValueError(f"the draft choice has no {f.name!r}")
            elif not _is_of(data[f.name], hints[f.name]):
                raise ValueError(
                    f"the draft choice's {f.name!r} is {data[f.name]!r:.60}, not {hints[f.name]}"
                )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _is_of(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type hint (`str | None`, `list[str]`, `float`, ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_of(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_is_of(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _is_of(k, args[0]) and _is_of(v, args[1]) for k, v in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and not (isinstance(value, bool) and hint is not bool)


def params_from_name(repo_id: str) -> float | None:
    """Parameters read from a name such as `Qwen2.5-7B-Instruct` (7e9); None without a size."""
    match = _SIZE.search(repo_id.split("/")[-1])
    return float(match.group(1)) * _SCALE[match.group(2).lower()] if match else None
