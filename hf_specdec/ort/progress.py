"""What an export shows: a progress bar over named steps, and nothing of the exporter's chatter."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any

from tqdm.auto import tqdm


@contextlib.contextmanager
def quiet():
    """Silence the exporter's chatter (deprecations, torchvision not installed, per-step banners)."""
    names = ("torch.onnx", "torch.export", "onnxruntime", "transformers", None)  # None: the root logger
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_NullWriter()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _NullWriter:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


class Progress:
    """A tqdm bar over named steps whose elapsed time keeps ticking during long steps."""

    def __init__(self, steps: list[str], enabled: bool) -> None:
        self.bar = tqdm(total=len(steps), desc="export-onnx", unit="step", disable=not enabled)
        self.started = False
        self.done = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.done.wait(0.5):
            self.bar.refresh()

    def step(self, what: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(what)

    def __enter__(self) -> Progress:
        if not self.bar.disable:
            self.ticker.start()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        self.done.set()
        if exc_type is None:
            self.bar.update()
            self.bar.set_postfix_str("done")
        self.bar.close()
