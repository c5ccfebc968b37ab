"""A local Hub-compatible server (`tests/hub_server.py`) that the code under test talks to."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest

try:  # `python -m pytest` from the repo root, or --import-mode=importlib
    from tests.hub_server import HubServer
except ImportError:  # plain `pytest`: the tests folder itself is on sys.path
    from hub_server import HubServer


def local_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """A local Hub, started: HF_ENDPOINT and HF_HUB_CACHE (read when a file is fetched) point at it,
    online, with no token logged in. The caller stops it."""
    server = HubServer().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # a login
    return server
