"""Choose how to speculate for a target model: a draft model that shares its tokenizer, one of
another tokenizer where none does (drafting over the tokens both share), or none.

`select_draft(target)` answers from, in order:

0. the target's own draft heads: multi-token-prediction layers in its checkpoint (`method="mtp"`),
   when the checkpoint is here (a loaded model's folder, a local folder, or the Hub cache) and they
   load as `method="mtp"` loads them (declared layers that do not are passed over with a warning), then
   the official assistant the reviewed registry lists for it (`method="assistant"`);
1. the reviewed registry `configs/draft_pairs.toml` (works offline);
2. an earlier decision cached under `cache_dir() / "selections"` (works offline);
3. a search of the Hub (see `hf_specdec.selection.search`; the registry's `[[cross_tokenizer_draft]]`
   entries are the drafts of other families it may propose), whose decision is then cached.

With `HF_HUB_OFFLINE=1` only the first two are used. When nothing fits, the answer is a
draft-free method (`"ngram"`) with the reason. Published draft heads (EAGLE, Medusa) the registry
knows for the target are listed besides, in `DraftChoice.heads` (see `known_heads`).

A cached decision is a file anyone could have written: one that does not hold a choice this version
wrote for this target (a draft named by Hub repo id, the commit it was checked at and its
tokenizer's fingerprint) is deleted, with a warning, and the choice made again. `load_draft(choice,
target_model)` loads a draft from the commit the search checked (`DraftChoice.revision`), after
checking its files again (no remote code unless `trust_remote_code=True`, safetensors weights,
`config_check`) and that its tokenizer is the one compared with the target's.
`speculative_draft(target)` is what `speculative=True` uses: the choice with its draft loaded, or,
for a draft that cannot be loaded so, `"ngram"` with a one-line warning, the cached choice deleted
when it will not load later either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from ..core.checks import check_causal_folder
from ..core.timing import clock
from ..drafters import draft_model, mtp
from ..hub.config_check import checkpoint_problem, read_json, weights_problem
from ..hub.download import (
    HubFileError,
    HubUnreachable,
    download_model,
    hub_endpoint,
    hub_offline,
    hub_timeout,
    is_commit,
    local_snapshot,
)
from ..hub.tokenizer_check import tokenizer_fingerprint
from ..store.manifest import write_atomically
from ..store.paths import cache_dir
from .choice import (
    DRAFT_FREE_AUTO,
    DRAFT_FREE_AUTO_WORDS,
    DRAFT_FREE_METHOD,
    DraftChoice,
    DraftSelectionError,
    DraftUnavailableError,
    params_from_name,
)
from .search import search_draft

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

_REGISTRY_NAME = "draft_pairs.toml"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_CACHE_FILE_BYTES = 1 << 20  # a choice is a few kB
# A search the Hub could not answer is not asked again in the process for this long: behind a Hub
# that does not answer, each speculative=True call would wait for its timeout before drafting.
SEARCH_RETRY_SECONDS = 60.0
_FAILED_SEARCHES: dict[tuple[str, Path], tuple[float, str]] = {}  # (endpoint, choice file) -> (when, why)


def select_draft(
    target: Any,
    *,
    token: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    own_heads: bool = True,
) -> DraftChoice:
    """Choose a draft model (or a draft-free method) for `target`.

    Args:
        target: a Hub repo id, a local model folder, or a loaded `PreTrainedModel`.
        token: a Hugging Face token, needed when the target or a candidate is gated or private.
        revision: the target's revision (branch, tag or commit) on the Hub.
        trust_remote_code: allow drafts whose config needs custom code (`auto_map`); off by default.
        own_heads: consider the target's own draft heads (MTP layers in its checkpoint) first. They
            are chosen where they load as `method="mtp"` loads them (`mtp.own_layers`); layers its
            config declares that do not load are passed over with a warning saying why (once per
            loaded model and checkpoint: later calls pass them over without reading them again).

    Raises:
        DraftSelectionError: the target is gated, private or missing on the Hub.
        ValueError: the target is a local folder of no causal LM (`check_causal_lm`).
    """
    repo_id, note = _resolve_target(target)
    if isinstance(target, (str, os.PathLike)):
        check_causal_folder(target, image_text=True)  # a folder of a model generate could not run
    name = repo_id or getattr(target, "name_or_path", None) or str(target)
    try:
        own = mtp.own_layers(target) if own_heads else None
    except ValueError as err:  # declared and here, but they do not load: the next choice, saying why
        if not isinstance(err, mtp.RememberedFailure):  # said once, where the failure was found
            warnings.warn(f"{name}: {err} Choosing another draft.", UserWarning, stacklevel=2)
        own, note = None, "; ".join(filter(None, [note, f"its own MTP layers are not used: {err}"]))
    if own is not None:
        return DraftChoice("mtp", None, f"{name}: {own}.", target=repo_id, source="checkpoint")
    if repo_id is None:
        return DraftChoice(DRAFT_FREE_METHOD, None, note, source="local")
    choice = assistant_lookup(repo_id) or registry_lookup(repo_id)
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
    """Load `choice.draft` in the target's dtype, on the target's device, from the commit the search
    checked (`choice.revision`), after `locate_draft`'s checks; its tokenizer must be the one the
    search compared with the target's (`choice.tokenizer_fingerprint`).

    Returns None for a draft-free choice. Hub drafts are fetched from `$HF_ENDPOINT` (read now).

    Raises:
        DraftUnavailableError: the draft cannot be loaded safely or is not what was checked.
    """
    if choice.draft is None:
        return None
    return _load_checked(choice, target_model, token=token, trust_remote_code=trust_remote_code)[0]


def locate_draft(choice: DraftChoice, *, token: str | None = None, trust_remote_code: bool = False) -> Path:
    """The Hub cache's folder holding `choice.draft` at `choice.revision` (a registry draft: the commit
    `main` is at now), downloading what it lacks, checked by `config_check.checkpoint_problem`.

    Raises:
        DraftUnavailableError: the repo, commit or files are gone, unreachable, or fail the checks.
    """
    if choice.draft is None:
        raise ValueError(f"{choice.method!r} is draft-free: there is no draft model to locate.")
    at = _draft_at(choice)
    folder = local_snapshot(choice.draft, choice.revision) if is_commit(choice.revision) else None
    if folder is None or weights_problem(folder):
        try:
            folder = download_model(choice.draft, token=token, revision=choice.revision)
        except HubFileError as err:
            raise DraftUnavailableError(str(err), lasting=err.lasting) from err
        if hub_offline() and weights_problem(folder):
            raise DraftUnavailableError(
                f"The draft {at} is not in the local Hub cache (only some of its files are) and "
                "HF_HUB_OFFLINE is set: unset it to download the rest.",
                lasting=False,
            )
    problem = checkpoint_problem(folder, trust_remote_code=trust_remote_code, from_hub=True)
    if problem:
        raise DraftUnavailableError(f"The draft {at} cannot be used: {problem}.")
    return folder


def speculative_draft(
    target: Any, choice: DraftChoice | None = None, *, trust_remote_code: bool = False
) -> tuple[DraftChoice, Any, Any]:
    """What `speculative=True` drafts with: (`select_draft`'s `choice`, made here where None, its
    draft model, its tokenizer),
    the draft loaded by `load_draft`. A draft that cannot be loaded so gives (a draft-free choice,
    None, None) and a one-line warning; the cached choice is deleted unless the failure may pass
    (offline, the Hub unreachable). A choice of the target's own MTP layers was made by loading
    them (`select_draft`), so it stands."""
    choice = choice or select_draft(target, trust_remote_code=trust_remote_code)
    if choice.draft is None:
        return choice, None, None
    try:
        model, tokenizer = _load_checked(choice, target, token=None, trust_remote_code=trust_remote_code)
    except DraftUnavailableError as err:
        path = _cache_file(choice.target or "", None, token=None, trust_remote_code=trust_remote_code)
        dropped = err.lasting and choice.source in ("cache", "hub") and path.exists()
        if dropped:
            with contextlib.suppress(OSError):
                path.unlink()
        deleted = f"the cached choice {path.name} was deleted; " if dropped else ""
        warnings.warn(
            f"speculative=True: {err} Speculating with {DRAFT_FREE_AUTO!r} instead ({deleted}cached "
            f"choices live in {path.parent}: delete that folder to clear them all).",
            UserWarning,
            stacklevel=2,
        )
        reason = f"{choice.draft} was chosen but cannot be used: {err}"
        return (
            DraftChoice(DRAFT_FREE_METHOD, None, reason, target=choice.target, source=choice.source),
            None,
            None,
        )
    return choice, model, tokenizer


def _load_checked(
    choice: DraftChoice, target_model: Any, *, token: str | None, trust_remote_code: bool
) -> tuple[Any, Any]:
    folder = locate_draft(choice, token=token, trust_remote_code=trust_remote_code)
    at = _draft_at(choice)
    try:
        model, tokenizer = draft_model.load_draft(
            str(folder), target_model, trust_remote_code=trust_remote_code
        )
    except (
        Exception
    ) as err:  # transformers and safetensors raise many kinds for a checkpoint that does not load
        raise DraftUnavailableError(f"The draft {at} does not load ({type(err).__name__}: {err}).") from err
    expected = choice.tokenizer_fingerprint
    if expected is not None and (tokenizer is None or tokenizer_fingerprint(tokenizer) != expected):
        raise DraftUnavailableError(
            f"The draft {at} cannot be used: its tokenizer is not the one that was compared with the "
            "target's (the files served for that commit changed)."
        )
    return model, tokenizer


def _draft_at(choice: DraftChoice) -> str:
    """The draft as messages name it: its repo id, and the commit it is pinned to if any."""
    return f"{choice.draft} (commit {choice.revision})" if choice.revision else str(choice.draft)


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
    config = Path(name) / "config.json"
    data, unreadable = read_json(config, limit=None) if config.exists() else (None, None)
    if unreadable:  # a folder the user may have rewritten since the model was loaded from it
        return None, f"the local folder {name}'s {unreadable}, so no draft is known"
    origin = _folder_origin(data)
    if origin is None:
        return (
            None,
            f"the local folder {name} does not say which Hub model it comes from, so no draft is known",
        )
    return origin, f"from the local folder's config.json, which names {origin}"


def _folder_origin(data: Any) -> str | None:
    """The Hub repo a folder's parsed config.json names as its origin, if any."""
    origin = data.get("_name_or_path", "") if isinstance(data, dict) else ""
    return (
        origin if isinstance(origin, str) and _REPO_ID.match(origin) and not Path(origin).exists() else None
    )


# --- registry ---------------------------------------------------------------------------------


def registry_path() -> Path:
    """The registry: `configs/draft_pairs.toml` of the checkout, else the copy shipped in the package."""
    checkout = Path(__file__).resolve().parents[2] / "configs" / _REGISTRY_NAME
    return (
        checkout if checkout.exists() else Path(__file__).resolve().parents[1] / "_configs" / _REGISTRY_NAME
    )


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


def registry_head(name: str) -> dict[str, Any] | None:
    """The registry's entry for the published head `name` (a Hub repo id); None for a local path."""
    if Path(name).exists():
        return None
    return next((entry for entry in registry_heads() if entry["head"].lower() == name.lower()), None)


def registry_cross_tokenizer_drafts() -> tuple[str, ...]:
    """The small general drafts of the registry's `[[cross_tokenizer_draft]]` entries, in order: what
    the Hub search may propose, across tokenizers, for a target no draft shares a tokenizer with."""
    return tuple(
        draft for entry in _registry_data().get("cross_tokenizer_draft", []) for draft in entry["drafts"]
    )


def known_heads(repo_id: str, method: str | None = None) -> list[dict[str, str]]:
    """Published draft heads the registry lists for `repo_id` (of `method` only, when given), in
    registry order; each is {"method", "head", "layout", "source"}."""
    found = []
    for entry in _registry_data().get("head", []):
        if repo_id.lower() in (t.lower() for t in entry["targets"]) and method in (None, entry["method"]):
            found.append({key: entry[key] for key in ("method", "head", "layout", "source")})
    return found


def assistant_lookup(repo_id: str) -> DraftChoice | None:
    """The official assistant the registry lists for `repo_id` (`[[assistant]]`), or None."""
    for entry in _registry_data().get("assistant", []):
        if repo_id.lower() in (t.lower() for t in entry["targets"]):
            assistant = entry["assistant"]
            reason = (
                f"{assistant} is {repo_id}'s official assistant ({entry['source']}): it drafts from the "
                "target's own hidden state and KV cache."
            )
            check = "the target's own assistant per the reviewed registry"
            return DraftChoice("assistant", assistant, reason, target=repo_id, tokenizer_check=check)
    return None


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
    revision = re.sub(r"[^\w.-]", "_", revision or "main")  # a file name, whatever the branch is called
    name = f"{repo_id.replace('/', '--')}@{revision}-{digest}.json"
    return cache_dir() / "selections" / name


def clear_failed_searches() -> None:
    """Forget the searches the Hub could not answer: the next call asks it again at once."""
    _FAILED_SEARCHES.clear()


def _cached_or_searched(
    repo_id: str, *, token: str | None, revision: str | None, trust_remote_code: bool
) -> DraftChoice:
    path = _cache_file(repo_id, revision, token=token, trust_remote_code=trust_remote_code)
    cached = _read_cached(path, repo_id)
    if cached is not None:
        return cached
    if hub_offline():
        reason = (
            f"{repo_id} is not in the registry and HF_HUB_OFFLINE is set, so no draft could be searched "
            f"for; speculating draft-free with {DRAFT_FREE_AUTO_WORDS} instead."
        )
        return DraftChoice(DRAFT_FREE_METHOD, None, reason, target=repo_id, source="offline")
    key = (hub_endpoint(), path)
    failed = _FAILED_SEARCHES.get(key)
    if failed is not None and (waited := clock("cpu") - failed[0]) < SEARCH_RETRY_SECONDS:
        again = f"{failed[1]} (as {waited:.0f} s ago; asked again {SEARCH_RETRY_SECONDS:g} s after)"
        return DraftChoice(DRAFT_FREE_METHOD, None, again, target=repo_id, source="offline")
    try:
        choice = search_draft(
            repo_id,
            token=token,
            revision=revision,
            trust_remote_code=trust_remote_code,
            cross_tokenizer_drafts=registry_cross_tokenizer_drafts(),
        )
    except (HubUnreachable, HfHubHTTPError, LocalEntryNotFoundError, json.JSONDecodeError) as err:
        # As offline, and not cached on disk: asked again once SEARCH_RETRY_SECONDS have passed. What
        # reaches here is the Hub unreachable, failing for now (`download.failed_for_now`; a file it
        # could not give, retries spent), or answering with what is not JSON (a proxy's page); its
        # definite answers (missing, gated) are DraftSelectionErrors.
        why = f"{type(err).__name__}: {str(err).splitlines()[0]}"  # its first line: one sentence
        reason = (
            f"{repo_id} is not in the registry and the Hub ({hub_endpoint()}) could not be searched "
            f"({why}); speculating draft-free with {DRAFT_FREE_AUTO_WORDS} instead."
        )
        _FAILED_SEARCHES[key] = (clock("cpu"), reason)
        warnings.warn(  # the statistics alone would not tell it, nor what asking costs
            f"{reason} This process asks the Hub again {SEARCH_RETRY_SECONDS:g} s from now, waiting "
            f"for it (up to HF_HUB_ETAG_TIMEOUT={hub_timeout():g} s a request): set HF_HUB_OFFLINE=1 "
            f"not to ask, or pass speculative={DRAFT_FREE_AUTO!r}.",
            UserWarning,
            stacklevel=2,
        )
        return DraftChoice(DRAFT_FREE_METHOD, None, reason, target=repo_id, source="offline")
    _FAILED_SEARCHES.pop(key, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(choice.to_dict(), indent=2)
    write_atomically(path, lambda tmp: tmp.write_text(text))  # a crash never leaves half a decision behind
    return choice


def _read_cached(path: Path, repo_id: str) -> DraftChoice | None:
    """The choice cached at `path`, or None: none there, or one not to trust (deleted, with a warning)."""
    if not path.exists():
        return None
    try:
        if path.stat().st_size > _MAX_CACHE_FILE_BYTES:
            raise ValueError(f"it is larger than {_MAX_CACHE_FILE_BYTES >> 20} MiB")
        choice = DraftChoice.from_dict(json.loads(path.read_text()))
        _check_cached(choice, repo_id)
    except (OSError, ValueError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        with contextlib.suppress(OSError):
            path.unlink()
        warnings.warn(
            f"Ignoring the cached draft choice {path}: {err}. It was deleted and the choice is made again "
            f"(cached choices live in {path.parent}; delete it to clear them all).",
            UserWarning,
            stacklevel=4,
        )
        return None
    return dataclasses.replace(choice, source="cache")


def _check_cached(choice: DraftChoice, repo_id: str) -> None:
    """Raise ValueError unless `choice` is one the Hub search could have made for `repo_id`."""
    if choice.target != repo_id:
        raise ValueError(f"it is a choice for {choice.target!r}, not {repo_id}")
    if choice.draft is None:
        if choice.method != DRAFT_FREE_METHOD:
            raise ValueError(f"its draft-free method {choice.method!r} is not {DRAFT_FREE_METHOD!r}")
        return
    if choice.method != "draft_model":
        raise ValueError(f"a draft is named but the method is {choice.method!r}")
    try:
        validate_repo_id(choice.draft)
    except HFValidationError:
        raise ValueError(f"its draft {choice.draft!r} is not a Hub repo id") from None
    if "/" not in choice.draft:
        raise ValueError(f"its draft {choice.draft!r} is not a Hub repo id (owner/name)")
    if not is_commit(choice.revision):
        raise ValueError("it does not name the commit its draft was checked at (an older version wrote it?)")
    # The search records the fingerprint of every draft tokenizer it compared; without one nothing
    # checks the draft's tokenizer when it loads, and it runs as one that shares the target's.
    if choice.tokenizer_fingerprint is None:
        raise ValueError("it does not name the tokenizer its draft was compared with")


__all__ = [
    "DraftChoice",
    "DraftSelectionError",
    "known_heads",
    "load_draft",
    "locate_draft",
    "assistant_lookup",
    "clear_failed_searches",
    "registry_lookup",
    "registry_path",
    "select_draft",
    "speculative_draft",
]
