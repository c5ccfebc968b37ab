"""A local Hub-compatible server (`tests/hub_server.py`) that the code under test talks to."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def silent_hub(monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """An endpoint that takes every connection and never answers (a stuck proxy), with the Hub's
    metadata timeout (HF_HUB_ETAG_TIMEOUT, read when called) at 1 s. The caller closes it."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed by the caller
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return server


def finished_within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`'s result, or a test failure if it has not returned after `seconds` (it is left
    running on a daemon thread rather than hanging the test run)."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(_outcome(call)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"still waiting for the Hub after {seconds} s"
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as err:  # re-raised on the test's thread
        return err
