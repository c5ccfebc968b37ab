"""Serve what `speculative=` chose with vLLM or SGLang: `export_serving(...)` writes `serving.json`.

Each of our methods maps to an engine's own speculative method, or is refused with what to use
instead (`ServingExportError`). The export runs in four steps, one module each:

- here: which method (what `speculative=True` would pick when none is named), and the export itself;
- `plans.py`: one engine-neutral `ServingPlan` per method, or its refusal, keyed by drafter name;
- `measure.py`: the draft length (given, from bench results, or measured with our adaptive policy);
- `engines.py`: one renderer per engine: the command line, and for vLLM the `speculative_config`
  dict and a Python snippet (the engines' names, checked against their sources, are listed there).

`sources.py` holds the Hub / path helpers the steps share; `base.py` the versions, plan and error.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from ..selection.block import registry_block_heads
from ..selection.choice import auto_method
from ..selection.method import given_method, method_of_draft
from ..selection.select import select_draft
from .base import ENGINES, SGLANG_VERSION, VLLM_VERSION, ServingExportError, ServingPlan
from .engines import RENDERERS
from .measure import draft_length, measure_draft_length, median_draft_length
from .plans import plan_for
from .sources import check_target

SERVING_FILE = "serving.json"

__all__ = [
    "ENGINES",
    "SERVING_FILE",
    "SGLANG_VERSION",
    "VLLM_VERSION",
    "ServingExportError",
    "ServingPlan",
    "command_line",
    "export_serving",
    "measure_draft_length",
    "median_draft_length",
]


def export_serving(
    model: str,
    engine: str,
    *,
    method: str | None = None,
    draft: str | None = None,
    head: str | None = None,
    num_draft_tokens: int | str = "auto",
    options: dict[str, Any] | None = None,
    from_bench: str | Path | None = None,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """The engine's command (and, for vLLM, `speculative_config`) that serves `model` as
    `generate(..., speculative=dict(method=method, draft=draft or head, options=options))` would run it.

    Args:
        model: the target: a Hub repo id or a local folder (what the engine loads).
        engine: "vllm" or "sglang".
        method: one of our methods; None: what `speculative=True` picks for `model` (`select_draft`),
            or, for a `draft` or `head` given, the method `speculative=dict(draft=...)` runs it with
            (`selection.method.method_of_draft`: an EAGLE, Medusa or block draft, an assistant, an
            ONNX export, else a draft model; a `head` of no known kind is taken for an EAGLE head).
        draft: the draft model (`draft_model`) or exported ONNX folder (`onnx`).
        head: a draft head folder (`eagle`): ours, published (EAGLE-1/2, EAGLE-3) or speculators.
        num_draft_tokens: an integer, or "auto": measured with our adaptive policy, on a few built-in
            prompts, or read from the bench results in `from_bench`.
        options: the drafter's options, as in `SpeculativeConfig.options`.
        from_bench: a `results.json` of `hf-specdec bench` to take the measured draft length from.
        out: a folder for `serving.json` (and a converted head); None writes nothing.

    Raises:
        ServingExportError: the engine has no equivalent of the method; the message says what to use.
    """
    if engine not in ENGINES:
        raise ValueError(f"Unknown engine {engine!r}; expected one of: {', '.join(ENGINES)}.")
    if from_bench is not None and num_draft_tokens != "auto":
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} and from_bench both set the draft length: pass one of "
            "them (--num-draft-tokens N, or --from-bench FILE for the length measured there)."
        )
    if out is not None and Path(out).exists() and not Path(out).is_dir():  # before any measuring
        raise ValueError(f"out={str(out)!r} is a file; pass a folder for {SERVING_FILE}.")
    check_target(str(model))
    options = dict(options or {})
    method, draft, reason = _resolve_method(model, method, draft, head)
    plan = plan_for(method, model, draft, head, options)
    if reason:
        plan.caveats.insert(0, reason)
    if plan.head is not None and out is None:
        raise ValueError("Exporting a head converted to the engine's layout needs an output folder (out=).")
    k, note = draft_length(model, plan, num_draft_tokens, from_bench)
    if note:
        plan.caveats.append(note)
    result = RENDERERS[engine](model, plan, k, Path(out) if out is not None else None)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SERVING_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def command_line(result: dict[str, Any]) -> str:
    """`result["command"]` as one line for a POSIX shell."""
    return shlex.join(result["command"])


def _resolve_method(
    model: str, method: str | None, draft: str | None, head: str | None
) -> tuple[str, str | None, str]:
    """(method, draft, why it was chosen when the caller did not say)."""
    if method not in (None, "auto"):
        return method, draft, ""
    # What is given is exported as speculative=dict(draft=...) runs it: by what it is, told as generate
    # tells it (a Hub repo from its listing and headers), a head the registry lists by its entry.
    if head is not None:
        return given_method(head) or "eagle", draft, ""
    if draft is not None:
        return method_of_draft(draft), draft, ""

    choice = select_draft(model)
    block = next(iter(registry_block_heads(choice)), None)
    if block is not None:  # speculative=True drafts with the registry's block draft first
        why = (
            f"Chosen as speculative=True would for {model}: {block['method']} {block['head']} "
            f"({block['source']})"
        )
        return block["method"], block["head"], why
    # speculative=True runs the draft-free pick as suffix decoding (its drafts are prompt lookup's
    # until its corpus of earlier calls pays); the plan says what an engine without it serves.
    method = auto_method(choice.method)
    why = f"Chosen as speculative=True would for {model}: {method} ({choice.reason})"
    return method, choice.draft, why
