"""The Hub, as this package uses it: endpoint and offline mode read when called (huggingface_hub
reads them once, at import), and a repo's files downloaded into the Hub cache from one commit.

Every download of ours goes through `download_repo_files`, which lists the commit's files and skips
any name that could land outside its snapshot folder (`is_safe_filename`) before fetching anything.
A leaf: it imports nothing of ours, so draft selection, the Hub search and head loading can all use it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..store.manifest import SAFETENSORS_INDEX

try:  # the HTTP client's error for a Hub that cannot be reached: httpx2 in huggingface_hub 2.x, httpx in 1.x
    from httpx2 import TransportError as HubUnreachable
except ImportError:  # pragma: no cover - huggingface_hub 1.x
    from httpx import TransportError as HubUnreachable

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "config.json",
)
# The files of a model we load: config, generation config and safetensors weights (one file, or
# shards and their index). Never pickles (`pytorch_model.bin`, `*.pt`): unpickling can run code.
SAFETENSORS_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
SINGLE_WEIGHTS = "model.safetensors"
_MODEL_FILES = {"config.json", "generation_config.json", SAFETENSORS_INDEX}
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ShardIndexError(ValueError):
    """A shard index that names no weights, or names files other than safetensors shards beside it;
    the message is a phrase (`model.safetensors.index.json names no weights`)."""


def weights_files(names: Collection[str], index: Callable[[], Any]) -> list[str]:
    """The safetensors files loading reads of a checkpoint whose folder (or commit) holds the files
    `names`: `model.safetensors` where there is one, as transformers reads it first (a sharded copy
    beside it is not read); else the shards its index names, `index()` giving the parsed
    `model.safetensors.index.json` (asked for only then); none where it has neither.

    Raises:
        ShardIndexError: the index names no weights, or files other than safetensors shards.
    """
    if SINGLE_WEIGHTS in names:
        return [SINGLE_WEIGHTS]
    if SAFETENSORS_INDEX not in names:
        return []
    raw = index()
    shards = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(shards, dict) or not shards:
        raise ShardIndexError(f"{SAFETENSORS_INDEX} names no weights")
    files = set(shards.values())
    if not all(isinstance(n, str) and is_safe_filename(n) and SAFETENSORS_WEIGHTS.match(n) for n in files):
        raise ShardIndexError(f"{SAFETENSORS_INDEX} names files that are not safetensors shards")
    return sorted(files)


class HubFileError(ValueError):
    """A repo's files could not be had; the message says what to do.

    `lasting` tells a missing repo, revision or file (asking again fails the same way) from a Hub
    that could not be reached or an offline cache without the files (it may work later)."""

    def __init__(self, message: str, *, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting


def failed_for_now(err: BaseException) -> bool:
    """Whether the Hub failed for now rather than answered: unreachable or silent (no response in
    time), a server error, a rate limit, or a file it could not give once huggingface_hub's retries
    were spent. Not an answer to keep: asking again may get one."""
    if isinstance(err, (HubUnreachable, LocalEntryNotFoundError)):
        return True
    if not isinstance(err, HfHubHTTPError):
        return False
    status = None if err.response is None else err.response.status_code
    return status is None or status >= 500 or status == 429


def hub_endpoint() -> str:
    """`$HF_ENDPOINT` read now, else the endpoint huggingface_hub read at import."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_timeout() -> float:
    """Seconds to wait for the Hub's answer to a metadata request: `$HF_HUB_ETAG_TIMEOUT` read now
    (empty: unset), else huggingface_hub's (10). Its API calls (`model_info`) wait for ever unless
    given one, so a Hub that takes a connection and never answers (a stuck proxy) would hang
    `speculative=True`.

    Raises:
        ValueError: it is not a positive number of seconds. huggingface_hub refuses one that is no
            whole number, when imported; a fraction is taken here.
    """
    value = os.environ.get("HF_HUB_ETAG_TIMEOUT") or str(constants.HF_HUB_ETAG_TIMEOUT)
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(
            f"HF_HUB_ETAG_TIMEOUT={value!r} is not a positive number of seconds: set it to one, or unset it"
        )
    return seconds


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE`, read now (huggingface_hub reads it once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or value.upper() in {"1", "ON", "YES", "TRUE"}


def is_commit(revision: str | None) -> bool:
    """Whether `revision` names one commit (a full sha), not a branch or tag that can move."""
    return bool(revision and _COMMIT.match(revision))


def is_safe_filename(name: str) -> bool:
    """Whether a file name from a repo listing stays inside the snapshot folder on every system:
    relative, `/`-separated, without `..`, `.` or empty segments, backslashes, drive letters or
    colons, control characters."""
    if not name or name.startswith("/") or "\\" in name or ":" in name:
        return False
    if any(ord(char) < 32 for char in name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def is_model_file(name: str) -> bool:
    """A file `download_model` fetches: config, generation config, safetensors weights, tokenizer."""
    return name in _MODEL_FILES or name in TOKENIZER_FILES or bool(SAFETENSORS_WEIGHTS.match(name))


def download_model(
    repo_id: str, *, token: str | None = None, revision: str | None = None, what: str = "draft model"
) -> Path:
    """The folder of `repo_id`'s config, generation config, safetensors weights and tokenizer files at
    `revision` (a commit sha pins it; default: the commit `main` is at now). Raises `HubFileError`."""
    return download_repo_files(repo_id, is_model_file, token=token, revision=revision, what=what)


def local_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The Hub cache's folder for `repo_id` at `revision` (default `main`), if there is one (it may
    hold only some of the repo's files); nothing is asked of the Hub."""
    try:
        return _cached_snapshot(repo_id, revision)
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def cached_repo_folder(path: Path) -> Path | None:
    """The Hub cache's folder of the repo (`models--OWNER--NAME`) whose snapshot holds `path` (a file
    or the snapshot folder itself), if it is in one."""
    for folder in (path, *path.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
            return folder.parent.parent
    return None


def refetch_advice(path: Path, otherwise: str) -> str:
    """What to do about a damaged checkpoint file `path`: `otherwise`, or, for a file of the Hub cache,
    to delete the repo's cache folder. Deleting the snapshot alone does not help: huggingface_hub
    links its files again to the blobs it keeps beside them, damaged or not."""
    repo = cached_repo_folder(path)
    if repo is None:
        return otherwise
    return f"delete {repo} (the Hub cache's copy of that repo) and load it again to download it afresh"


@dataclass(frozen=True)
class RepoFiles:
    """Some files of one commit of a Hub repo: `folder`, its snapshot in the Hub cache, holds those
    downloaded; `names`, every file of the commit (what the cache's copy holds, where the Hub was
    not asked); `commit`, its sha (None where the Hub was not asked)."""

    folder: Path
    names: frozenset[str]
    commit: str | None


def download_repo_files(
    repo_id: str,
    wanted: Callable[[str], bool],
    *,
    token: str | None = None,
    revision: str | None = None,
    what: str = "model",
) -> Path:
    """The snapshot folder, in the Hub cache, of the files `wanted` accepts of one commit of `repo_id`.

    The commit's listing comes first; names `is_safe_filename` refuses are skipped before anything
    is downloaded, and so are the weights files loading would not read (`weights_files`: shards beside
    a `model.safetensors`, or that its index does not name; the index is read first). Every file
    comes from the commit listed (`revision`, default `main` as it is now), even if the branch moves
    meanwhile. Offline (`HF_HUB_OFFLINE`), or when the Hub cannot be reached, the Hub cache's copy is
    used. `what` names the repo in error messages.

    Raises:
        HubFileError: the repo, revision or a file is missing, gated or private; or the files are not
            in the cache and the Hub cannot be reached or is offline. The message says what to do.
    """
    return repo_files(repo_id, wanted, token=token, revision=revision, what=what).folder


def repo_files(
    repo_id: str,
    wanted: Callable[[str], bool],
    *,
    token: str | None = None,
    revision: str | None = None,
    what: str = "model",
) -> RepoFiles:
    """`download_repo_files`, with the names of all the commit's files and its sha. Raises as it."""
    endpoint = hub_endpoint()
    try:
        if hub_offline():
            return _cached_files(repo_id, revision)
        try:
            info = HfApi(endpoint=endpoint, token=token).model_info(
                repo_id, revision=revision, expand=["sha", "siblings"], timeout=hub_timeout()
            )
        except HubUnreachable:  # what the cache holds, as snapshot_download does
            return _cached_files(repo_id, revision)
        listed = frozenset(s.rfilename for s in info.siblings or [] if is_safe_filename(s.rfilename))
        chosen = {name for name in listed if wanted(name)}
        names = _files_read(repo_id, chosen, listed, wanted, token=token, commit=info.sha, what=what)
        if not names:
            raise HubFileError(f"The {what} {repo_id} has none of the files needed to load it.", lasting=True)
        folder = download_files(repo_id, names, token=token, revision=info.sha)
        _record_ref(folder, revision or "main", info.sha)
        return RepoFiles(folder, listed, info.sha)
    except HubFileError:
        raise
    except HFValidationError:
        raise HubFileError(
            f"The {what} {repo_id!r} is neither a local folder nor a Hub repo id (owner/name).", lasting=True
        ) from None
    except GatedRepoError as err:  # before RepositoryNotFoundError, its base class
        raise HubFileError(
            f"The {what} {repo_id} is gated on the Hub: accept its licence on its model page, then log in "
            "with a token that has access (`hf auth login`, or set HF_TOKEN).",
            lasting=True,
        ) from err
    except RepositoryNotFoundError as err:
        raise HubFileError(
            f"The {what} {repo_id} was not found on the Hub ({endpoint}) nor as a local folder; if the "
            "repo is private, log in with a token that has read access (`hf auth login`, or set HF_TOKEN).",
            lasting=True,
        ) from err
    except RevisionNotFoundError as err:
        raise HubFileError(
            f"The {what} {repo_id} has no revision {revision!r} on the Hub ({endpoint}) any more.",
            lasting=True,
        ) from err
    except LocalEntryNotFoundError as err:  # before EntryNotFoundError, its base class
        # huggingface_hub says this of a Hub that answered with an error too, once its retries are spent.
        answer = _error_status(err.__cause__)
        if answer is not None:
            raise HubFileError(
                f"The {what} {repo_id} could not be downloaded: the Hub ({endpoint}) answered {answer[1]}. "
                f"{_remedy(answer[0])}pass the folder of a downloaded copy.",
                lasting=False,
            ) from err
        raise HubFileError(
            f"The {what} {repo_id} is not in the local Hub cache and could not be downloaded from "
            f"{endpoint} (offline, or the Hub is unreachable): connect and unset HF_HUB_OFFLINE, or pass "
            "the folder of a downloaded copy.",
            lasting=False,
        ) from err
    except EntryNotFoundError as err:
        raise HubFileError(
            f"A file of the {what} {repo_id} is missing on the Hub: {err}", lasting=True
        ) from err
    except HfHubHTTPError as err:
        raise HubFileError(
            f"Could not download the {what} {repo_id} from {endpoint}: {err}", lasting=False
        ) from err


def _files_read(
    repo_id: str,
    chosen: set[str],
    listed: frozenset[str],
    wanted: Callable[[str], bool],
    *,
    token: str | None,
    commit: str,
    what: str,
) -> list[str]:
    """`chosen` less the weights files loading would not read (`weights_files`): a sharded copy beside
    `model.safetensors`, shards the index does not name (a stale set of another count beside it), shards
    without an index. The index, which decides, is downloaded first, from `commit`.

    Raises:
        HubFileError: the index names a shard the commit does not hold.
    """
    weights = {n for n in chosen if n == SAFETENSORS_INDEX or SAFETENSORS_WEIGHTS.match(n)}
    if weights <= {SINGLE_WEIGHTS}:
        return sorted(chosen)

    def index() -> Any:
        folder = download_files(repo_id, [SAFETENSORS_INDEX], token=token, revision=commit)
        try:
            return json.loads((folder / SAFETENSORS_INDEX).read_bytes())
        except ValueError:  # not UTF-8 JSON: it names no weights
            return None

    try:
        read = {name for name in weights_files(chosen, index) if wanted(name)}
    except ShardIndexError:  # the index alone, whose check when the checkpoint is loaded says what is wrong
        read = set()
    if read != {SINGLE_WEIGHTS}:
        read |= {SAFETENSORS_INDEX} & chosen
    missing = sorted(read - listed)
    if missing:
        raise HubFileError(
            f"A file of the {what} {repo_id} is missing on the Hub: its {SAFETENSORS_INDEX} names "
            f"{', '.join(missing[:3])}, which commit {commit} does not hold. Pass the folder of a "
            "complete copy.",
            lasting=True,
        )
    return sorted(chosen - weights | read)


def _error_status(err: BaseException | None) -> tuple[int, str] | None:
    """The HTTP status the Hub answered `err` with, and it said as "HTTP 500 (Internal Server
    Error)"; None where it gave no answer (offline, unreachable)."""
    response = getattr(err, "response", None) if isinstance(err, HfHubHTTPError) else None
    if response is None:
        return None
    reason = getattr(response, "reason_phrase", "")
    return response.status_code, f"HTTP {response.status_code}" + (f" ({reason})" if reason else "")


def _remedy(status: int) -> str:
    """What to do about a Hub's answer, before "or pass the folder of a downloaded copy"."""
    if status in (401, 403):
        return "Log in with a token that may read it (`hf auth login`, or set HF_TOKEN), or "
    if status == 429 or status >= 500:
        return "Try again later, or "
    return "Check the repo on the Hub, or "


def download_files(repo_id: str, names: list[str], *, token: str | None, revision: str | None) -> Path:
    """Download `names` (checked with `is_safe_filename`) from one commit of `repo_id` into the Hub
    cache; return the snapshot folder that holds them."""
    unsafe = [name for name in names if not is_safe_filename(name)]
    if unsafe or not names:
        raise ValueError(f"Refusing to download {unsafe or 'no files'} from {repo_id}.")
    paths = [
        hf_hub_download(
            repo_id, name, revision=revision, token=token, endpoint=hub_endpoint(), cache_dir=_cache()
        )
        for name in names
    ]
    return Path(paths[0]).parents[len(Path(names[0]).parts) - 1]


def safetensors_names(repo_id: str, filename: str, *, commit: str, token: str | None = None) -> list[str]:
    """The tensor names in one safetensors file of `repo_id` at `commit`, read from its header (a
    range request: the tensors are not downloaded), waiting `hub_timeout()` for each answer.
    Raises huggingface_hub's errors, and `HubUnreachable`."""
    api = HfApi(endpoint=hub_endpoint(), token=token)
    header = api.parse_safetensors_file_metadata(repo_id, filename, revision=commit, timeout=hub_timeout())
    return list(header.tensors)


def _record_ref(snapshot: Path, revision: str, commit: str) -> None:
    """Note in the Hub cache that `revision` (a branch or tag) was at `commit`, as `hf_hub_download`
    does when it resolves one: files fetched by the commit's sha alone leave no ref behind, and an
    offline call (`HF_HUB_OFFLINE`), which finds a repo's snapshot by the ref of its branch, would
    then not see them."""
    if is_commit(revision) or not is_safe_filename(revision):
        return
    ref = snapshot.parent.parent / "refs" / revision  # <repo folder>/snapshots/<sha> -> <repo folder>/refs
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    except OSError:  # a read-only cache: the files are still there, offline calls just will not find them
        pass


def _cached_files(repo_id: str, revision: str | None) -> RepoFiles:
    folder = _cached_snapshot(repo_id, revision)
    return RepoFiles(folder, frozenset(p.name for p in folder.iterdir()), None)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The Hub cache's snapshot of `repo_id` at `revision`; LocalEntryNotFoundError if there is none."""
    return Path(snapshot_download(repo_id, revision=revision, local_files_only=True, cache_dir=_cache()))


def _cache() -> str | None:
    return os.environ.get("HF_HUB_CACHE")
