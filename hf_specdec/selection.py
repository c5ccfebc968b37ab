"""Choose how to speculate for a target model: a draft model that shares its tokenizer, or none.

`select_draft(target)` answers from, in order:

1. the reviewed registry `configs/draft_pairs.toml` (works offline);
2. an earlier decision cached under `cache_dir() / "selections"` (works offline);
3. a search of the Hub (see `hf_specdec.hub_search`), whose decision is then cached.

With `HF_HUB_OFFLINE=1` only the first two are used. When nothing fits, the answer is a
draft-free method (`"ngram"`) with the reason. `load_draft(choice, target_model)` loads the draft.
Published draft heads (EAGLE, Medusa) the registry knows for the target are listed besides, in
`DraftChoice.heads` (see `known_heads`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM

from .choice import DRAFT_FREE_METHOD, DraftChoice, DraftSelectionError, params_from_name
from .hub import download_model, hub_offline
from .hub_search import search_draft
from .models import cache_dir

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_REGISTRY_NAME = "draft_pairs.toml"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def select_draft(
    target: Any,
    *,
    token: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> DraftChoice:
    """Choose a draft model (or a draft-free method) for `target`.

    Args:
        target: a Hub repo id, a local model folder, or a loaded `PreTrainedModel`.
        token: a Hugging Face token, needed when the target or a candidate is gated or private.
        revision: the target's revision (branch, tag or commit) on the Hub.
        trust_remote_code: allow drafts whose config needs custom code (`auto_map`); off by default.

    Raises:
        DraftSelectionError: the target is gated, private or missing on the Hub.
    """
    repo_id, note = _resolve_target(target)
    if repo_id is None:
        return DraftChoice(DRAFT_FREE_METHOD, None, note, source="local")
    choice = registry_lookup(repo_id)
    if choice is None:
        choice = _cached_or_searched(
            repo_id, token=token, revision=revision, trust_remote_code=trust_remote_code
        )
    if note:
        choice = dataclasses.replace(choice, reason=f"{choice.reason} ({note})")
    return dataclasses.replace(choice, heads=known_heads(repo_id))


def load_draft(
    choice: DraftChoice, target_model: Any, *, token: str | None = None, trust_remote_code: bool = False
) -> Any | None:
    """Load `choice.draft` with AutoModelForCausalLM in the target's dtype, on the target's device.

    Returns None for a draft-free choice. Hub drafts are fetched from `$HF_ENDPOINT` (read now).
    """
    if choice.draft is None:
        return None
    location = locate_draft(choice, token=token)
    model = AutoModelForCausalLM.from_pretrained(
        location, dtype=target_model.dtype, token=token, trust_remote_code=trust_remote_code
    )
    return model.to(target_model.device).eval()


def locate_draft(choice: DraftChoice, *, token: str | None = None) -> str:
    """A local folder (or, offline, the repo id for the local HF cache) holding `choice.draft`."""
    if choice.draft is None:
        raise ValueError(f"{choice.method!r} is draft-free: there is no draft model to locate.")
    if Path(choice.draft).is_dir() or hub_offline():
        return choice.draft
    return str(download_model(choice.draft, token=token))


# --- target -----------------------------------------------------------------------------------


def _resolve_target(target: Any) -> tuple[str | None, str]:
    """Return (repo id or None, a note on how it was found, or why there is none)."""
    if not isinstance(target, (str, os.PathLike)):
        target = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", "")
    name = str(target)
    if not name:
        return (
            None,
            "the model does not say which Hub model it comes from (no name_or_path), so no draft is known",
        )
    if not Path(name).is_dir():
        if not _REPO_ID.match(name):
            raise ValueError(f"{name!r} is neither a local folder nor a Hub repo id (owner/name).")
        return name, ""
    origin = _folder_origin(Path(name))
    if origin is None:
        return (
            None,
            f"the local folder {name} does not say which Hub model it comes from, so no draft is known",
        )
    return origin, f"from the local folder's config.json, which names {origin}"


def _folder_origin(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.exists():
        return None
    origin = json.loads(config.read_text()).get("_name_or_path", "")
    return origin if _REPO_ID.match(origin) and not Path(origin).exists() else None


# --- registry ---------------------------------------------------------------------------------


def registry_path() -> Path:
    """The registry: `configs/draft_pairs.toml` of the checkout, else the copy shipped in the package."""
    checkout = Path(__file__).resolve().parents[1] / "configs" / _REGISTRY_NAME
    return checkout if checkout.exists() else Path(__file__).resolve().parent / "_configs" / _REGISTRY_NAME


@cache
def _registry_data() -> dict[str, Any]:
    return tomllib.loads(registry_path().read_text())


@cache
def _registry() -> dict[str, dict[str, Any]]:
    """Target repo id (lower case) -> its registry entry."""
    data = _registry_data()
    table: dict[str, dict[str, Any]] = {}
    for entry in data.get("pair", []) + data.get("draft_free", []):
        for target in entry["targets"]:
            table[target.lower()] = entry
    return table


def registry_heads() -> list[dict[str, Any]]:
    """Every `[[head]]` entry of the registry: targets, method, head, layout, source."""
    return list(_registry_data().get("head", []))


def known_heads(repo_id: str, method: str | None = None) -> list[dict[str, str]]:
    """Published draft heads the registry lists for `repo_id` (of `method` only, when given), in
    registry order; each is {"method", "head", "layout", "source"}."""
    found = []
    for entry in _registry_data().get("head", []):
        if repo_id.lower() in (t.lower() for t in entry["targets"]) and method in (None, entry["method"]):
            found.append({key: entry[key] for key in ("method", "head", "layout", "source")})
    return found


def registry_lookup(repo_id: str) -> DraftChoice | None:
    """The registry's answer for `repo_id`, or None when the registry does not list it."""
    entry = _registry().get(repo_id.lower())
    if entry is None:
        return None
    if "draft" not in entry:
        reason = f"{repo_id} gets a draft-free method: {entry['reason']}."
        return DraftChoice(entry["method"], None, reason, target=repo_id, tokenizer_check=None)
    draft = entry["draft"]
    reason = f"{draft} is a known good draft for {repo_id} ({entry['source']})."
    if entry.get("gated"):
        reason += f" {draft} is gated: accept its licence on the Hub and pass a token."
    return DraftChoice(
        "draft_model",
        draft,
        reason,
        target=repo_id,
        size_ratio=_name_ratio(draft, repo_id),
        tokenizer_check="same tokenizer per the reviewed registry",
    )


def _name_ratio(draft: str, target: str) -> float | None:
    d, t = params_from_name(draft), params_from_name(target)
    return round(d / t, 4) if d and t else None


# --- cache ------------------------------------------------------------------------------------


def _cache_file(repo_id: str, revision: str | None, *, token: str | None, trust_remote_code: bool) -> Path:
    # The answer depends on what the caller may see and run, so those are part of the key.
    flags = f"token={bool(token)},remote={trust_remote_code}"
    digest = hashlib.sha256(flags.encode()).hexdigest()[:8]
    name = f"{repo_id.replace('/', '--')}@{revision or 'main'}-{digest}.json"
    return cache_dir() / "selections" / name


def _cached_or_searched(
    repo_id: str, *, token: str | None, revision: str | None, trust_remote_code: bool
) -> DraftChoice:
    path = _cache_file(repo_id, revision, token=token, trust_remote_code=trust_remote_code)
    if path.exists():
        return dataclasses.replace(DraftChoice.from_dict(json.loads(path.read_text())), source="cache")
    if hub_offline():
        reason = (
            f"{repo_id} is not in the registry and HF_HUB_OFFLINE is set, so no draft could be searched "
            "for; speculating from n-grams of the text instead."
        )
        return DraftChoice(DRAFT_FREE_METHOD, None, reason, target=repo_id, source="offline")
    choice = search_draft(repo_id, token=token, revision=revision, trust_remote_code=trust_remote_code)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(choice.to_dict(), indent=2))
    tmp.replace(path)  # atomic: a crash never leaves half a decision behind
    return choice


__all__ = [
    "DraftChoice",
    "DraftSelectionError",
    "known_heads",
    "load_draft",
    "locate_draft",
    "registry_lookup",
    "registry_path",
    "select_draft",
]
