"""Benchmarks: speculative methods against plain `generate` and transformers' assisted generation.

from hf_specdec.bench import run_bench, save
result = run_bench(suite="specbench-quick", methods=["ngram"], max_new_tokens=96)
save(result, "bench_out/")         # results.json, results.md, speedup.png, acceptance_by_position.png
"""

from __future__ import annotations

from .report import overall, save, summarize, to_markdown
from .result import BenchResult, Measurement
from .runner import run_bench
from .suites import SUITES, Prompt

__all__ = [
    "SUITES",
    "BenchResult",
    "Measurement",
    "Prompt",
    "overall",
    "run_bench",
    "save",
    "summarize",
    "to_markdown",
]
