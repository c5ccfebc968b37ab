"""Search the Hub for a draft model that fits a target not listed in the registry.

Candidates come from the same author and family as the target (or as its `base_model`, for a
fine-tune), with sizes from the Hub's safetensors metadata and architectures from `config.json`.
They are ranked by expected speedup: same instruct/base variant first, then the smallest whose
size is between 1/100 and 1/4 of the target's. The first whose downloaded tokenizer maps every
token to the same id as the target's (`compare_tokenizers`) wins, and is pinned to the commit
whose files were checked (`DraftChoice.revision`).

Only where none shares the target's tokenizer, a draft of another tokenizer may be proposed: from
the family's candidates whose tokenizer differs, then from the small general drafts the caller
names (the registry's `[[cross_tokenizer_draft]]`), ranked and checked alike, the first whose
vocabulary shares enough with the target's for token-level intersection (`choose_translation`'s
rule, so that it samples exactly too) wins, and the choice says so (`DraftChoice.translation`).

No code from a repo is run unless the caller passes `trust_remote_code=True`: a candidate whose
config.json or tokenizer_config.json needs it (`auto_map`) is skipped, by the config the Hub's API
reports and again by the config.json downloaded from the commit checked (the API's summary can
leave keys out); so is one without safetensors weights (`config_check`). Tokenizers load with
`trust_remote_code` passed explicitly.

The endpoint (`HF_ENDPOINT`) and cache (`HF_HUB_CACHE`) are read when called, not at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelInfo, get_session, get_token
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status
from transformers import AutoTokenizer

from ..drafters.vocabulary import MIN_SHARED_COVERAGE
from ..hub.config_check import NO_PICKLES, draft_config_problem, hub_config_problem, tokenizer_problem
from ..hub.download import (
    SAFETENSORS_INDEX,
    SAFETENSORS_WEIGHTS,
    TOKENIZER_FILES,
    download_files,
    failed_for_now,
    hub_endpoint,
    hub_timeout,
    is_commit,
)
from ..hub.tokenizer_check import (
    VocabularyOverlap,
    compare_tokenizers,
    tokenizer_fingerprint,
    vocabulary_overlap,
)
from .choice import DRAFT_FREE_METHOD, DraftChoice, DraftSelectionError, params_from_name

MIN_RATIO = 1 / 100  # a smaller draft agrees too rarely with the target to pay
MAX_RATIO = 1 / 4  # a larger draft costs too much per drafted token
_EXPAND = ["sha", "safetensors", "config", "cardData", "gated", "siblings", "tags"]
_LISTED = 500  # the family's models asked of the Hub's search, quantized exports among them
_GATED_CANDIDATE = "gated: pass a token that has accepted its licence to consider it"
_QUANTIZED = re.compile(r"(gguf|awq|gptq|int4|int8|fp8|mlx|onnx|bnb|exl2)", re.IGNORECASE)
_INSTRUCT = re.compile(r"(instruct|chat|(^|-)it($|-))", re.IGNORECASE)
_SIZE_SPLIT = re.compile(r"-(?:\d+x)?\d+(?:\.\d+)?[MmBb](?=$|-)")


@dataclass
class _Candidate:
    repo_id: str
    params: float
    instruct: bool
    info: Any  # huggingface_hub.ModelInfo
    tokenizer_note: str | None = None
    tokenizer_fingerprint: str | None = None
    tokenizer: Any = None  # its tokenizer, where it was compared with the target's
    of_family: bool = True  # of the target's family, not one of the caller's other drafts


def search_draft(
    repo_id: str,
    *,
    token: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    cross_tokenizer_drafts: tuple[str, ...] = (),
) -> DraftChoice:
    """Search the Hub for the best draft for `repo_id`; a draft-free choice when none fits.
    `cross_tokenizer_drafts`: repos of other families to consider, with the family's candidates of
    another tokenizer, where no draft shares the target's tokenizer."""
    api = HfApi(endpoint=hub_endpoint(), token=token)
    info = _target_info(api, repo_id, revision)
    target_params = _params(info)
    if target_params is None:
        return _draft_free(repo_id, "its size is unknown (no safetensors metadata and no size in its name)")
    family_repo = _base_model(info) or repo_id
    target_tok, why_not = _target_tokenizer(repo_id, info, token, trust_remote_code)
    if target_tok is None:
        return _draft_free(repo_id, why_not)
    rejected: list[str] = []
    instruct = _is_instruct(repo_id)
    candidates = _rank(_candidates(api, repo_id, family_repo, token), target_params, instruct, rejected)
    others = _rank(_infos(api, cross_tokenizer_drafts, token, rejected), target_params, instruct, rejected)
    for cand in others:
        cand.of_family = False
    other_tokenizer: list[_Candidate] = []  # checked, but of another tokenizer
    for cand in candidates + others:
        verdict = _check_candidate(cand, target_tok, token=token, trust_remote_code=trust_remote_code)
        if verdict is None:
            return _chosen(repo_id, cand, target_params, family_repo, rejected)
        rejected.append(f"{cand.repo_id}: {verdict}")
        if cand.tokenizer is not None:
            other_tokenizer.append(cand)
    for cand in other_tokenizer:
        overlap = vocabulary_overlap(target_tok, cand.tokenizer)
        if min(overlap.target_coverage, overlap.draft_coverage) >= MIN_SHARED_COVERAGE:
            return _chosen(repo_id, cand, target_params, family_repo, rejected, across=overlap)
        rejected.append(
            f"{cand.repo_id}: {_coverage(overlap)}, under the {MIN_SHARED_COVERAGE:.0%} each "
            "that drafting across tokenizers (token-level intersection) needs"
        )
    why = f"no model of the {family_repo} family on the Hub is 1/100 to 1/4 of its size and has its tokenizer"
    if cross_tokenizer_drafts or other_tokenizer:
        why += ", and no draft of another tokenizer shares enough of its tokens"
    return _draft_free(repo_id, why, rejected)


def _chosen(
    repo_id: str,
    cand: _Candidate,
    target_params: float,
    family_repo: str,
    rejected: list[str],
    across: VocabularyOverlap | None = None,
) -> DraftChoice:
    """The choice of `cand`: a draft of the target's tokenizer, or, with `across` (what the two
    vocabularies share), one of another tokenizer that drafts over the shared tokens."""
    ratio = round(cand.params / target_params, 4)
    size = f"at 1/{1 / ratio:.0f} of its size"
    which = f"the smallest model of the {family_repo} family" if cand.of_family else "a small general draft"
    reason = f"{cand.repo_id} is {which} on the Hub that shares the target's tokenizer, {size}."
    tokenizer_check = cand.tokenizer_note
    if across is not None:
        reason = (
            f"No model of the {family_repo} family on the Hub is 1/100 to 1/4 of its size and shares its "
            f"tokenizer; {cand.repo_id}, {size}, has another tokenizer and drafts over the {across.shared} "
            f"tokens both vocabularies spell alike (token-level intersection: {_coverage(across)})."
        )
        tokenizer_check = f"{tokenizer_check}; {_coverage(across)}"
    return DraftChoice(
        method="draft_model",
        draft=cand.repo_id,
        reason=reason,
        target=repo_id,
        source="hub",
        size_ratio=ratio,
        tokenizer_check=tokenizer_check,
        rejected=rejected,
        revision=cand.info.sha,
        tokenizer_fingerprint=cand.tokenizer_fingerprint,
        translation=None if across is None else "intersection",
    )


def _coverage(overlap: VocabularyOverlap) -> str:
    return (
        f"{overlap.target_coverage:.0%} of the target's tokens and {overlap.draft_coverage:.0%} of the "
        "draft's on a probe text are shared"
    )


# --- target -----------------------------------------------------------------------------------


def _target_info(api: Any, repo_id: str, revision: str | None) -> Any:
    try:
        return api.model_info(repo_id, revision=revision, expand=_EXPAND, timeout=hub_timeout())
    except GatedRepoError as err:
        raise DraftSelectionError(_gated_message(repo_id)) from err
    except RevisionNotFoundError as err:
        raise DraftSelectionError(f"{repo_id} has no revision {revision!r} on the Hub.") from err
    except RepositoryNotFoundError as err:
        raise DraftSelectionError(
            f"{repo_id} was not found on the Hub ({hub_endpoint()}). If it is private, give a token "
            "with read access (HF_TOKEN, or select_draft(token=...) / --token)."
        ) from err


def _target_tokenizer(
    repo_id: str, info: Any, token: str | None, trust_remote_code: bool
) -> tuple[Any, str | None]:
    """(the target's tokenizer, None), or (None, why it is not loaded: it needs the repo's code)."""
    try:
        folder = _download_tokenizer(repo_id, info, token=token)
        problem = tokenizer_problem(folder, trust_remote_code=trust_remote_code)
        if problem:
            return None, f"its tokenizer {problem}"
        return _load_tokenizer(folder, trust_remote_code), None
    except GatedRepoError as err:
        raise DraftSelectionError(_gated_message(repo_id)) from err
    except (OSError, ValueError) as err:  # an HfHubHTTPError is an OSError
        if failed_for_now(err):
            raise
        raise DraftSelectionError(f"Could not get the tokenizer of {repo_id} from the Hub: {err}") from err


def _gated_message(repo_id: str) -> str:
    return (
        f"{repo_id} is gated on the Hub: accept its licence on its model page, then pass a token "
        "that has access (token=... or --token, or `hf auth login`)."
    )


def _base_model(info: Any) -> str | None:
    """The `base_model` a fine-tune names in its card, if any (the first when it lists several)."""
    base = getattr(info.card_data, "base_model", None) if info.card_data else None
    if isinstance(base, list):
        base = base[0] if base else None
    return base if isinstance(base, str) and base != info.id else None


def _params(info: Any) -> float | None:
    if info.safetensors is not None and info.safetensors.total:
        return float(info.safetensors.total)
    return params_from_name(info.id)


def _is_instruct(repo_id: str) -> bool:
    return bool(_INSTRUCT.search(repo_id.split("/")[-1]))


# --- candidates -------------------------------------------------------------------------------


def _family(repo_id: str) -> str:
    """`Qwen/Qwen2.5-7B-Instruct` -> `Qwen2.5`: the name up to its size."""
    name = repo_id.split("/")[-1]
    match = _SIZE_SPLIT.search(name)
    return name[: match.start()] if match else name.split("-")[0]


def _candidates(api: Any, repo_id: str, family_repo: str, token: str | None) -> list[Any]:
    author, family = family_repo.split("/")[0], _family(family_repo)
    models = _list_models(api, {"author": author, "search": family}, token)
    return [m for m in models if m.id != repo_id and _family(m.id).lower() == family.lower()]


def _list_models(api: HfApi, query: dict[str, str], token: str | None) -> list[ModelInfo]:
    """What `api.list_models(**query, expand=_EXPAND, limit=_LISTED)` yields, each page asked once
    with `hub_timeout()`, as the target's `model_info` is. `list_models` takes no timeout, so a Hub
    that answered the target's info but never the search hung `speculative=True`; the `paginate` it
    uses takes one but retries a page that timed out five times, 23 s of waits between. Raises as
    `model_info` does (a timeout: `HubUnreachable`)."""
    url: str | None = f"{api.endpoint}/api/models"
    params: dict[str, Any] | None = {**query, "expand": _EXPAND, "limit": _LISTED}
    headers = build_hf_headers(token=token)
    found: list[ModelInfo] = []
    while url and len(found) < _LISTED:
        response = get_session().get(url, params=params, headers=headers, timeout=hub_timeout())
        hf_raise_for_status(response)
        found += [ModelInfo(**{"siblings": None, **item}) for item in response.json()]
        url, params = response.links.get("next", {}).get("url"), None  # the next page's link holds the query
    return found[:_LISTED]


def _infos(api: Any, repo_ids: tuple[str, ...], token: str | None, rejected: list[str]) -> list[Any]:
    """The Hub's info on each of `repo_ids` that it has (the others are noted in `rejected`)."""
    infos = []
    for draft in repo_ids:
        try:
            infos.append(api.model_info(draft, expand=_EXPAND, token=token, timeout=hub_timeout()))
        except HfHubHTTPError as err:
            if failed_for_now(err):
                raise
            rejected.append(f"{draft}: not available on the Hub ({type(err).__name__})")
    return infos


def _rank(infos: list[Any], target_params: float, instruct: bool, rejected: list[str]) -> list[_Candidate]:
    """Keep candidates of a useful size, best expected speedup first."""
    kept = []
    for info in infos:
        params = _params(info)
        if _QUANTIZED.search(info.id):
            continue  # quantized exports of a sibling: not a transformers draft
        if params is None:
            rejected.append(f"{info.id}: size unknown")
        elif not MIN_RATIO <= params / target_params <= MAX_RATIO:
            rejected.append(
                f"{info.id}: 1/{target_params / params:.1f} of the target's size, outside 1/100..1/4"
            )
        else:
            kept.append(_Candidate(info.id, params, _is_instruct(info.id), info))
    return sorted(kept, key=lambda c: (c.instruct != instruct, c.params))


def _check_candidate(
    cand: _Candidate, target_tok: Any, *, token: str | None, trust_remote_code: bool
) -> str | None:
    """None when `cand` can draft for the target; otherwise why not. Sets `cand.tokenizer_note` and
    `cand.tokenizer_fingerprint`.

    What the API reports is checked first (no download); then the config.json and tokenizer files
    of the commit the API named, which are what the draft is loaded from."""
    problem = draft_config_problem(cand.info.config or {}, trust_remote_code=trust_remote_code)
    if problem:
        return problem
    if not _has_safetensors(cand.info):
        return NO_PICKLES
    if not is_commit(cand.info.sha):
        return "the Hub did not say which commit its files are (no sha), so they could not be pinned"
    if cand.info.gated and not (token or get_token()):
        return _GATED_CANDIDATE  # its files may be cached, but its weights could not be downloaded
    try:
        folder = _download_tokenizer(cand.repo_id, cand.info, token=token)
        problem = hub_config_problem(folder, trust_remote_code=trust_remote_code)
        if problem:
            return problem
        draft_tok = _load_tokenizer(folder, trust_remote_code)
    except GatedRepoError:
        return _GATED_CANDIDATE
    except RepositoryNotFoundError:
        return "no longer available on the Hub"
    except (OSError, ValueError) as err:  # an HfHubHTTPError is an OSError
        if failed_for_now(err):
            raise
        return f"tokenizer could not be fetched or loaded ({type(err).__name__})"
    check = compare_tokenizers(target_tok, draft_tok)
    cand.tokenizer_note = check.explain()
    cand.tokenizer_fingerprint = tokenizer_fingerprint(draft_tok)
    cand.tokenizer = draft_tok
    return None if check.compatible else check.explain()


def _has_safetensors(info: Any) -> bool:
    names = [s.rfilename for s in info.siblings or []]
    return SAFETENSORS_INDEX in names or any(SAFETENSORS_WEIGHTS.match(name) for name in names)


def _draft_free(repo_id: str, why: str, rejected: list[str] | None = None) -> DraftChoice:
    reason = f"{repo_id} gets a draft-free method: {why}."
    return DraftChoice(DRAFT_FREE_METHOD, None, reason, repo_id, "hub", rejected=rejected or [])


# --- files ------------------------------------------------------------------------------------


def _download_tokenizer(repo_id: str, info: Any, *, token: str | None) -> Path:
    """The tokenizer files and config.json of the commit `info` describes (its `sha`)."""
    names = [s.rfilename for s in info.siblings or [] if s.rfilename in TOKENIZER_FILES]
    return download_files(
        repo_id, names or ["tokenizer.json", "tokenizer_config.json"], token=token, revision=info.sha
    )


def _load_tokenizer(folder: Path, trust_remote_code: bool) -> Any:
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
