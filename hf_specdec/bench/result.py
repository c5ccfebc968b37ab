"""What a benchmark run measured: one `Measurement` per (batch of prompts, row), and the whole run;
and tokens per target forward counted from outside a call, for the benchmark scripts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.stats import SpeculativeStats

PLAIN = "plain"


@dataclass
class Measurement:
    """One timed `generate` call: a row (plain, a method, a transformers baseline) on a batch of prompts.

    `lossless` counts the batch's sequences that are identical to plain `generate`'s, differ first
    at a rounding tie, or mismatch (`hf_specdec.lossless`: greedy, `check_greedy` against plain
    greedy's; sampling, `check_sampled` against plain's sample of the same seed), None where not
    classified: plain or this row failed, or, sampling, rejection sampling chose some of the row's
    tokens (`SpeculativeStats.rejection_sampled_steps`), the row is transformers' own, or the device's
    draws are not reproduced; `differences` describes each row that is not identical;
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
    """Everything a run measured, with its settings; `interrupted` when Ctrl-C stopped it early.

    Plain data: `report` derives the figures (`summarize`, `overall`) and writes the files (`save`).
    """

    settings: dict[str, Any]
    measurements: list[Measurement] = field(default_factory=list)
    interrupted: bool = False


def tokens_per_verify_forward(new_tokens: int, target_forwards: int, calls: int = 1) -> float:
    """The benchmarks' "tokens per target forward": `SpeculativeStats.mean_accepted_length` (the
    field's mean acceptance length τ over every verify forward, plain steps included), counted
    from outside the calls, for rows that have no statistics (plain `generate`, transformers' own
    generators) and alike for those that do, so that a table counts every row one way.

    `calls` greedy calls of batch 1 generated `new_tokens` in all (up to each call's stop) in
    `target_forwards` forwards of the target (a forward hook's count: the prompt's included). The
    prompt's forward gives a call its first token and verifies nothing, so both are left out:
    (new_tokens - calls) / (target_forwards - calls), 1.0 for plain decoding. It equals the
    statistics' figure unless a call stopped (an EOS, a stop string) inside its accepted drafts,
    whose tokens past the stop the statistics count and no output shows. 0.0 when no forward
    after the prompts' ran.
    """
    verify_forwards = target_forwards - calls
    return (new_tokens - calls) / verify_forwards if verify_forwards > 0 else 0.0
