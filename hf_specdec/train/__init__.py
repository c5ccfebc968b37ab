"""Training draft heads and block drafts by self-distillation: `hf-specdec train-draft`, or
`train_draft()`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..core.timing import clock
from ..loading import describe_runtime, load_model
from ..store.paths import cannot_write_in
from .data import build_sequences, load_prompts
from .features import cached_target_features
from .trainer import TrainConfig, check_resumable, feature_layers, train_head


def train_draft(
    target: Any = None,
    out: str | Path = "draft-head",
    *,
    suite: str | None = None,
    data: str | Path | None = None,
    max_new_tokens: int = 192,
    answers_per_prompt: int = 1,
    tokenizer: Any = None,
    config: TrainConfig | None = None,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Train an EAGLE, Medusa or MTP head or a DFlash block draft (`config.method`) for `target` (a
    model, folder or Hub id; None: the demo model).

    The training text is the target's greedy answers to `suite`'s prompts (default
    "specbench-train", which leaves out the prompts `hf-specdec bench --suite specbench-quick`
    measures) or to the prompts of a JSONL file `data`; a `.txt` file is used as it is.
    `answers_per_prompt` > 1 adds answers sampled from the target to each prompt's greedy one. Everything
    is written to `out`: the head (`head_config.json`, `head.safetensors`), `training.json` with
    the held-out acceptance estimates, `training.png`, and `checkpoint/` to resume from.
    A target given by name is loaded by `hf_specdec.loading.load_model` with `dtype` and `device`
    (default: the checkpoint's dtype, fp32 on a CPU without native bf16; CUDA if available).
    Returns the training log.
    """
    config = config or TrainConfig()
    for name, value in (("max_new_tokens", max_new_tokens), ("answers_per_prompt", answers_per_prompt)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    out = Path(out)
    if isinstance(target, (str, Path)) and Path(target).is_dir():
        # The head (and its checkpoint, which a rerun resumes only for the same target) names the
        # folder as it is, not as it was typed: `../model` from elsewhere is the same target.
        target = str(Path(target).resolve())
    _check_out(out, target)
    model, tokenizer = load_model(target, dtype=dtype, device=device, tokenizer=tokenizer)
    name = str(model.name_or_path or type(model).__name__)
    check_resumable(out, model, config)
    source = load_prompts(suite, data)
    layers = feature_layers(model, config)  # checked before the minutes of generating answers
    started = clock(model.device)
    sequences = build_sequences(
        model,
        tokenizer,
        source,
        out / "data" / "sequences.pt",
        max_new_tokens,
        answers_per_prompt=answers_per_prompt,
    )
    generated_at = clock(model.device)
    examples = cached_target_features(model, sequences, layers, out / "data" / "features.pt")
    featured_at = clock(model.device)
    log = train_head(model, examples, out, config)
    log["target"] = name
    log["runtime"] = describe_runtime(model)
    log["data"] = {
        "source": str(data) if data is not None else (suite or "specbench-train"),
        "sequences": len(sequences),
        "tokens": sum(len(s.ids) for s in sequences),
        "answer_tokens": sum(len(s.ids) - s.answer_start for s in sequences),
        "max_new_tokens": max_new_tokens,
        "answers_per_prompt": answers_per_prompt,
        "data_seconds": round(generated_at - started),
        "feature_seconds": round(featured_at - generated_at),
    }
    (out / "training.json").write_text(json.dumps(log, indent=2))
    _plot(log, out / "training.png")
    return log


def _check_out(out: Path, target: Any) -> None:
    """Refuse an `out` that cannot take the head, before the minutes of generating its training
    data: a file, the target's own folder (the head's files would mix with the model's), or a
    folder that cannot be written."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file; pass a folder for the head, its log and checkpoints.")
    folder = target if isinstance(target, str) else getattr(target, "name_or_path", None)
    if folder and Path(folder).is_dir() and out.resolve() == Path(folder).resolve():
        raise ValueError(
            f"out={str(out)!r} is the target's own folder; pass another folder for the head, its log and "
            "checkpoints (its files would be written among the model's)."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        message = f"out={str(out)!r} cannot be made ({error.strerror}); pass another folder."
        raise ValueError(message) from error
    if problem := cannot_write_in(out):
        raise ValueError(f"out={str(out)!r} cannot be written ({problem}); pass a folder you can write to.")


def _plot(log: dict[str, Any], path: Path) -> None:
    """Held-out acceptance over training time (skipped without matplotlib)."""
    try:  # matplotlib is optional
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    history = log["history"]
    if not history:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    minutes = [h["seconds"] / 60 for h in history]
    for i in range(len(history[-1]["acceptance"])):
        ax.plot(minutes, [h["acceptance"][i] for h in history], marker="o", label=f"draft token {i + 1}")
    ax.set_xlabel("training minutes")
    ax.set_ylabel("held-out acceptance")
    ax.set_ylim(0, 1)
    ax.set_title(f"{log['config']['method']} head: τ ≈ {history[-1]['tau']} (held-out estimate)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["TrainConfig", "train_draft"]
