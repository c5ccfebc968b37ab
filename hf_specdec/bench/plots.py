"""PNG plots of a benchmark run (matplotlib is optional: `pip install matplotlib`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .result import PLAIN


class MissingMatplotlib(ImportError):
    """Plots were asked for but matplotlib is not installed."""


def _pyplot() -> Any:
    try:  # optional: only plots need it
        import matplotlib
    except ImportError as err:
        raise MissingMatplotlib(
            "Plots need matplotlib: pip install matplotlib (or pip install 'hf-specdec[plots]'); "
            "results.json and results.md were written without them."
        ) from err
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(summary: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: speedup vs plain per category (groups) and row (bars), one panel per batch size."""
    plt = _pyplot()
    batch_sizes = list(dict.fromkeys(e["batch_size"] for e in summary))
    fig, axes = plt.subplots(len(batch_sizes), 1, figsize=(11, 3.6 * len(batch_sizes)), squeeze=False)
    for ax, batch_size in zip(axes[:, 0], batch_sizes):
        entries = [e for e in summary if e["batch_size"] == batch_size]
        categories = list(dict.fromkeys(e["category"] for e in entries))
        rows = [r for r in dict.fromkeys(e["row"] for e in entries) if r != PLAIN]
        width = 0.8 / max(len(rows), 1)
        for i, row in enumerate(rows):
            speedups = {e["category"]: e["speedup"] for e in entries if e["row"] == row}
            xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [speedups.get(c) or 0.0 for c in categories], width, label=row)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right")
        ax.set_ylabel("speedup vs plain generate")
        ax.set_title(f"batch size {batch_size}")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(overall: list[dict[str, Any]], path: Path) -> Path:
    """Lines: acceptance α_i of draft position i (given the earlier ones), per row and batch size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for entry in overall:
        alphas = entry.get("per_position_acceptance")
        if alphas:
            label = f"{entry['row']} (batch {entry['batch_size']})"
            ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance given earlier positions accepted")
    ax.set_ylim(-0.02, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no speculative statistics", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
