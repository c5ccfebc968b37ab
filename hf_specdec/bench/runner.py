"""Timing rows against plain `generate`, prompt by prompt and interleaved in one process.

For every batch of prompts each row runs once (or `repeats` times, round after round, keeping the
median time), in an order rotated from batch to batch so that a
slow drift of the machine (other processes, thermal) falls on every row alike. Outputs are
classified against plain `generate`'s: identical, a rounding tie, or a mismatch (`hf_specdec.lossless`):
greedy ones against plain greedy's, sampled ones against plain's sample with the same seed, where the
row verified every step with plain's own draws (not rejection sampling, which is exact in
distribution, not token for token).
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import CompileConfig

from ..config import SpeculativeConfig
from ..core.static_kv import COMPILED_WIDTHS
from ..core.timing import clock
from ..drafters import DRAFTERS
from ..drafters.draft_model import load_draft
from ..heads import HEAD_METHODS, TRAINED_METHODS
from ..loading import (
    cpu_name,
    describe_runtime,
    encode_prompts,
    eos_token_ids,
    is_missing_path,
    load_model,
    pad_token_id,
    prompt_token_ids,
    use_chat_template,
)
from ..lossless import IDENTICAL, RowCheck, can_check_sampled, check_greedy, check_sampled, count_kinds
from ..ort.layout import is_onnx_folder
from .machine import OtherProcesses, load_average
from .result import PLAIN, BenchResult, Measurement
from .suites import Prompt, load_prompt_file, load_suite, take_per_category

PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
TREE_SUFFIX = "+tree"  # a method name + this: the same drafter proposing trees
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Row:
    """One way of generating: `generate` with these extra keyword arguments."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    batched: bool = True  # transformers' assisted generation refuses batch size > 1


def run_bench(
    model: Any = None,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str | None = None,
    draft: Any = None,
    heads: dict[str, Any] | None = None,
    methods: Sequence[str] | None = None,
    suite: str = "builtin",
    prompts: Path | str | Sequence[Prompt] | None = None,
    data_dir: Path | str | None = None,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
    batch_sizes: Sequence[int] = (1,),
    max_new_tokens: int = 128,
    sample: bool = False,
    chat_template: bool | None = None,
    num_draft_tokens: int | str = "auto",
    transformers_baselines: bool = True,
    repeats: int = 1,
    static_cache: bool = False,
    compile: bool | CompileConfig = False,
    progress: bool = True,
) -> BenchResult:
    """Benchmark speculative methods against plain `generate` and transformers' assisted generation.

    Args:
        model: a model folder or repo id, or a loaded model (then pass `tokenizer`); default: the
            offline SmolLM2-135M-Instruct demo model.
        dtype / device: how a model given by name is loaded (`hf_specdec.loading.load_model`):
            default the checkpoint's dtype (fp32 on a CPU without native bf16) and CUDA if available.
        draft: a draft model (folder, repo id or loaded model) for `draft_model` and `auto`, and for
            transformers' `assistant_model=` row; or an `export-onnx` folder, for `onnx` and `auto`.
        heads: trained heads by method, e.g. `{"eagle": "my-eagle-head"}` (folders or repo ids).
        methods: our methods to time (`hf_specdec.DRAFTERS` or "auto", each optionally followed by
            "+tree" for `SpeculativeConfig(tree=True)`, e.g. "ngram+tree"); default `auto` (what
            `speculative=True` does; with a draft, it drafts with that draft) and the methods of `heads`.
        suite / prompts: a suite name (see `SUITES`), or a JSONL file or list of `Prompt` instead.
        limit: at most this many prompts per category.
        categories: only the prompts of these categories.
        chat_template: None applies the tokenizer's chat template when it has one; True requires one.
        transformers_baselines: also time `prompt_lookup_num_tokens=10` and, with a draft,
            `assistant_model=` (batch size 1 and a dynamic cache only: on a static cache
            transformers 5.24's assisted generation writes past the cache's end, an IndexError).
        repeats: time each row this many times per prompt (all rows once, then again, each round
            in the same rotated order) and keep the median: on a shared machine one call's time
            scatters by more than the differences between methods.
        static_cache: every row, plain `generate` included, on transformers' static cache
            (`cache_implementation="static"`), which transformers compiles by default on a GPU.
        compile: `static_cache` with the decode step compiled on any device (True: transformers'
            default `CompileConfig`, inductor; or a `CompileConfig` of yours), told to compile on a
            CPU too: transformers' fast path, against which speculation must still pay. Every
            width a speculative row verifies at is compiled before timing (`compile_widths`),
            and the graphs compiled while timing are counted in
            `settings["graphs_compiled_while_timing"]`.

    Ctrl-C stops the run and returns what was measured so far, with `interrupted=True`.
    """
    heads = dict(heads or {})
    if not methods:
        methods = ["auto", *heads]
    methods = list(methods)
    _check_methods(methods, draft, heads)
    _check_batch_sizes(batch_sizes)
    if compile and len(batch_sizes) > 1:
        raise ValueError(
            f"--compile times one batch size per process (got {list(batch_sizes)}): dynamo keeps 8 graphs "
            "per function by default, plain's step and our five verify widths per batch size (a draft "
            "model's five more), so a second batch size would run eagerly while reported as compiled. "
            "Run once per batch size."
        )
    trees = [m for m in methods if _split_tree(m)[1]]
    if trees and (static_cache or compile):  # else each of their runs fails alone, the run exiting 0
        raise ValueError(
            f"{', '.join(trees)}: tree drafts over a static cache are not built yet; drop "
            f"{'--compile' if compile else '--static-cache'} (static_cache= / compile= in Python) or "
            f"the {TREE_SUFFIX} methods."
        )
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    if max_new_tokens < 1:  # else every row fails alone after the model loads
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    chosen = _select_prompts(suite, prompts, data_dir, limit, categories)
    _check_batches_fill(chosen, batch_sizes)
    model, tokenizer = load_model(model, dtype=dtype, device=device, tokenizer=tokenizer)
    model_name = str(model.name_or_path or type(model).__name__)
    chat = use_chat_template(tokenizer, chat_template)
    _check_context(model, tokenizer, chosen, chat, max_new_tokens)
    draft_model, draft_tokenizer = _load_draft(draft, model)
    static = bool(static_cache or compile)
    baselines = transformers_baselines and not static
    target, drafting = (model, tokenizer), (draft_model, draft_tokenizer)
    rows = _rows(methods, target, drafting, heads, num_draft_tokens, baselines, sample)
    settings = _settings(
        model_name, draft, methods, rows, suite if prompts is None else str(prompts), chosen,
        batch_sizes, max_new_tokens, sample, chat, num_draft_tokens,
    )  # fmt: skip
    settings["heads"] = {method: str(head) for method, head in heads.items()}
    settings["repeats"] = repeats
    settings["runtime"] = describe_runtime(model)
    result = BenchResult(settings)
    generation = dict(max_new_tokens=max_new_tokens, do_sample=sample, return_dict_in_generate=True)
    generation["pad_token_id"] = pad_token_id(tokenizer, model)
    generation.update(fast_path(static_cache, compile))
    result.settings["cache_implementation"] = generation.get("cache_implementation", "dynamic")
    result.settings["compiled"] = bool(compile)
    # Sampled outputs are checked only where plain's draws can be drawn again (`check_sampled`).
    result.settings["outputs_checked"] = not sample or can_check_sampled(model.device)
    others = OtherProcesses()
    try:
        _measure(model, tokenizer, rows, chosen, batch_sizes, chat, generation, result, progress, repeats)
    except KeyboardInterrupt:
        result.interrupted = True
    result.settings["load_average_end"] = load_average()
    result.settings["cpu_taken_by_others"] = others.share()
    return result


def _measure(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    prompts: list[Prompt],
    batch_sizes: Sequence[int],
    chat: bool,
    generation: dict[str, Any],
    result: BenchResult,
    progress: bool,
    repeats: int = 1,
) -> None:
    from tqdm.auto import tqdm

    plan = [(b, _batches(prompts, b), [r for r in rows if r.batched or b == 1]) for b in batch_sizes]
    runs = sum(len(items) * len(rs) for _, items, rs in plan) * repeats
    bar = tqdm(total=runs, disable=not progress, unit="run")
    try:
        for batch_size, items, batch_rows in plan:
            inputs = encode_prompts(tokenizer, items[0], chat, generation["pad_token_id"], model.device)
            if "cache_implementation" in generation:
                inputs = _size_static_cache(model, tokenizer, items, chat, generation)
            for row in batch_rows:  # warm-up: first calls pay for allocations and lazy imports
                _time_row(model, row, inputs, {**generation, "max_new_tokens": WARMUP_TOKENS}, 0)
            if "compile_config" in generation:
                compile_widths(model, inputs, generation)
            graphs = _graphs_compiled()
            for i, item in enumerate(items):
                inputs = encode_prompts(tokenizer, item, chat, generation["pad_token_id"], model.device)
                outputs: dict[str, Any] = {}
                order = batch_rows[i % len(batch_rows) :] + batch_rows[: i % len(batch_rows)]
                kept: dict[str, Measurement] = {}  # each row's first run: its output, stats, error
                times: dict[str, list[float]] = {row.name: [] for row in order}
                for round_ in range(repeats):
                    for row in order:
                        bar.set_postfix_str(f"bs={batch_size} {item[0].category} {row.name}")
                        if row.name not in kept or not kept[row.name].error:  # a failed row runs once
                            measurement, output = _time_row(model, row, inputs, generation, i)
                            if row.name not in kept:
                                kept[row.name], outputs[row.name] = measurement, output
                            times[row.name].append(measurement.seconds)
                        bar.update()
                        if round_ == repeats - 1:  # kept as soon as it is complete (Ctrl-C keeps it)
                            measurement = kept[row.name]
                            if not measurement.error:
                                measurement.seconds = statistics.median(times[row.name])
                            measurement.batch_size, measurement.category = batch_size, item[0].category
                            measurement.prompt_ids = [p.id for p in item]
                            result.measurements.append(measurement)
                measured = result.measurements[-len(batch_rows) :]
                if generation["do_sample"]:
                    _check_sampled(model, measured, outputs, inputs, generation, seed=i)
                else:
                    _check_lossless(model, measured, outputs, inputs)
            if "compile_config" in generation:  # each a compile inside some row's timed call
                settings = result.settings
                settings["graphs_compiled_while_timing"] = (
                    settings.get("graphs_compiled_while_timing", 0) + _graphs_compiled() - graphs
                )
    finally:
        bar.close()


def fast_path(static_cache: bool, compile: bool | CompileConfig) -> dict[str, Any]:
    """`generate`'s arguments for transformers' static-cache path, its decode step compiled with
    `compile` (True: transformers' default config), on a CPU too: transformers compiles there
    only when told so."""
    if not (static_cache or compile):
        return {}
    if not compile:
        return {"cache_implementation": "static"}
    # A copy: the flag below must not change the caller's config.
    config = copy.copy(compile) if isinstance(compile, CompileConfig) else CompileConfig()
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


def _size_static_cache(
    model: Any, tokenizer: Any, items: list[list[Prompt]], chat: bool, generation: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """One plain call on the longest batch, so that every later call of this batch size gets a static
    cache of the same length: transformers sizes it to the longest call so far, and each new length
    is a new shape for compiled graphs. Returns that batch's inputs."""
    encoded = [
        encode_prompts(tokenizer, item, chat, generation["pad_token_id"], model.device) for item in items
    ]
    longest = max(encoded, key=lambda inputs: inputs["input_ids"].shape[1])
    model.generate(**longest, **generation)
    return longest


def compile_widths(model: Any, inputs: dict[str, torch.Tensor], generation: dict[str, Any]) -> None:
    """Compile the target's forward at every padded verify width a call can reach before anything
    is timed: the model as its own draft, at a fixed length per width, drafts exactly that many."""
    for width in COMPILED_WIDTHS[1:]:
        if width >= generation["max_new_tokens"]:  # a draft never outruns the tokens left
            break
        spec = SpeculativeConfig(
            method="draft_model",
            draft=model,
            num_draft_tokens=width - 1,
            options={"compile_with_target": False},  # the target's graphs only: no draft of its own
        )
        with warnings.catch_warnings():  # that the draft is the target: meant, here
            warnings.simplefilter("ignore")
            model.generate(**inputs, **generation, speculative=spec)


def _graphs_compiled() -> int:
    """Graphs dynamo compiled so far in this process."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _time_row(
    model: Any, row: Row, inputs: dict[str, torch.Tensor], generation: dict[str, Any], seed: int
) -> tuple[Measurement, Any]:
    """Run one row once; an exception is recorded in the measurement, not raised."""
    measurement = Measurement(batch_size=0, category="", prompt_ids=[], row=row.name)
    if generation["do_sample"]:
        torch.manual_seed(seed)
    try:
        start = clock(model.device)
        out = model.generate(**inputs, **generation, **row.kwargs)
        measurement.seconds = clock(model.device) - start
    except Exception as err:  # one failing row must not lose the others
        measurement.error = f"{type(err).__name__}: {err}"
        return measurement, None
    eos = eos_token_ids(model)
    measurement.new_tokens = sum(len(t) for t in _new_tokens(out.sequences, inputs, eos))
    measurement.stats = getattr(out, "speculative_stats", None)
    return measurement, out


def _check_lossless(
    model: Any, measurements: list[Measurement], outputs: dict[str, Any], inputs: dict[str, Any]
) -> None:
    """Classify each greedy row's sequences against plain `generate`'s: identical, tie or mismatch."""
    plain = outputs.get(PLAIN)
    if plain is None:
        return
    for m in measurements:
        out = outputs.get(m.row)
        if out is not None:
            checks = check_greedy(
                model, inputs["input_ids"], plain.sequences, out.sequences, inputs["attention_mask"]
            )
            _record_checks(m, checks)


def _check_sampled(
    model: Any,
    measurements: list[Measurement],
    outputs: dict[str, Any],
    inputs: dict[str, Any],
    generation: dict[str, Any],
    seed: int,
) -> None:
    """Classify each sampled row that took plain's draws (`_took_plain_draws`) against plain's
    sample of the same seed: identical, tie or mismatch. Rows that had steps chosen by rejection
    sampling, transformers' rows (exact in distribution, not token for token) and every row on a
    device whose draws `check_sampled` does not reproduce stay unclassified.

    One untimed plain call, seeded as the timed plain row was, returns the scores plain sampled from
    (`check_sampled` needs them); where its sequences are not the timed row's (the bench's seeding
    broken, or kernels that do not repeat themselves), or where the check raises (its scores out of
    memory; plain's token not the argmax it reproduces, at a tie within fp32's own rounding), no row
    is judged, with a warning: a long run keeps its timings.
    """
    plain = outputs.get(PLAIN)
    if plain is None or not can_check_sampled(model.device):
        return
    torch.manual_seed(seed)  # as `_time_row` seeds the timed plain row
    try:  # a check must not lose the run's timings (its scores may not fit; a tie near fp32's own)
        reference = model.generate(**inputs, **generation, output_scores=True, output_logits=True)
        if not torch.equal(reference.sequences, plain.sequences):  # kernels that do not repeat (GPU)
            raise ValueError(f"plain sampling seeded with {seed} gave other tokens when called again")
        eos, prompt_length = eos_token_ids(model), inputs["input_ids"].shape[1]
        # The scores are the logits over the temperature: the check scales its bound alike.
        temperature = generation.get("temperature", model.generation_config.temperature)
        checked = {
            m.row: check_sampled(
                reference.sequences,
                reference.scores,
                outputs[m.row].sequences,
                prompt_length,
                seed,
                model.dtype,
                eos_token_ids=eos,
                temperature=1.0 if temperature is None else temperature,
                plain_logits=reference.logits,  # unmasked: top-k, top-p cut the rows' largest |logit|
            )  # fmt: skip
            for m in measurements
            if outputs.get(m.row) is not None and _took_plain_draws(m)
        }
    except (ValueError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError
        warnings.warn(f"This batch's sampled rows are left unclassified: {err}", UserWarning, stacklevel=2)
        return
    for m in measurements:
        if m.row in checked:
            _record_checks(m, checked[m.row])


def _took_plain_draws(measurement: Measurement) -> bool:
    """Plain itself, or our row that verified every step with plain sampling's draws: no step's
    tokens chosen by rejection sampling. Transformers' rows have no statistics to say so."""
    stats = measurement.stats
    return measurement.row == PLAIN or (stats is not None and stats.rejection_sampled_steps == 0)


def _record_checks(measurement: Measurement, checks: list[RowCheck]) -> None:
    measurement.lossless = count_kinds(checks)
    measurement.differences = [
        {"prompt_id": pid, **c.to_dict()}
        for pid, c in zip(measurement.prompt_ids, checks)
        if c.kind != IDENTICAL
    ]


def _new_tokens(sequences: torch.Tensor, inputs: dict[str, Any], eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to and including its first EOS (what follows is padding)."""
    prompt_len = inputs["input_ids"].shape[1]
    rows = []
    for row in sequences[:, prompt_len:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def _rows(
    methods: list[str],
    target: tuple[Any, Any],  # (model, tokenizer)
    drafting: tuple[Any, Any],  # (draft, its tokenizer): None, a loaded model, or an ONNX folder
    heads: dict[str, Any],
    num_draft_tokens: int | str,
    baselines: bool,
    sample: bool,
) -> list[Row]:
    draft, draft_tokenizer = drafting
    rows = [Row(PLAIN)]
    for label in methods:
        method, tree = _split_tree(label)
        spec = dict(method=method, num_draft_tokens=num_draft_tokens, tree=tree)
        if draft is not None and method in ("draft_model", "auto", "onnx"):  # onnx: an exported folder
            spec.update(draft=draft, draft_tokenizer=draft_tokenizer)
        if method in heads:
            spec.update(draft=heads[method])
        rows.append(Row(label, {"speculative": spec}))
    if baselines:
        rows.append(
            Row("transformers_prompt_lookup", {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}, False)
        )
        if draft is not None and not isinstance(draft, (str, Path)):  # not an ONNX folder
            rows.append(Row("transformers_assisted", _assisted(target, drafting, sample), False))
    return rows


def _assisted(target: tuple[Any, Any], drafting: tuple[Any, Any], sample: bool) -> dict[str, Any]:
    """transformers' `assistant_model=` arguments. transformers tells a draft of another tokenizer by
    its vocabulary size and runs one only given both tokenizers (universal assisted decoding),
    refusing `assistant_tokenizer=` for a draft of the same size."""
    (model, tokenizer), (draft, draft_tokenizer) = target, drafting
    kwargs = {"assistant_model": draft}
    vocab_size = [m.config.get_text_config().vocab_size for m in (model, draft)]
    if draft_tokenizer is not None and vocab_size[0] != vocab_size[1]:
        kwargs.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
        if sample:  # transformers prunes the LM head and swaps the embeddings of the draft it samples
            kwargs["assistant_model"] = copy.deepcopy(draft)  # with: our rows keep theirs whole
    return kwargs


def _split_tree(label: str) -> tuple[str, bool]:
    """ "ngram+tree" is method ngram drafting trees (`SpeculativeConfig(tree=True)`)."""
    return (label[: -len(TREE_SUFFIX)], True) if label.endswith(TREE_SUFFIX) else (label, False)


def _check_methods(labels: list[str], draft: Any, heads: dict[str, Any]) -> None:
    valid = sorted(["auto", *DRAFTERS])
    unknown = [m for m in labels if _split_tree(m)[0] not in valid]
    if unknown:
        raise ValueError(
            f"Unknown method(s) {', '.join(unknown)}; valid methods: {', '.join(valid)}, each optionally "
            f"followed by {TREE_SUFFIX} (draft trees, e.g. ngram{TREE_SUFFIX})."
        )
    trees = [m for m in labels if _split_tree(m)[1] and not DRAFTERS[_split_tree(m)[0]].supports_tree]
    if trees:
        growers = ", ".join(sorted(name for name, cls in DRAFTERS.items() if cls.supports_tree))
        raise ValueError(f"{', '.join(trees)}: only {growers} draft trees.")
    if len(set(labels)) != len(labels):
        raise ValueError(f"Methods are listed twice: {', '.join(labels)}.")
    methods = [_split_tree(m)[0] for m in labels]
    if "draft_model" in methods and draft is None:
        raise ValueError("Method draft_model needs a draft model: pass --draft (draft= in Python).")
    if "onnx" in methods and draft is None:
        raise ValueError(
            "Method onnx needs an ONNX draft: pass --draft FOLDER, a folder written by `hf-specdec "
            "export-onnx` (draft= in Python)."
        )
    for method in HEAD_METHODS:
        if method in methods and method not in heads:
            raise ValueError(
                f"Method {method} needs a trained head: pass --head {method}=FOLDER (heads= in Python); "
                f"train one with `hf-specdec train-draft --method {method}`."
            )
    not_heads = sorted(set(heads) - set(TRAINED_METHODS))
    if not_heads:
        raise ValueError(f"heads= takes {', '.join(TRAINED_METHODS)} heads, not {', '.join(not_heads)}.")
    unused = sorted(set(heads) - set(methods))
    if unused:
        raise ValueError(f"Heads given for {', '.join(unused)}, which is not among the methods benchmarked.")
    for method, folder in heads.items():
        if isinstance(folder, (str, Path)) and is_missing_path(str(folder)):
            raise ValueError(f"--head {method}={folder}: no such folder (nor a Hub repo id, owner/name).")


def _check_batch_sizes(batch_sizes: Sequence[int]) -> None:
    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"Batch sizes must be positive integers, got {list(batch_sizes)}.")
    if len(set(batch_sizes)) != len(batch_sizes):  # the report would merge the two runs as one
        raise ValueError(f"Batch sizes are listed twice: {list(batch_sizes)}; list each once.")


def _check_batches_fill(prompts: list[Prompt], batch_sizes: Sequence[int]) -> None:
    """Batches are formed within a category: one with fewer prompts than a batch size would have its
    calls run fewer rows than the batch size its figures are reported under."""
    counts = Counter(prompt.category for prompt in prompts)
    for size in batch_sizes:
        short = [f"{c} has {n} prompt{'' if n == 1 else 's'}" for c, n in sorted(counts.items()) if n < size]
        if short:
            raise ValueError(
                f"--batch-sizes {size}: category {'; '.join(short)}, fewer than one batch (batches are "
                "formed within a category, so its calls would run fewer rows than reported). Pass "
                f"--limit {size} or more where the prompts allow, leave it out with --categories, or "
                "pass a smaller batch size."
            )


def _select_prompts(
    suite: str,
    prompts: Path | str | Sequence[Prompt] | None,
    data_dir: Any,
    limit: int | None,
    categories: Sequence[str] | None = None,
) -> list[Prompt]:
    if prompts is None:
        chosen = load_suite(suite, data_dir)
    elif isinstance(prompts, (str, Path)):
        chosen = load_prompt_file(prompts)
    else:
        chosen = list(prompts)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}.")
    if categories:
        present = {p.category for p in chosen}
        missing = sorted(set(categories) - present)
        if missing:
            raise ValueError(
                f"No prompts of category {', '.join(missing)}; "
                f"the prompts have: {', '.join(sorted(present))}."
            )
        chosen = [p for p in chosen if p.category in set(categories)]
    chosen = take_per_category(chosen, limit)
    if not chosen:
        raise ValueError("No prompts to benchmark.")
    return chosen


def _check_context(
    model: Any, tokenizer: Any, prompts: list[Prompt], chat: bool, max_new_tokens: int
) -> None:
    """Refuse a prompt that, with the tokens generated after it, runs past the model's context
    (`_context_length`): transformers only logs it, and what a model computes there is noise
    whose timings and acceptance would be reported beside the others'."""
    context, source = _context_length(model.config.get_text_config())
    if context is None:
        return
    for prompt in prompts:
        length = len(prompt_token_ids(tokenizer, prompt, chat))
        if length + max_new_tokens > context:
            raise ValueError(
                f"Prompt {prompt.id} ({prompt.category}) is {length} tokens: with {max_new_tokens} new "
                f"tokens that is past the model's context of {context} ({source}). "
                "Shorten or drop that prompt, or lower --max-new-tokens."
            )


def _context_length(config: Any) -> tuple[int | None, str]:
    """The positions `config`'s model takes, and whence: `max_position_embeddings`, or, where YaRN
    rope scaling extends it, `original_max_position_embeddings` times `factor` (transformers 5.25's
    YaRN: its "post-yarn context length", which max_position_embeddings should equal but need not:
    model cards have users add YaRN with the original length equal to it). Other scaled rope types
    already count their scaling in max_position_embeddings (llama3, longrope; Gemma 3's linear)."""
    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return None, ""
    source = "max_position_embeddings"
    parameters = getattr(config, "rope_parameters", None) or {}
    for rope in [p for p in parameters.values() if isinstance(p, dict)] or [parameters]:  # per layer type
        factor = rope.get("factor")
        if rope.get("rope_type") != "yarn" or not isinstance(factor, (int, float)):
            continue
        original = rope.get("original_max_position_embeddings") or context
        if int(original * factor) > context:
            context = int(original * factor)
            source = f"yarn: original_max_position_embeddings {original} x factor {factor:g}"
    return context, source


def _batches(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    """Consecutive prompts of one category, `size` at a time (a category's last batch may be smaller)."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    return [group[i : i + size] for group in by_category.values() for i in range(0, len(group), size)]


def _load_draft(draft: Any, target: Any) -> tuple[Any, Any]:
    """A draft path becomes a loaded model once, shared by our row and transformers' assisted row.
    An exported ONNX folder stays a path: our drafter opens it; transformers cannot use it."""
    if draft is None or not isinstance(draft, (str, Path)) or is_onnx_folder(draft):
        return draft, None
    return load_draft(str(draft), target)


def _settings(
    model_name: str,
    draft: Any,
    methods: list[str],
    rows: list[Row],
    suite: str,
    prompts: list[Prompt],
    batch_sizes: Sequence[int],
    max_new_tokens: int,
    sample: bool,
    chat: bool,
    num_draft_tokens: int | str,
) -> dict[str, Any]:
    import transformers

    return {
        "model": model_name,
        "draft": None if draft is None else str(getattr(draft, "name_or_path", draft)),
        "methods": methods,
        "rows": [r.name for r in rows],
        "suite": suite,
        "prompts": len(prompts),
        "categories": sorted({p.category for p in prompts}),
        "batch_sizes": list(batch_sizes),
        "max_new_tokens": max_new_tokens,
        "sample": sample,
        "chat_template": chat,
        "num_draft_tokens": num_draft_tokens,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": load_average(),
    }
