"""The draft length to serve with: given, read from `hf-specdec bench` results, or measured by running
the target with our adaptive policy on a few built-in prompts.

It lives here rather than in `hf_specdec/bench/`: it is a step of the export (its refusals are
`ServingExportError`s naming export-serving's flags, and bench may not import serving), and it reads
from bench only the prompt suites and the results file's counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ..bench.runner import TREE_SUFFIX
from ..bench.suites import builtin_suite_path, load_prompt_file, take_per_category
from ..core.stats import SpeculativeStats
from ..loading import encode_prompts, pad_token_id, use_chat_template
from .base import ServingExportError, ServingPlan
from .sources import hub_origin, load_target


def draft_length(
    model: str, plan: ServingPlan, num_draft_tokens: int | str, from_bench: str | Path | None
) -> tuple[int, str]:
    """The fixed draft length to serve with, and a note when it was measured (a block draft's: its
    block, unless one is given)."""
    if plan.block is not None and num_draft_tokens == "auto":
        return plan.block, (
            f"num_speculative_tokens {plan.block} is the draft's whole block: the engines draft a block "
            "in one forward and verify all of it (our policy cuts each draft where verifying stops "
            "paying, which they do not)."
        )
    if num_draft_tokens != "auto":
        n = num_draft_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f'num_draft_tokens must be a positive integer or "auto", got {n!r}.')
        return n, ""
    if from_bench is not None:
        counts = _bench_counts(Path(from_bench), model, plan)
        k = median_draft_length(*counts)
        return k, (
            f"num_speculative_tokens {k} is the median draft length our adaptive policy verified for "
            f"{plan.method} in the benchmark {from_bench}; the engine drafts that fixed length."
        )
    counts, where = measure_draft_length(model, plan.measure, target=plan.target)
    k = median_draft_length(*counts)
    return k, (
        f"num_speculative_tokens {k} is the median draft length our adaptive policy verified on "
        f"{where}; the engine drafts that fixed length. Costs on the serving GPU differ (verifying "
        "several tokens is nearly free there, so longer drafts may pay): measure there and pass "
        "--num-draft-tokens to override."
    )


def median_draft_length(speculative_steps: int, position_drafted: list[int]) -> int:
    """The median length of verified drafts, from `SpeculativeStats` counters: `position_drafted[i]`
    counts drafts with more than i tokens, out of `speculative_steps` drafts."""
    if speculative_steps <= 0:
        raise ServingExportError(
            "Our adaptive policy never drafted on these prompts: speculation did not pay on this machine. "
            "Pass --num-draft-tokens N to export a fixed length anyway."
        )
    half = speculative_steps / 2
    return max((i + 1 for i, n in enumerate(position_drafted) if n >= half), default=1)


def measure_draft_length(
    model: str,
    speculative: dict[str, Any],
    *,
    target: Any = None,
    prompts: int = 3,
    max_new_tokens: int = 48,
) -> tuple[tuple[int, list[int]], str]:
    """Run `speculative` (with `num_draft_tokens="auto"`) greedily on `prompts` built-in prompts with
    `model` (`target`: the model already loaded from it) and return the counters
    `median_draft_length` reads, and where they were measured."""

    target = target if target is not None else load_target(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"Measuring the draft length needs {model}'s tokenizer ({err}); pass --num-draft-tokens N "
            "or --from-bench FILE instead."
        ) from None
    stats = SpeculativeStats()
    chosen = take_per_category(load_prompt_file(builtin_suite_path()), 1)[:prompts]
    for prompt in chosen:
        chat = use_chat_template(tokenizer)  # raw prompts (code completion) stay raw
        inputs = encode_prompts(tokenizer, [prompt], chat, pad_token_id(tokenizer, target), target.device)
        out = target.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            speculative={**speculative, "num_draft_tokens": "auto"},
            return_dict_in_generate=True,
            tokenizer=tokenizer,
        )
        stats.merge(out.speculative_stats)
    where = (
        f"{len(chosen)} built-in prompts ({', '.join(p.category for p in chosen)}; {max_new_tokens} new "
        f"tokens each) on this machine ({target.device.type}, {str(target.dtype).removeprefix('torch.')})"
    )
    return (stats.speculative_steps, stats.position_drafted), where


def _bench_counts(path: Path, model: str, plan: ServingPlan) -> tuple[int, list[int]]:
    """(speculative_steps, position_drafted) summed over the chain measurements of the plan's method
    in a results.json of `model` (the engines draft chains: a `+tree` row's nodes say nothing of a
    chain's length)."""
    method = plan.method
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"Cannot read the benchmark results {path}: {err}.") from None
    if data.get("interrupted"):  # Ctrl-C: the prompts measured so far, often a category or two
        raise ValueError(
            f"The benchmark {path} was interrupted: it holds only the prompts measured before it stopped. "
            "Run it to the end, or pass --num-draft-tokens N."
        )
    _check_bench_settings(path, data.get("settings") or {}, model, plan)
    steps, drafted, seen = 0, [], set()
    for measurement in data.get("measurements", []):
        stats = measurement.get("stats") or {}
        seen.add(stats.get("method") or measurement.get("row"))
        if stats.get("method") != method or str(measurement.get("row", "")).endswith(TREE_SUFFIX):
            continue
        if int(stats.get("speculative_steps", 0)) and "position_drafted" not in stats:
            # Without them every median came out as 1: bench once wrote only the derived rates.
            raise ValueError(
                f"The benchmark {path} holds no per-position draft counts (`position_drafted`; written "
                "by an older hf-specdec): run `hf-specdec bench` again, or pass --num-draft-tokens N."
            )
        steps += int(stats.get("speculative_steps", 0))
        for i, count in enumerate(stats.get("position_drafted", [])):
            if i == len(drafted):
                drafted.append(0)
            drafted[i] += int(count)
    if not steps and method not in seen:
        found = ", ".join(sorted(str(m) for m in seen if m)) or "none"
        raise ValueError(f"The benchmark {path} has no {method} measurements (it has: {found}).")
    return steps, drafted


def _check_bench_settings(path: Path, settings: dict[str, Any], model: str, plan: ServingPlan) -> None:
    """Refuse the results of another target or draft (a file without the setting is not checked)."""
    measured = settings.get("model")
    if measured is not None and not _same_model(str(measured), model):
        raise ValueError(
            f"The benchmark {path} measured {measured}, not {model}: its draft lengths are another "
            f"model's. Run `hf-specdec bench {model}` and pass its results, or --num-draft-tokens N."
        )
    # A head ran its method's rows (bench's settings keep it by method); the --draft model the rest.
    draft = plan.measure.get("draft")
    bench_draft = (settings.get("heads") or {}).get(plan.method, settings.get("draft"))
    if isinstance(draft, str) and bench_draft is not None and not _same_model(str(bench_draft), draft):
        raise ValueError(
            f"The benchmark {path} drafted with {bench_draft}, not {draft}: its draft lengths are "
            "another draft's. Bench that draft and pass its results, or --num-draft-tokens N."
        )


def _same_model(a: str, b: str) -> bool:
    """Whether two model names (Hub ids or folders) are the same model: equal, one folder, or a
    folder whose config.json names the other's Hub id."""
    if a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()):
        return True
    origin = hub_origin(a)
    return origin is not None and origin == hub_origin(b)
