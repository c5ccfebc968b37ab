"""Serve what `speculative=` chose with vLLM or SGLang: `export_serving(...)` writes `serving.json`.

Each of our methods maps to an engine's own speculative method, or is refused with what to use
instead (`ServingExportError`). A plan is engine-neutral (`ServingPlan`); one renderer per engine
turns it into the command line, and for vLLM the `speculative_config` dict and a Python snippet.

Names checked against the engines' sources (the versions below):

- vLLM's repository, `vllm/config/speculative.py`: `SpeculativeConfig` keys `method`, `model`,
  `num_speculative_tokens` (> 0), `prompt_lookup_min`, `prompt_lookup_max`; `SpeculativeMethod`
  literals ngram, draft_model, suffix, eagle, eagle3, MTP types. That Medusa is gone from the 0.33.0
  wheel (0.32 keeps it) and that a missing `method` is guessed from the draft's path (so it is
  always written) are the facts gathered in issue 15 from the released wheels, not re-checked here.
  CLI `vllm serve TARGET --speculative-config JSON`.
- the sglang 0.5.23 wheel, `sglang/srt/arg_groups/fields/spec.py` and `fields/model.py` (the
  `ServerArgs` fields; the CLI flag is the field name with dashes): `model_path`,
  `speculative_algorithm` (builtins EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, ...),
  `speculative_draft_model_path`, `speculative_num_steps`,
  `speculative_eagle_topk`, `speculative_num_draft_tokens` (the verify width: `ngram_worker.py`
  feeds that many tokens a request from its sequence length on, the first being the last sampled
  token, so k drafts are k + 1); no n-gram size flags (earlier releases' match-window flags are
  gone). Launched with `python -m sglang.launch_server`.
- Head layouts: see `hf_specdec/heads/layouts.py`.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .bench.suites import builtin_suite_path, load_prompt_file, take_per_category
from .core.stats import SpeculativeStats
from .drafters.base import options_to_config
from .drafters.draft_model import DraftModelConfig
from .drafters.ngram import NgramConfig
from .heads.checkpoint import CONFIG_NAME, load_head
from .heads.eagle3 import Eagle3Head
from .heads.layouts import check_layout, save_eagle3, save_speculators
from .loading import encode_prompts, pad_token_id, use_chat_template
from .selection.select import registry_heads, select_draft
from .version import __version__

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
VLLM_MEDUSA_LAST = "0.32"  # the last vLLM release with method="medusa"
ENGINES = {"vllm": VLLM_VERSION, "sglang": SGLANG_VERSION}
SERVING_FILE = "serving.json"
HEAD_FOLDER = "draft-head"  # under the output folder: a head converted to the engine's layout
Source = str | None  # a folder or Hub repo id, when given
Options = dict[str, Any]  # SpeculativeConfig.options
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ServingExportError(ValueError):
    """What `speculative=` would run cannot be served by that engine; the message says what to use."""


@dataclass
class ServingPlan:
    """What to serve, before an engine is chosen.

    Attributes:
        method: our method name (`SpeculativeConfig.method`).
        engine_method: the engine's name for it, per engine ("vllm" -> "ngram", "sglang" -> "NGRAM").
        draft: the draft model or head the engine loads (a local folder or a Hub repo id), if any.
        head: an EAGLE-3 head module to write into the engine's layout (our own format, converted).
        measure: the `speculative=` dict whose adaptive run measures the draft length.
        target: the target, when the plan had to load it (a head is checked against it).
        ngram: (min, max) n-gram sizes, for prompt lookup.
        caveats: what differs between our run and the engine's.
    """

    method: str
    engine_method: dict[str, str]
    draft: str | None = None
    head: Any = None
    measure: dict[str, Any] = field(default_factory=dict)
    target: Any = None
    ngram: tuple[int, int] | None = None
    caveats: list[str] = field(default_factory=list)


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
            `draft_model` when `draft` is given, `eagle` when `head` is given.
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
    options = dict(options or {})
    method, draft, reason = _resolve_method(model, method, draft, head)
    planner = _PLANNERS.get(method)
    if planner is None:
        raise ValueError(f"Unknown method {method!r}; valid methods: {', '.join(sorted(_PLANNERS))}.")
    plan = planner(model, draft, head, options)
    if reason:
        plan.caveats.insert(0, reason)
    if plan.head is not None and out is None:
        raise ValueError("Exporting a head converted to the engine's layout needs an output folder (out=).")
    k, note = _draft_length(model, plan, num_draft_tokens, from_bench)
    if note:
        plan.caveats.append(note)
    result = _RENDERERS[engine](model, plan, k, Path(out) if out is not None else None)
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SERVING_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def command_line(result: dict[str, Any]) -> str:
    """`result["command"]` as one line for a POSIX shell."""
    return shlex.join(result["command"])


# --- which method -------------------------------------------------------------------------------


def _resolve_method(
    model: str, method: str | None, draft: str | None, head: str | None
) -> tuple[str, str | None, str]:
    """(method, draft, why it was chosen when the caller did not say)."""
    if method not in (None, "auto"):
        return method, draft, ""
    if head is not None:
        return "eagle", draft, ""
    if draft is not None:
        return "draft_model", draft, ""

    choice = select_draft(model)
    why = f"Chosen as speculative=True would for {model}: {choice.method} ({choice.reason})"
    return choice.method, choice.draft, why


# --- plans, one per method ----------------------------------------------------------------------


def _plan_ngram(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    config = options_to_config(NgramConfig, options)
    return ServingPlan(
        "ngram",
        {"vllm": "ngram", "sglang": "NGRAM"},
        measure={"method": "ngram", "options": options},
        ngram=(config.min_ngram, config.max_ngram),
    )


def _plan_draft_model(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    if draft is None:
        raise ValueError("method 'draft_model' needs --draft: the draft model's folder or Hub repo id.")

    options_to_config(DraftModelConfig, options)  # unknown options are named now, not at measuring time
    _check_vocab(model, draft)
    return ServingPlan(
        "draft_model",
        {"vllm": "draft_model", "sglang": "STANDALONE"},
        draft=str(draft),
        measure={"method": "draft_model", "draft": str(draft), "options": options},
        caveats=_not_carried(options),
    )


def _plan_onnx(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    """An exported ONNX draft: the engines run PyTorch weights, so serve the model it came from."""
    if draft is None:
        raise ValueError("method 'onnx' needs --draft: the folder written by `hf-specdec export-onnx`.")
    source = _onnx_source(Path(draft))
    if source is None:
        raise ServingExportError(
            f"vLLM and SGLang cannot run the ONNX draft {draft}, and the folder does not record which model "
            "it was exported from. Export the model you exported instead: "
            "`hf-specdec export-serving TARGET --method draft_model --draft <that model>`."
        )

    shared = {key: value for key, value in options.items() if key in DraftModelConfig.__dataclass_fields__}
    plan = _plan_draft_model(model, source, head, shared)
    plan.method = "onnx"
    plan.caveats += _not_carried({key: v for key, v in options.items() if key not in shared})
    plan.caveats.append(
        f"The ONNX draft {draft} is served as the model it was exported from ({source}), run by the "
        "engine's own kernels: it drafts as an fp32 export does (an int8 export drafts a little "
        "differently), with the engine's timing, not ONNX Runtime's."
    )
    return plan


def _plan_quantized(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    raise ServingExportError(
        "method 'quantized' drafts with an int8 copy of the target itself, which neither vLLM nor SGLang "
        "offers (their drafts are separate, smaller models or trained heads). Export --method ngram, "
        "--method draft_model --draft <a small model with the target's tokenizer>, or an EAGLE-3 head "
        "(--head DIR) instead."
    )


def _plan_medusa(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    raise ServingExportError(
        f"Medusa heads cannot be served by vLLM {VLLM_VERSION} (method 'medusa' was removed in 0.33; vLLM "
        f"{VLLM_MEDUSA_LAST} and earlier still had it) nor by SGLang {SGLANG_VERSION} (no Medusa). Pin "
        f"vllm<=0.32 to serve it, or export --method ngram, --method draft_model or an EAGLE-3 head."
    )


def _plan_eagle(model: str, draft: Source, head: Source, options: Options) -> ServingPlan:
    source = head or draft
    if source is None:
        raise ValueError("method 'eagle' needs --head: the draft head's folder.")
    known = _registry_head(str(source))
    if known is not None:  # a published head on the Hub, in its authors' layout: engines read it as is
        if known["method"] == "medusa":
            return _plan_medusa(model, draft, head, options)
        return _plan_registry_head(model, known, options)
    if not Path(str(source)).is_dir():
        raise ValueError(
            f"Draft head {source!r} is neither a local folder nor a head the registry knows; download it "
            "and pass its folder."
        )
    return _plan_local_head(model, Path(str(source)), options)


def _plan_registry_head(model: str, known: dict[str, Any], options: Options) -> ServingPlan:
    """A published head on the Hub, in its authors' layout: the engines read it as it is."""
    targets = [t.lower() for t in known["targets"]]
    origin = _hub_origin(model)
    if origin is not None and origin.lower() not in targets:
        raise ServingExportError(
            f"The head {known['head']} was trained for {', '.join(known['targets'])}, not for {origin}: a "
            "head only drafts for the model it was trained on. `hf-specdec select TARGET` lists the heads "
            "known for a target."
        )
    three = known.get("layout") == "EAGLE-3"
    plan = ServingPlan(
        "eagle",
        {"vllm": "eagle3" if three else "eagle", "sglang": "EAGLE3" if three else "EAGLE"},
        draft=known["head"],
        measure={"method": "eagle", "draft": known["head"], "options": options},
    )
    if origin is None:
        plan.caveats.append(
            f"{model} does not say which Hub model it is, so whether {known['head']} was trained for it "
            f"(it was for {', '.join(known['targets'])}) could not be checked."
        )
    return plan


def _plan_local_head(model: str, folder: Path, options: dict[str, Any]) -> ServingPlan:
    target = _load_target(model)
    loaded = load_head(str(folder), target)
    measure = {"method": loaded.config.method, "draft": loaded, "options": options}
    if loaded.config.method == "medusa":
        return _plan_medusa(model, None, str(folder), options)
    if isinstance(loaded, Eagle3Head):
        return ServingPlan(
            "eagle",
            {"vllm": "eagle3", "sglang": "EAGLE3"},
            head=loaded,
            measure=measure,
            target=target,
            caveats=_not_carried(options),
        )
    if not (folder / CONFIG_NAME).is_file():  # a published EAGLE-1/2 folder: the engines read it as is
        return ServingPlan(
            "eagle",
            {"vllm": "eagle", "sglang": "EAGLE"},
            draft=str(folder),
            measure=measure,
            target=target,
            caveats=_not_carried(options),
        )

    try:
        check_layout(loaded, "speculators and original EAGLE-3")
    except ValueError as err:  # our EAGLE-1-style heads: no engine layout drafts as they do
        raise ServingExportError(str(err)) from None
    raise AssertionError(f"{type(loaded).__name__} passed the EAGLE-3 layout check")


_PLANNERS = {
    "ngram": _plan_ngram,
    "draft_model": _plan_draft_model,
    "eagle": _plan_eagle,
    "medusa": _plan_medusa,
    "onnx": _plan_onnx,
    "quantized": _plan_quantized,
}


# --- engines ------------------------------------------------------------------------------------


def _render_vllm(model: str, plan: ServingPlan, k: int, out: Path | None) -> dict[str, Any]:
    caveats = list(plan.caveats)
    draft = plan.draft
    if plan.head is not None:
        draft, note = _write_head(plan.head, "speculators", model, k, out)
        caveats.append(note)
    config: dict[str, Any] = {"method": plan.engine_method["vllm"]}  # else vLLM guesses from the path
    if draft is not None:
        config["model"] = draft
    config["num_speculative_tokens"] = k
    if plan.ngram is not None:
        config["prompt_lookup_max"], config["prompt_lookup_min"] = plan.ngram[1], plan.ngram[0]
        caveats.append(
            f"vLLM's prompt lookup matches n-grams of {plan.ngram[0]}..{plan.ngram[1]} tokens as ours does; "
            "which earlier occurrence it continues from may differ, so acceptance may differ a little."
        )
    caveats.append(
        "vLLM verifies with its own kernels and batching: its greedy output equals plain vLLM's up to "
        "floating-point near-ties, and may differ from hf-specdec's at such ties."
    )
    snippet = (
        "from vllm import LLM, SamplingParams\n\n"
        'if __name__ == "__main__":  # vLLM starts its workers by spawn\n'
        f"    llm = LLM(model={model!r}, speculative_config={config!r})\n"
        '    outputs = llm.generate(["Hello!"], SamplingParams(temperature=0, max_tokens=64))\n'
        "    print(outputs[0].outputs[0].text)\n"
    )
    command = ["vllm", "serve", model, "--speculative-config", json.dumps(config)]
    return _result("vllm", model, plan, k, draft, command, caveats, speculative_config=config, python=snippet)


def _render_sglang(model: str, plan: ServingPlan, k: int, out: Path | None) -> dict[str, Any]:
    algorithm = plan.engine_method["sglang"]
    caveats = list(plan.caveats)
    draft = plan.draft
    if plan.head is not None:
        draft, note = _write_head(plan.head, "eagle3", model, k, out)
        caveats.append(note)
    command = ["python", "-m", "sglang.launch_server", "--model-path", model]
    command += ["--speculative-algorithm", algorithm]
    if draft is not None:
        command += ["--speculative-draft-model-path", draft]
    if plan.ngram is not None:
        # Earlier releases had --speculative-ngram-{min,max}-match-window-size; 0.5.23 has not (its
        # NGRAM fields: bfs breadths, match type, max_trie_depth), and an unknown flag stops the
        # server, so our n-gram sizes are not written.
        caveats.append(
            "SGLang runs NGRAM speculation on CUDA only, matching suffixes in its own trie with its "
            f"defaults: our n-gram sizes ({plan.ngram[0]}..{plan.ngram[1]}) are not carried over."
        )
    else:  # a chain of k drafts: k steps, one candidate each
        command += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
    command += ["--speculative-num-draft-tokens", str(k + 1)]
    caveats.append(
        f"--speculative-num-draft-tokens is {k + 1} for {k} draft tokens: SGLang counts the last verified "
        "token as the root of its draft tree."
    )
    return _result("sglang", model, plan, k, draft, command, caveats)


_RENDERERS = {"vllm": _render_vllm, "sglang": _render_sglang}


def _result(
    engine: str,
    model: str,
    plan: ServingPlan,
    k: int,
    draft: str | None,
    command: list[str],
    caveats: list[str],
    **extra: Any,
) -> dict[str, Any]:
    return {
        "engine": engine,
        "engine_version": ENGINES[engine],
        "model": model,
        "method": plan.method,
        "engine_method": plan.engine_method[engine],
        "draft": draft,
        "num_draft_tokens": k,
        "command": command,
        **extra,
        "caveats": caveats,
        "written_by": f"hf-specdec {__version__}",
    }


def _write_head(head: Any, layout: str, model: str, k: int, out: Path | None) -> tuple[str, str]:
    """Write `head` in `layout` under `out`; returns its folder and a note on it."""

    assert out is not None  # export_serving checked it before measuring anything
    folder = out / HEAD_FOLDER
    if layout == "speculators":
        verifier = _hub_origin(model)
        save_speculators(head, folder, verifier=verifier or model, num_speculative_tokens=k)
        short = (
            f"`vllm serve {folder}` (the short form) would load the verifier {verifier} from the Hub"
            if verifier
            else f"`vllm serve {folder}` (the short form) fails: vLLM needs its verifier to be a Hub repo id"
        )
        note = (
            f"The head is written in the speculators layout at {folder}. {short}; the command here is the "
            "long form, which serves the target you name."
        )
    else:
        save_eagle3(head, folder)
        note = f"The head is written in the original EAGLE-3 layout (LlamaForCausalLMEagle3) at {folder}."
    return str(folder), note


# --- draft length -------------------------------------------------------------------------------


def _draft_length(
    model: str, plan: ServingPlan, num_draft_tokens: int | str, from_bench: str | Path | None
) -> tuple[int, str]:
    """The fixed draft length to serve with, and a note when it was measured."""
    if num_draft_tokens != "auto":
        n = num_draft_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f'num_draft_tokens must be a positive integer or "auto", got {n!r}.')
        return n, ""
    if from_bench is not None:
        counts = _bench_counts(Path(from_bench), plan.method)
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

    target = target if target is not None else _load_target(model)
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


def _bench_counts(path: Path, method: str) -> tuple[int, list[int]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Cannot read the benchmark results {path}: {err}.") from None
    steps, drafted, seen = 0, [], set()
    for measurement in data.get("measurements", []):
        stats = measurement.get("stats") or {}
        seen.add(stats.get("method") or measurement.get("row"))
        if stats.get("method") != method:
            continue
        steps += int(stats.get("speculative_steps", 0))
        for i, count in enumerate(stats.get("position_drafted", [])):
            if i == len(drafted):
                drafted.append(0)
            drafted[i] += int(count)
    if not steps and method not in seen:
        found = ", ".join(sorted(str(m) for m in seen if m)) or "none"
        raise ValueError(f"The benchmark {path} has no {method} measurements (it has: {found}).")
    return steps, drafted


# --- helpers ------------------------------------------------------------------------------------


def _not_carried(options: Options) -> list[str]:
    """A caveat naming drafter options the engines have no equivalent of, if any."""
    if not options:
        return []
    names = ", ".join(f"{key}={value!r}" for key, value in sorted(options.items()))
    return [f"Options {names} have no equivalent in vLLM or SGLang and are not carried over."]


def _load_target(model: str) -> Any:
    # The checkpoint's dtype, as vLLM serves it; a model needing its repo's code is refused, not run.
    return AutoModelForCausalLM.from_pretrained(model, trust_remote_code=False).eval()


def _vocab_size(name: str) -> int:
    try:
        return int(AutoConfig.from_pretrained(name, trust_remote_code=False).get_text_config().vocab_size)
    except (OSError, ValueError) as err:
        raise ValueError(f"Cannot read the config of {name} to compare vocabulary sizes: {err}") from None


def _check_vocab(model: str, draft: str) -> None:
    target_vocab, draft_vocab = _vocab_size(model), _vocab_size(str(draft))
    if target_vocab != draft_vocab:
        raise ServingExportError(
            f"vLLM's draft_model (and SGLang's STANDALONE) need the draft's vocab_size to equal the "
            f"target's, but {draft} has {draft_vocab} and {model} has {target_vocab} (padded sizes count, "
            "even with a shared tokenizer). Use a draft with the same vocab_size, or --method ngram."
        )


def _onnx_source(folder: Path) -> str | None:
    """The PyTorch model an exported ONNX folder came from: the folder itself when it also holds
    safetensors weights, else its config's `_name_or_path` when that names one; None if unknown."""
    if any(folder.glob("*.safetensors")):
        return str(folder)
    config = folder / "config.json"
    origin = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    if origin and (Path(origin).is_dir() or (_REPO_ID.match(origin) and not Path(origin).exists())):
        return origin
    return None


def _hub_origin(model: str) -> str | None:
    """The Hub repo id `model` is, or that its local folder's config.json names; None if neither."""
    if _REPO_ID.match(model) and not Path(model).exists():
        return model
    config = Path(model) / "config.json"
    origin = json.loads(config.read_text()).get("_name_or_path", "") if config.is_file() else ""
    return origin if _REPO_ID.match(origin or "") and not Path(origin).exists() else None


def _registry_head(name: str) -> dict[str, Any] | None:
    if Path(name).exists():
        return None

    return next((entry for entry in registry_heads() if entry["head"].lower() == name.lower()), None)
