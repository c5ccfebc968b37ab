"""Benchmark prompt suites: Spec-Bench, MT-bench, HumanEval, a built-in suite, or a user's JSONL file."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# Spec-Bench's first 80 questions are MT-bench's; Spec-Bench reports them as one category.
_MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}
QUICK_PER_CATEGORY = 3


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt. `raw` prompts (code completion) never get a chat template."""

    id: str
    category: str
    text: str
    raw: bool = False


def data_dir() -> Path:
    """Shared benchmark data: `$HF_SPECDEC_DATA`, else `shared/data` next to the repository."""
    env = os.environ.get("HF_SPECDEC_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def builtin_suite_path() -> Path:
    """`configs/suites/builtin.jsonl` of the checkout, else the copy shipped in the package."""
    checkout = Path(__file__).resolve().parents[2] / "configs" / "suites" / "builtin.jsonl"
    packaged = Path(__file__).resolve().parents[1] / "_configs" / "suites" / "builtin.jsonl"
    return checkout if checkout.exists() else packaged


def load_suite(name: str, data: Path | str | None = None) -> list[Prompt]:
    """The prompts of the suite called `name` (see `SUITES`), read from `data` or `data_dir()`."""
    if name not in SUITES:
        raise ValueError(f"Unknown suite {name!r}; valid suites: {', '.join(SUITES)}.")
    return SUITES[name](Path(data) if data else data_dir())


def load_prompt_file(path: Path | str) -> list[Prompt]:
    """Prompts from a JSONL file: one object a line with a `prompt` string (or a `turns` list, whose
    first turn is used), and optionally `category`, `id` and `raw` (true: no chat template)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"Prompt file {path} is a folder: pass a JSONL file, one JSON object a line.")
    if not path.is_file():
        raise ValueError(f"Prompt file {path} does not exist.")
    prompts = []
    line_of: dict[str, int] = {}
    for number, line in _numbered_lines(path):
        if not line.strip():
            continue
        prompt = _parse_line(line, path, number)
        # Paired speedups match each run to plain's by prompt id: a shared id would divide one
        # prompt's time by another's.
        if prompt.id in line_of:
            raise ValueError(
                f"{path}, line {number}: prompt id {prompt.id!r} is already line {line_of[prompt.id]}'s "
                "(a prompt without 'id' takes its line number); give each prompt its own id."
            )
        line_of[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"Prompt file {path} is empty: it needs one JSON object a line with a 'prompt'.")
    return prompts


def take_per_category(prompts: Iterable[Prompt], limit: int | None) -> list[Prompt]:
    """At most `limit` prompts of each category, spread evenly over it, in the original order."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    kept = {id(p) for group in by_category.values() for p in _spread(group, limit)}
    return [p for group in by_category.values() for p in group if id(p) in kept]


def _spread(items: list[Prompt], limit: int | None) -> list[Prompt]:
    if limit is None or len(items) <= limit:
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def _numbered_lines(path: Path) -> Iterable[tuple[int, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from enumerate(f, 1)
    except UnicodeDecodeError as err:  # read in chunks: the line is not known
        raise ValueError(
            f"{path} is not UTF-8 text ({err.reason}); a prompt file is JSONL in UTF-8, one JSON object a "
            'line such as {"prompt": "..."}.'
        ) from None
    except gzip.BadGzipFile:
        raise ValueError(f"{path} ends in .gz but is not gzip-compressed: compress or rename it.") from None


def _parse_line(line: str, path: Path, number: int) -> Prompt:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: not valid JSON ({err.msg}); a prompt file is JSONL, one object a line such as "
            '{"prompt": "..."}.'
        ) from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    text = record.get("prompt")
    if text is None and isinstance(record.get("turns"), list) and record["turns"]:
        text = record["turns"][0]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: needs a non-empty 'prompt' string (or a 'turns' list of strings).")
    # Checked, not cast: bool("false") is True, and str(None) would make a category called "None".
    raw = record.get("raw", False)
    if not isinstance(raw, bool):
        raise ValueError(f"{where}: 'raw' is true or false (a JSON boolean), got {json.dumps(raw)}.")
    category = record.get("category", "custom")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"{where}: 'category' is a non-empty string, got {json.dumps(category)}.")
    id_ = record.get("id", record.get("question_id", record.get("task_id", number)))
    if isinstance(id_, bool) or not isinstance(id_, (str, int)) or not str(id_).strip():
        raise ValueError(f"{where}: 'id' is a non-empty string or an integer, got {json.dumps(id_)}.")
    return Prompt(id=str(id_), category=category, text=text, raw=raw)


def _require(path: Path) -> Path:
    if not path.is_file():
        raise ValueError(
            f"Benchmark data {path} not found. Point HF_SPECDEC_DATA (or --data-dir) at the folder "
            "holding specbench/, mtbench/ and humaneval/, or use --suite builtin."
        )
    return path


def _specbench(data: Path) -> list[Prompt]:
    prompts = load_prompt_file(_require(data / "specbench" / "question.jsonl"))
    return [
        Prompt(p.id, "mt_bench" if p.category in _MT_BENCH_CATEGORIES else p.category, p.text)
        for p in prompts
    ]


def _specbench_quick(data: Path) -> list[Prompt]:
    return take_per_category(_specbench(data), QUICK_PER_CATEGORY)


def _specbench_train(data: Path) -> list[Prompt]:
    """Spec-Bench without the `specbench-quick` prompts: train heads here, measure them there."""
    held_out = {p.id for p in _specbench_quick(data)}
    return [p for p in _specbench(data) if p.id not in held_out]


def _mtbench(data: Path) -> list[Prompt]:
    return load_prompt_file(_require(data / "mtbench" / "question.jsonl"))


def _humaneval(data: Path) -> list[Prompt]:
    prompts = load_prompt_file(_require(data / "humaneval" / "HumanEval.jsonl.gz"))
    return [Prompt(p.id, "humaneval", p.text, raw=True) for p in prompts]


def _builtin(data: Path) -> list[Prompt]:
    return load_prompt_file(builtin_suite_path())


SUITES: dict[str, Callable[[Path], list[Prompt]]] = {
    "specbench": _specbench,
    "specbench-quick": _specbench_quick,
    "specbench-train": _specbench_train,
    "mtbench": _mtbench,
    "humaneval": _humaneval,
    "builtin": _builtin,
}
