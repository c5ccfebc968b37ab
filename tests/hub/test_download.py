"""`hub.download`: a repo's files fetched from one commit, against a real local Hub server."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file, save

from hf_specdec.hub.config_check import weights_problem
from hf_specdec.hub.download import (
    HubFileError,
    HubUnreachable,
    ShardIndexError,
    download_model,
    download_repo_files,
    hub_timeout,
    safetensors_names,
    weights_files,
)
from hf_specdec.store.manifest import SAFETENSORS_INDEX

from ..helpers.hub import finished_within, silent_hub

try:  # `python -m pytest` from the repo root, or --import-mode=importlib
    from tests.hub_server import HubServer, build_tiny_repo
except ImportError:  # plain `pytest`: the tests folder itself is on sys.path
    from hub_server import HubServer, build_tiny_repo

REPO = "acme/Tiny-7M-Instruct"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A local Hub serving REPO (a config.json), the Hub cache under `tmp_path`."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    server = HubServer()
    server.add(REPO, folder)
    server.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    yield server
    server.stop()


def test_files_downloaded_from_main_are_found_offline(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files are fetched by the sha `main` was listed at; the cache must still say `main` is that
    commit, or an offline call (a registry draft, a draft= repo id used before) finds nothing."""
    online = download_repo_files(REPO, lambda name: name == "config.json")
    assert online.name == hub.repos[REPO].sha
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.failing["/"] = 500  # nothing may be asked of the Hub now
    assert download_repo_files(REPO, lambda name: name == "config.json") == online


def test_a_hub_that_answers_with_an_error_is_not_called_unreachable(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 for a file, once huggingface_hub's retries were spent, was reported as "offline, or the
    Hub is unreachable": the message now says what the Hub answered, and it may pass (not lasting)."""
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)  # its retries' waits
    hub.failing[f"/{REPO}/resolve/"] = 500
    with pytest.raises(
        HubFileError, match=r"the Hub \(http://.*\) answered HTTP 500 \(Internal Server Error\)"
    ) as err:
        download_repo_files(REPO, lambda name: name == "config.json")
    assert not err.value.lasting and "unreachable" not in str(err.value)


@pytest.mark.parametrize(
    ("status", "remedy"),
    [
        (403, "Log in with a token that may read it"),
        (429, "Try again later"),
        (404, "Check the repo on the Hub"),
    ],
)
def test_what_to_do_follows_the_hubs_answer(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, status: int, remedy: str
) -> None:
    """A Hub refusing a file (403) is no outage to wait out: each answer gets its own advice."""
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)
    hub.failing[f"/{REPO}/resolve/"] = status
    with pytest.raises(HubFileError, match=rf"answered HTTP {status} .*\. {remedy}.*, or pass the folder"):
        download_repo_files(REPO, lambda name: name == "config.json")


def test_a_hub_that_never_answers_is_unreachable_after_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing (`model_info`) was asked with no timeout: a Hub that took the connection and never
    answered hung `draft="owner/name"` and every Hub head for ever."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    server = silent_hub(monkeypatch)
    try:
        with pytest.raises(HubFileError, match=r"could not be downloaded .*unreachable") as err:
            finished_within(30, lambda: download_repo_files(REPO, lambda name: name == "config.json"))
    finally:
        server.close()
    assert not err.value.lasting


def test_a_safetensors_header_the_hub_never_gives_waits_the_hubs_timeout(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Telling a `draft=` repo's kind reads its safetensors header, a metadata request like the
    listing: it waited huggingface_hub's download timeout (10 s), whatever HF_HUB_ETAG_TIMEOUT said."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    commit = hub.push(REPO, {"model.safetensors": save({"fc.weight": torch.zeros(2, 2)})}).sha
    assert safetensors_names(REPO, "model.safetensors", commit=commit) == ["fc.weight"]
    hub.stalled = {f"/{REPO}/resolve/{commit}/model.safetensors"}
    try:
        with pytest.raises(HubUnreachable):
            finished_within(5, lambda: safetensors_names(REPO, "model.safetensors", commit=commit))
    finally:
        hub.stalled = set()


@pytest.mark.parametrize("value", ["ten", "10s", "nan", "0", "-1"])
def test_a_hub_timeout_that_is_no_number_of_seconds_is_refused(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """huggingface_hub refuses an HF_HUB_ETAG_TIMEOUT that is not a whole number (`int()` at its
    import); read later, ours was replaced by the 10 s default without a word, so a user who set
    a short one behind a stuck proxy waited 10 s a request not knowing why."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", value)
    with pytest.raises(
        ValueError, match=rf"HF_HUB_ETAG_TIMEOUT={value!r} is not a positive number of seconds"
    ):
        download_repo_files(REPO, lambda name: name == "config.json")


@pytest.mark.parametrize(("value", "seconds"), [("2", 2.0), ("0.5", 0.5), ("", 10.0)])
def test_a_hub_timeout_is_read_when_called(
    monkeypatch: pytest.MonkeyPatch, value: str, seconds: float
) -> None:
    """Fractions too (huggingface_hub takes whole seconds only); empty is unset: its 10 s default."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_ETAG_TIMEOUT", 10)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", value)
    assert hub_timeout() == seconds


# Both ways a repo's weights are fetched: a draft model's, a head's.
BOTH_FETCHES = pytest.mark.parametrize(
    "fetch",
    [
        download_model,
        lambda repo: download_repo_files(repo, lambda name: name.endswith((".json", ".safetensors"))),
    ],
    ids=["draft model", "draft head"],
)


@BOTH_FETCHES
def test_a_repo_holding_one_file_and_its_shards_downloads_the_file_only(
    hub: HubServer, tmp_path: Path, fetch: Callable[[str], Path]
) -> None:
    """A repo with `model.safetensors` and a sharded copy beside it (shards and their index) had
    both downloaded, twice its weights, though loading reads the single file (as transformers does)."""
    folder = build_tiny_repo(tmp_path / "both", 16, 1, 128, "A")
    weights = load_file(folder / "model.safetensors")
    size = sum(w.numel() * w.element_size() for w in weights.values())
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_torch_state_dict(weights, sharded, max_shard_size=size // 2 + 1)
    for shard in sharded.iterdir():  # beside model.safetensors
        shard.rename(folder / shard.name)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    hub.add("acme/Both-7M", folder)
    snapshot = fetch("acme/Both-7M")
    fetched = {name for _, name in hub.resolved("acme/Both-7M")}
    assert "model.safetensors" in fetched and (snapshot / "model.safetensors").is_file()
    assert not [name for name in fetched if name.startswith("model-") or name == SAFETENSORS_INDEX]


def _sharded_repo(folder: Path) -> list[str]:
    """A tiny model saved in `folder` as shards and their index alone (no model.safetensors); the
    shards' names."""
    build_tiny_repo(folder, 16, 1, 128, "A")
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    size = sum(w.numel() * w.element_size() for w in weights.values())
    save_torch_state_dict(weights, folder, max_shard_size=size // 3 + 1)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / SAFETENSORS_INDEX).is_file()
    return shards


@BOTH_FETCHES
def test_a_repo_holding_a_stale_set_of_shards_downloads_those_its_index_names_only(
    hub: HubServer, tmp_path: Path, fetch: Callable[[str], Path]
) -> None:
    """Every `model-NNNNN-of-NNNNN.safetensors` was downloaded: a repo resharded without deleting its
    old shards (another count, which its index no longer names) had both sets fetched, the stale
    one never read."""
    folder = tmp_path / "resharded"
    shards = _sharded_repo(folder)
    stale_count = len(shards) + 1
    stale = [f"model-{i:05d}-of-{stale_count:05d}.safetensors" for i in range(1, stale_count + 1)]
    for name in stale:
        (folder / name).write_bytes((folder / shards[0]).read_bytes())
    hub.add("acme/Resharded-7M", folder)
    snapshot = fetch("acme/Resharded-7M")
    fetched = {name for _, name in hub.resolved("acme/Resharded-7M")}
    assert sorted(name for name in fetched if name.startswith("model-")) == shards
    assert SAFETENSORS_INDEX in fetched and all((snapshot / name).is_file() for name in shards)
    assert weights_problem(snapshot) is None


def test_a_shard_the_index_names_that_the_repo_lacks_is_a_clear_error(hub: HubServer, tmp_path: Path) -> None:
    """The other shards were downloaded, and only the draft's check then found one missing."""
    folder = tmp_path / "partial"
    shards = _sharded_repo(folder)
    (folder / shards[-1]).unlink()
    hub.add("acme/Partial-7M", folder)
    with pytest.raises(
        HubFileError, match=rf"missing on the Hub: its {SAFETENSORS_INDEX} names {shards[-1]}, which commit"
    ) as err:
        download_model("acme/Partial-7M")
    assert err.value.lasting
    assert not [name for _, name in hub.resolved("acme/Partial-7M") if name.startswith("model-")]


SHARDS = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


@pytest.mark.parametrize(
    ("names", "index", "read"),
    [
        ({"model.safetensors", SAFETENSORS_INDEX, *SHARDS.values()}, None, ["model.safetensors"]),
        (
            {SAFETENSORS_INDEX, "model-00001-of-00009.safetensors"},
            {"weight_map": SHARDS},
            sorted(SHARDS.values()),
        ),
        ({"model-00001-of-00001.safetensors", "pytorch_model.bin"}, None, []),
    ],
    ids=["single-file-first", "the-shards-the-index-names", "no-index"],
)
def test_loading_reads_the_single_file_else_the_shards_its_index_names(names, index, read) -> None:
    """The one rule the download, the checks and the block-draft reader follow; the index is read
    only where the shards it names are what loading reads."""
    asked = []
    assert weights_files(names, lambda: asked.append(1) or index) == read
    assert len(asked) == (index is not None)


@pytest.mark.parametrize(
    ("index", "why"),
    [
        ({"weight_map": {}}, "names no weights"),
        ({"weight_map": ["model-00001-of-00001.safetensors"]}, "names no weights"),
        ([], "names no weights"),
        (
            {"weight_map": {"a": "../model-00001-of-00001.safetensors"}},
            "names files that are not safetensors shards",
        ),
        (
            {"weight_map": {"a": "model-00001-of-00001.safetensors\n"}},
            "names files that are not safetensors shards",
        ),
        ({"weight_map": {"a": "pytorch_model.bin"}}, "names files that are not safetensors shards"),
    ],
)
def test_an_index_naming_no_shards_is_refused(index, why) -> None:
    with pytest.raises(ShardIndexError, match=rf"^{SAFETENSORS_INDEX} {why}"):
        weights_files({SAFETENSORS_INDEX}, lambda: index)


def test_an_index_that_cannot_be_read_is_named_in_the_reason(tmp_path: Path) -> None:
    """A corrupt shard index is said to be one, not taken for pickled weights."""
    (tmp_path / SAFETENSORS_INDEX).write_text("{not json")
    assert weights_problem(tmp_path) == f"{SAFETENSORS_INDEX} is not valid JSON"
