"""Loaded ONNX sessions (`hf_specdec.ort.session`): kept once a process, threads included."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hf_specdec.ort import session
from hf_specdec.ort.session import OnnxDecoder


def test_threads_asking_for_sessions_at_once_load_each_once_and_keep_at_most_two(monkeypatch, tmp_path):
    """A server's threads starting on the same ONNX draft at once each loaded a session of their
    own (seconds and memory each), and two evicting at once popped the same oldest key (KeyError)."""
    loads: list[str] = []

    def slow_load(cls, folder, provider, threads, target_device):
        loads.append(folder.name)
        time.sleep(0.05)  # as creating a session takes seconds: the other threads arrive meanwhile
        return object()

    monkeypatch.setattr(OnnxDecoder, "_load", classmethod(slow_load))
    monkeypatch.setattr(session, "_LOADED", {})
    folders = [tmp_path / name for name in ("a", "a", "a", "a", "b", "c", "d", "e")]
    start = threading.Barrier(len(folders))

    def load(folder):
        start.wait()
        return OnnxDecoder.load(folder, provider="cpu", threads=1)

    with ThreadPoolExecutor(len(folders)) as pool:
        decoders = list(pool.map(load, folders))
    assert loads.count("a") == 1 and len(set(map(id, decoders[:4]))) == 1
    assert len(session._LOADED) == session._KEEP_LOADED
