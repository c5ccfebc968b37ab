"""What a draft named by Hub repo id is, as remembered in the process (`drafters.kind`): only what
the Hub answered is kept, never a guess made while it failed for now (how heads are told apart:
`tests/selection/test_method.py`)."""

from __future__ import annotations

import pytest

from hf_specdec import clear_cache
from hf_specdec.drafters.kind import draft_method

from ..conftest import tiny_llama
from ..helpers.hub import finished_within, local_hub
from ..helpers.published import write_eagle1


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = local_hub(tmp_path, monkeypatch)
    clear_cache()
    yield server
    server.stop()
    clear_cache()


@pytest.mark.parametrize("failure", [500, 503, 429, "stalled"])
def test_a_heads_header_the_hub_failed_to_give_once_is_read_again(tmp_path, hub, monkeypatch, failure):
    """A published EAGLE head is told from its safetensors header. The Hub listed the repo but failed
    that header's request once; the head was then recorded as no head (a draft model) for the rest of
    the process, so it ran as a draft model, or was refused as a head, until `clear_cache()`."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    repo = "someone/eagle-head"
    commit = hub.add(repo, write_eagle1(tmp_path / "head", tiny_llama(0), weights="model.safetensors")).sha
    header = f"/{repo}/resolve/{commit}/model.safetensors"
    if failure == "stalled":
        hub.stalled = {header}
    else:
        hub.failing = {header: failure}
    try:
        finished_within(30, lambda: draft_method(repo))  # not told: the Hub gave no header
    finally:
        hub.stalled, hub.failing = set(), {}
    assert ("GET", header) in hub.requests
    assert draft_method(repo) == "eagle"
