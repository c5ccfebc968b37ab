"""What a draft selection answers (`DraftChoice`), shared by the registry look-up (`selection`) and
the Hub search (`hub_search`)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

DRAFT_FREE_METHOD = "ngram"
_SIZE = re.compile(r"(?:^|[-_])(?:\d+x)?(\d+(?:\.\d+)?)([MmBb])(?=$|[-_])")
_SCALE = {"m": 1e6, "b": 1e9}


class DraftSelectionError(RuntimeError):
    """The target itself cannot be examined (gated, private, missing); the message says what to do."""


@dataclass
class DraftChoice:
    """How to speculate for one target, and why.

    Attributes:
        method: a drafter name: `"draft_model"`, or a draft-free method such as `"ngram"`.
        draft: the draft's repo id or local folder; None for draft-free methods.
        reason: one sentence for humans.
        target: the repo id the decision was made for (None for a local folder with no Hub origin).
        source: where the answer came from: `"registry"`, `"hub"`, `"cache"`, `"offline"` (not in the
            registry, no cached decision, Hub not searched) or `"local"` (a folder with no Hub origin).
        size_ratio: draft parameters / target parameters, when known.
        tokenizer_check: how the tokenizers were compared, and the outcome.
        rejected: candidates the Hub search looked at and why each was not taken.
        heads: published draft heads trained on the target (registry `[[head]]` entries), each a dict
            with `method` ("eagle" or "medusa"), `head` (its Hub repo), `layout` and `source`; use one
            with `speculative=dict(method=h["method"], draft=h["head"])`.
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftChoice:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def params_from_name(repo_id: str) -> float | None:
    """Parameters read from a name such as `Qwen2.5-7B-Instruct` (7e9); None without a size."""
    match = _SIZE.search(repo_id.split("/")[-1])
    return float(match.group(1)) * _SCALE[match.group(2).lower()] if match else None
