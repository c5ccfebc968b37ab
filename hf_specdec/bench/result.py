"""What a benchmark run measured: one `Measurement` per (batch of prompts, row), and the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..stats import SpeculativeStats

PLAIN = "plain"


@dataclass
class Measurement:
    """One timed `generate` call: a row (plain, a method, a transformers baseline) on a batch of prompts.

    `lossless` counts the batch's sequences that are identical to plain greedy `generate`'s, differ
    first at a rounding tie, or mismatch (`hf_specdec.lossless.check_greedy`; None when sampling, or
    when plain or this row failed), and `differences` describes each row that is not identical;
    `error` is set, and the figures are empty, when the call raised.
    """

    batch_size: int
    category: str
    prompt_ids: list[str]
    row: str
    seconds: float = 0.0
    new_tokens: int = 0
    lossless: dict[str, int] | None = None
    differences: list[dict[str, Any]] = field(default_factory=list)
    stats: SpeculativeStats | None = None
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "category": self.category,
            "prompt_ids": self.prompt_ids,
            "row": self.row,
            "seconds": self.seconds,
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "lossless": self.lossless,
            "differences": self.differences,
            "stats": self.stats.to_dict() if self.stats else None,
            "error": self.error,
        }


@dataclass
class BenchResult:
    """Everything a run measured, with its settings; `interrupted` when Ctrl-C stopped it early."""

    settings: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    interrupted: bool = False

    def summary(self) -> list[dict[str, Any]]:
        """Per batch size, category and row: median tokens/s, speedup vs plain, acceptance, τ,
        and how many outputs were identical to plain greedy, rounding ties, or mismatches."""
        from .report import summarize

        return summarize(self.measurements)

    def overall(self) -> list[dict[str, Any]]:
        """Per batch size and row: geometric mean over categories of the speedup vs plain, and
        acceptance figures merged over every prompt."""
        from .report import overall

        return overall(self.measurements, self.summary())

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "interrupted": self.interrupted,
            "summary": self.summary(),
            "overall": self.overall(),
            "measurements": [m.to_dict() for m in self.measurements],
        }

    def to_markdown(self) -> str:
        from .report import to_markdown

        return to_markdown(self)

    def save(self, out_dir: Path | str, *, plots: bool = True) -> list[Path]:
        """Write results.json, results.md and (with matplotlib) PNG plots; return the paths written."""
        from .report import save

        return save(self, Path(out_dir), plots=plots)
