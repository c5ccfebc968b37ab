"""Loaded ONNX sessions (`hf_specdec.ort.session`): kept once a process, threads included."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hf_specdec.ort import session
from hf_specdec.ort.session import OnnxDecoder


def _loads_at_once(monkeypatch, folders) -> tuple[list[str], list]:
    """Each folder's session asked for on a thread of its own, all at once: the folders loaded, in
    order, and the sessions handed back."""
    loads: list[str] = []

    def slow_load(cls, folder, provider, threads, target_device):
        loads.append(folder.name)
        time.sleep(0.05)  # as creating a session takes seconds: the other threads arrive meanwhile
        return object()

    monkeypatch.setattr(OnnxDecoder, "_load", classmethod(slow_load))
    monkeypatch.setattr(session, "_LOADED", {})
    start = threading.Barrier(len(folders))

    def load(folder):
        start.wait()
        return OnnxDecoder.load(folder, provider="cpu", threads=1)

    with ThreadPoolExecutor(len(folders)) as pool:
        return loads, list(pool.map(load, folders))


def test_threads_starting_on_one_draft_at_once_share_its_session(monkeypatch, tmp_path):
    """A server's threads starting on the same ONNX draft at once each loaded a session of their own
    (seconds and memory each)."""
    loads, decoders = _loads_at_once(monkeypatch, [tmp_path / "a"] * 6)
    assert loads == ["a"] and len(set(map(id, decoders))) == 1


def test_threads_loading_more_drafts_than_are_kept_evict_without_failing(monkeypatch, tmp_path):
    """Two threads evicting at once popped the same oldest key (KeyError)."""
    loads, _ = _loads_at_once(monkeypatch, [tmp_path / name for name in "abcdefgh"])
    assert sorted(loads) == list("abcdefgh")
    assert len(session._LOADED) == session._KEEP_LOADED
