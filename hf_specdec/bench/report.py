"""Figures derived from measurements (medians, speedups, acceptance) and the files a run writes."""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.stats import SpeculativeStats
from ..lossless import KINDS, bound_formula
from ..store.manifest import write_atomically
from .machine import busy_note
from .plots import MissingMatplotlib, plot_acceptance, plot_speedup
from .result import PLAIN, BenchResult, Measurement

Key = tuple[int, str, str]  # (batch size, category, row)


def summarize(measurements: list[Measurement]) -> list[dict[str, Any]]:
    """One entry per (batch size, category, row), in the order they were first measured.

    `speedup` is the row's median tokens/s over plain's median tokens/s in that category;
    `paired_speedup` the median over prompts of each prompt's own ratio (less sensitive to drift).
    """
    groups = _group(measurements, lambda m: (m.batch_size, m.category, m.row))
    rank = {row: i for i, row in enumerate(dict.fromkeys(m.row for m in measurements))}
    entries = []
    for batch_size, category, row in sorted(groups, key=lambda k: _order(k, groups, rank)):
        group = groups[(batch_size, category, row)]
        plain = groups.get((batch_size, category, PLAIN), [])
        entry = {"batch_size": batch_size, "category": category, "row": row}
        entries.append({**entry, **_figures(group, plain)})
    return entries


def _order(key: Key, groups: dict[Key, Any], rank: dict[str, int]) -> tuple[int, int, int]:
    """Batch sizes and categories as first measured, rows in the order the run defined them."""
    keys = list(groups)
    first_category = next(i for i, k in enumerate(keys) if k[:2] == key[:2])
    first_batch = next(i for i, k in enumerate(keys) if k[0] == key[0])
    return first_batch, first_category, rank[key[2]]


def overall(
    measurements: list[Measurement], summary: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Per (batch size, row): geometric mean over categories of the speedup; geometric mean over
    prompts of each prompt's own speedup (`paired_geomean_speedup`: each ratio taken within one
    prompt, so drift between prompts and their different lengths cancel); and statistics merged
    over every prompt (acceptance rate, both mean accepted lengths, acceptance by draft position).
    `summary` is `summarize(measurements)`, computed when not given."""
    summary = summarize(measurements) if summary is None else summary
    entries = []
    for (batch_size, row), group in _group(measurements, lambda m: (m.batch_size, m.row)).items():
        speedups = [
            e["speedup"]
            for e in summary
            if e["batch_size"] == batch_size and e["row"] == row and e["speedup"] is not None
        ]
        entry = {"batch_size": batch_size, "row": row, "categories": len(speedups)}
        entry["geomean_speedup"] = _geomean(speedups)
        plain = [m for m in measurements if m.batch_size == batch_size and m.row == PLAIN]
        entry["paired_geomean_speedup"] = _geomean(_paired(group, plain))
        entry["errors"] = sum(m.error is not None for m in group)
        entries.append({**entry, **_stats_figures(group)})
    return entries


def failed_rows(measurements: list[Measurement]) -> list[str]:
    """Each row, per batch size, that failed on every prompt it ran: "ROW (batch size B): its first
    error". Such a row measured nothing, which `hf-specdec bench`'s exit status says."""
    groups = _group(measurements, lambda m: (m.batch_size, m.row))
    return [
        f"{row} (batch size {batch_size}): {group[0].error.splitlines()[0]}"
        for (batch_size, row), group in groups.items()
        if all(m.error for m in group)
    ]


def _figures(group: list[Measurement], plain: list[Measurement]) -> dict[str, Any]:
    ok = [m for m in group if m.error is None]
    plain_ok = [m for m in plain if m.error is None]
    tokens_per_s = _median(m.tokens_per_s for m in ok)
    plain_tokens_per_s = _median(m.tokens_per_s for m in plain_ok)
    paired = _paired(ok, plain_ok)
    checked = [m.lossless for m in ok if m.lossless is not None]
    return {
        "runs": len(group),
        "prompts": sum(len(m.prompt_ids) for m in group),
        "errors": len(group) - len(ok),
        "error": next((m.error for m in group if m.error), None),
        "new_tokens": sum(m.new_tokens for m in ok),
        "seconds": sum(m.seconds for m in ok),
        "median_tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / plain_tokens_per_s if tokens_per_s and plain_tokens_per_s else None,
        "paired_speedup": _median(paired),
        **{kind: sum(c[kind] for c in checked) if checked else None for kind in KINDS},
        **_stats_figures(ok),
    }


def _paired(group: list[Measurement], plain: list[Measurement]) -> list[float]:
    """Each prompt's (or batch's) tokens/s over plain's on the same prompts."""
    by_prompts = {tuple(m.prompt_ids): m.tokens_per_s for m in plain if m.error is None}
    return [
        m.tokens_per_s / by_prompts[tuple(m.prompt_ids)]
        for m in group
        if m.error is None and m.tokens_per_s and by_prompts.get(tuple(m.prompt_ids))
    ]


def _stats_figures(group: list[Measurement]) -> dict[str, Any]:
    stats = [m.stats for m in group if m.stats is not None]
    if not stats:
        return dict.fromkeys(("speculative_steps", *_STATS_FIGURES))
    merged = SpeculativeStats()
    for s in stats:
        merged.merge(s)
    # The steps that verified a draft: none, and the figures' 0s mean "nothing drafted", not "all rejected".
    return {
        "speculative_steps": merged.speculative_steps,
        **{name: getattr(merged, name) for name in _STATS_FIGURES},
    }


# The derived figures of `SpeculativeStats` a report shows; the table's τ is the speculative one.
_STATS_FIGURES = (
    "acceptance_rate",
    "mean_accepted_length",
    "mean_accepted_length_speculative",
    "mean_nodes_verified",  # beside τ: the verify width each step paid for it (a tree's nodes)
    "per_position_acceptance",
)


def to_dict(result: BenchResult) -> dict[str, Any]:
    """The run as JSON-ready data: settings, derived figures and every measurement."""
    summary = summarize(result.measurements)
    return {
        "settings": result.settings,
        "interrupted": result.interrupted,
        "summary": summary,
        "overall": overall(result.measurements, summary),
        "measurements": [m.to_dict() for m in result.measurements],
    }


def to_markdown(result: BenchResult) -> str:
    """A header with the settings, then per batch size a speedup overview and a table per category."""
    summary = summarize(result.measurements)
    totals = overall(result.measurements, summary)
    lines = _header(result)
    for batch_size in result.settings["batch_sizes"]:
        entries = [e for e in summary if e["batch_size"] == batch_size]
        if entries:
            lines += _overview(batch_size, entries, [t for t in totals if t["batch_size"] == batch_size])
            for category in dict.fromkeys(e["category"] for e in entries):
                lines += _category_table(category, [e for e in entries if e["category"] == category])
    return "\n".join(lines) + "\n"


def save(result: BenchResult, out_dir: Path | str, *, plots: bool = True) -> list[Path]:
    """Write results.json, results.md and (with matplotlib) PNG plots; return the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md"]
    speedup, acceptance = out_dir / "speedup.png", out_dir / "acceptance_by_position.png"
    data = to_dict(result)
    # Renamed over the old files: a reader (export-serving --from-bench) never finds half of one.
    text = json.dumps(data, indent=2) + "\n"
    write_atomically(written[0], lambda tmp: tmp.write_text(text))
    markdown = to_markdown(result)
    write_atomically(written[1], lambda tmp: tmp.write_text(markdown))
    if plots:
        try:
            written.append(plot_speedup(data["summary"], speedup))
            written.append(plot_acceptance(data["overall"], acceptance))
        except MissingMatplotlib as err:
            warnings.warn(str(err), stacklevel=2)
    for stale in {speedup, acceptance} - set(written):  # an earlier run's plots, not this one's figures
        stale.unlink(missing_ok=True)
    return written


def _header(result: BenchResult) -> list[str]:
    s = result.settings
    mode = "sampling" if s["sample"] else "greedy"
    lines = ["# hf-specdec benchmark", ""]
    for note in s.get("notes") or []:
        lines += [note, ""]
    if s.get("command"):
        lines += ["Reproduce with:", "", f"    {s['command']}", ""]
    lines += [
        f"- Model: `{s['model']}`" + (f", draft `{s['draft']}`" if s["draft"] else ", no draft model"),
        f"- Suite: {s['suite']}, {_count(s['prompts'], 'prompt')} in "
        f"{_count(len(s['categories']), 'category', 'categories')}; "
        f"batch sizes {', '.join(map(str, s['batch_sizes']))}; {mode}; max_new_tokens {s['max_new_tokens']}; "
        f"chat template {'on' if s['chat_template'] else 'off'}; num_draft_tokens {s['num_draft_tokens']}",
        f"- Machine: {s['machine']}, {s['cpu_cores']} cores, {s['torch_threads']} torch threads; "
        f"load average (1/5/15 min) {_load(s.get('load_average_start'))} at start, "
        f"{_load(s.get('load_average_end'))} at end" + _others(s.get("cpu_taken_by_others")),
        *[f"- **{note}**" for note in [busy_note(s.get("cpu_taken_by_others"))] if note],
        f"- Software: torch {s['torch']}, transformers {s['transformers']}, Python {s['python']}; "
        f"date {s['date']}",
        *_runtime(s.get("runtime")),
        *_cache(s),
        "- Rows: " + ", ".join(f"`{r}`" for r in s["rows"]) + _missing_rows(s),
        "- Speedup = the row's median tokens/s over plain `generate`'s, per category (the paired "
        "line: the geometric mean over prompts of each prompt's own ratio, which drift between "
        "prompts and their lengths do not sway); rows run "
        "interleaved prompt by prompt in one process, order rotated per prompt, after one warm-up"
        + _repeats(s.get("repeats", 1))
        + ". "
        "τ = mean accepted length per speculative step (1 + accepted / drafts, as vLLM and "
        "Spec-Bench report it; the JSON also has `mean_accepted_length`, per step, plain ones "
        "included). " + _lossless_note(s),
        "",
    ]
    if result.interrupted:
        lines += ["**Interrupted: partial results.**", ""]
    return lines


def _lossless_note(settings: dict[str, Any]) -> str:
    """What the identical / tie / mismatch column compares, greedy or sampled."""
    if not settings["sample"]:
        return (
            "Identical / tie / mismatch = outputs equal to plain greedy `generate`'s, first differing "
            "at a rounding tie of the target's top two scores (`hf_specdec.lossless.check_greedy`), "
            "or differing otherwise (a bug)."
        )
    if not settings.get("outputs_checked", True):
        device = (settings.get("runtime") or {}).get("device", "this device")
        return (
            f"Outputs not classified: on {device} plain sampling's draws are not reproduced "
            "(`hf_specdec.lossless.check_sampled` does so on CPU and CUDA)."
        )
    return (
        "Identical / tie / mismatch = outputs equal to plain `generate`'s sample with the same seed "
        "(`torch.manual_seed` before each row; one untimed plain call more gives the scores it "
        "sampled from), first differing at a rounding tie of plain's draw "
        "(`hf_specdec.lossless.check_sampled`), or differing otherwise (a bug); – where rejection "
        "sampling chose some tokens (drafts sampled from a drafter's q: `rejection_sampled_steps`) "
        "and for transformers' rows, which are exact in distribution, not token for token."
    )


def _cache(settings: dict[str, Any]) -> list[str]:
    """The cache line, for runs on transformers' static cache (older results have no such keys)."""
    if settings.get("cache_implementation", "dynamic") == "dynamic":
        return []
    skipped = (
        "; transformers' prompt lookup and assisted rows not run (on a static cache its assisted "
        "generation writes past the cache's end)"
    )
    if not settings.get("compiled"):
        return ['- Cache: static (`cache_implementation="static"`), every row' + skipped]
    return [
        "- Cache: static, decode step compiled (`compile_config`), every row; the verify widths "
        f"compiled before timing, {settings.get('graphs_compiled_while_timing', '?')} graphs compiled "
        "while timing" + skipped
    ]


def _missing_rows(settings: dict[str, Any]) -> str:
    if settings["draft"]:
        return ""
    return (
        ". Not run: `draft_model` and `transformers_assisted`, which need a smaller draft model (`--draft`)"
    )


def _overview(batch_size: int, entries: list[dict], totals: list[dict]) -> list[str]:
    rows = [r for r in dict.fromkeys(e["row"] for e in entries) if r != PLAIN]
    lines = [
        f"## Speedup vs plain generate, batch size {batch_size}",
        "",
        "| category | prompts | plain tok/s | " + " | ".join(rows) + " |",
        "|---|---:|---:|" + "---:|" * len(rows),
    ]
    for category in dict.fromkeys(e["category"] for e in entries):
        cells = {e["row"]: e for e in entries if e["category"] == category}
        plain = cells.get(PLAIN, {})
        lines.append(
            f"| {category} | {plain.get('prompts', '')} | {_num(plain.get('median_tokens_per_s'))} | "
            + " | ".join(_speedup_cell(cells.get(r)) for r in rows)
            + " |"
        )
    geomeans = {t["row"]: t["geomean_speedup"] for t in totals}
    lines.append(
        "| **geometric mean** | | | " + " | ".join(f"**{_x(geomeans.get(r))}**" for r in rows) + " |"
    )
    paired = {t["row"]: t["paired_geomean_speedup"] for t in totals}
    lines.append(
        "| geometric mean over prompts, paired | | | " + " | ".join(_x(paired.get(r)) for r in rows) + " |"
    )
    return [*lines, ""]


def _category_table(category: str, entries: list[dict]) -> list[str]:
    lines = [
        f"### {category}",
        "",
        "| row | tokens/s | speedup | paired speedup | acceptance | τ | nodes/step | identical/tie/mismatch "
        "| errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in entries:
        error = f"{e['errors']}/{e['runs']}: {_short(e['error'])}" if e["errors"] else ""
        drafted = e.get("speculative_steps") != 0  # results written before the count: as they were
        acceptance, tau, nodes = (
            (e["acceptance_rate"], e["mean_accepted_length_speculative"], e["mean_nodes_verified"])
            if drafted
            else (None, None, None)
        )
        lines.append(
            f"| {e['row']} | {_num(e['median_tokens_per_s'])} | {_x(e['speedup'])} | "
            f"{_x(e['paired_speedup'])} | {_pct(acceptance)} | {_num(tau, 2)} | {_num(nodes)} | "
            f"{_lossless(e)} | {error} |"
        )
    return [*lines, ""]


def _runtime(runtime: dict[str, Any] | None) -> list[str]:
    if not runtime:
        return []
    gpu = f" ({runtime['gpu']})" if runtime.get("gpu") else ""
    return [
        f"- Target: dtype {runtime['dtype']}, device {runtime['device']}{gpu}; CPU {runtime['cpu']}, "
        f"native bf16 {'yes' if runtime['cpu_native_bf16'] else 'no'}; "
        f"rounding-tie bound in {runtime['dtype']}: {bound_formula(runtime['dtype'])}"
    ]


def _lossless(entry: dict[str, Any]) -> str:
    if entry.get("identical") is None:
        return "–"
    text = " / ".join(str(entry[kind]) for kind in KINDS)
    return f"**{text}**" if entry["mismatch"] else text


def _speedup_cell(entry: dict | None) -> str:
    if entry is None:
        return "–"
    if entry["speedup"] is None and entry["errors"]:
        return "error"
    return _x(entry["speedup"])


def _group(measurements: Iterable[Measurement], key: Any) -> dict[Any, list[Measurement]]:
    groups: dict[Any, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault(key(m), []).append(m)
    return groups


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _geomean(values: list[float]) -> float | None:
    positive = [v for v in values if v > 0]
    return math.exp(sum(map(math.log, positive)) / len(positive)) if positive else None


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _others(share: float | None) -> str:
    return "" if share is None else f"; other processes took {share:.0%} of its CPU time during the run"


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _load(values: list[float] | None) -> str:
    return "unknown" if not values else " / ".join(f"{v:.2f}" for v in values)


def _short(message: str | None, limit: int = 80) -> str:
    text = (message or "").replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _repeats(repeats: int) -> str:
    return f"; each prompt's time is the median of {repeats} interleaved runs" if repeats > 1 else ""
