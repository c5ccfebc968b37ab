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


# What telling a repo's kind asks of the Hub: its listing, its config.json, its safetensors header.
REQUESTS = {
    "listing": lambda repo, commit: f"/api/models/{repo}",
    "config": lambda repo, commit: f"/{repo}/resolve/{commit}/config.json",
    "header": lambda repo, commit: f"/{repo}/resolve/{commit}/model.safetensors",
}
# A config.json left unanswered is asked again by huggingface_hub for minutes (60 s a try): not here.
FAILURES = [(request, failure) for request in REQUESTS for failure in (500, 503, 429, "stalled")]
FAILURES.remove(("config", "stalled"))


@pytest.mark.parametrize(("request_", "failure"), FAILURES)
def test_a_request_the_hub_failed_once_is_asked_again(tmp_path, hub, monkeypatch, request_, failure):
    """A published EAGLE head is told from its listing, config.json and safetensors header. The Hub
    listed the repo but failed the header's request once: the head was then recorded as no head (a
    draft model) for the rest of the process, so it ran as a draft model, or was refused as a head,
    until `clear_cache()`."""
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    repo = "someone/eagle-head"
    commit = hub.add(repo, write_eagle1(tmp_path / "head", tiny_llama(0), weights="model.safetensors")).sha
    path = REQUESTS[request_](repo, commit)
    if failure == "stalled":
        hub.stalled = {path}
    else:
        monkeypatch.setattr(
            "huggingface_hub.utils._http.time.sleep", lambda seconds: None
        )  # its retries' waits
        hub.failing = {path: failure}
    try:
        finished_within(30, lambda: draft_method(repo))  # not told: the Hub did not answer
    finally:
        hub.stalled, hub.failing = set(), {}
    assert any(asked == path for _, asked in hub.requests)
    assert draft_method(repo) == "eagle"
