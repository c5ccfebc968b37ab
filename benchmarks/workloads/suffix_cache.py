"""The suffix corpus (`method="suffix"`) against prompt lookup (`ngram`) and plain decoding, call after
call, on a workload that repeats itself across calls and on one that does not.

    python benchmarks/workloads/suffix_cache.py
        [--prompts configs/suites/json_sql.jsonl | --suite specbench-quick] [--profile flat]
        [--rows plain,ngram,suffix] [--bounds 262144] [--skip 10] [--max-new-tokens 128]
        [--out bench_out/suffix_cache.json]

SmolLM2-135M-Instruct (the offline demo model, in its checkpoint's dtype) answers every prompt in
order, one `generate` call each (batch 1, greedy, chat template), once per row, the rows
interleaved prompt by prompt: `plain`, `ngram`, and `suffix` once per corpus bound in `--bounds`
(`suffix@N`, each on a copy of the model whose corpus, empty at first, only its own calls fill).
`suffix` runs with its defaults, which are what `speculative=True` runs where no draft model is
chosen. Each speculative row carries what verifying cost from call to call as `generate` does,
per row. The clock follows `--profile` (`hf_specdec.bench.regimes`: the model computes every
token, the clock advances by the profile's cost of each forward plus the host's CPU time between
them; `real` is this machine's own clock); plain, whose decisions never read the clock, is priced
from its recorded forwards. Reported over the calls after the first `--skip`: tokens per target
forward, tokens per second and their ratios to `ngram`, per category and overall; the corpus's
tokens and bytes after each call against its bound; greedy outputs checked against plain's
(`hf_specdec.lossless`: identical, a rounding tie, or a mismatch) wherever the rows' outputs differ
(all of them where the plain row runs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import hf_specdec
from hf_specdec.bench.regimes import PROFILES, REAL, emulate, host_clock, priced
from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.suites import load_prompt_file, load_suite
from hf_specdec.core.policy import DeviceCosts
from hf_specdec.core.timing import clock
from hf_specdec.drafters import suffix
from hf_specdec.drafters.suffix import SuffixConfig
from hf_specdec.drafters.suffix_array import bytes_per_token
from hf_specdec.loading import describe_runtime, encode_prompts, eos_token_ids, load_model, pad_token_id
from hf_specdec.lossless import check_greedy

_wall = time.perf_counter  # the machine's clock, whatever an emulation makes of time.perf_counter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", type=Path, default=None, help="a JSONL prompt file, run in its order")
    source.add_argument("--suite", default=None, help="a suite name (specbench-quick, builtin, ...)")
    parser.add_argument("--profile", default="flat", choices=sorted(PROFILES))
    parser.add_argument("--rows", default="plain,ngram,suffix")
    parser.add_argument("--bounds", default=str(SuffixConfig.max_corpus_tokens), help="corpus bounds, tokens")
    parser.add_argument("--skip", type=int, default=10, help="calls left out of the figures (corpus warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="a fixed draft length")
    parser.add_argument("--out", type=Path, default=None, help="write the per-call records here (JSON)")
    args = parser.parse_args(argv)
    if args.prompts is None and args.suite is None:
        args.prompts = Path(__file__).resolve().parents[2] / "configs" / "suites" / "json_sql.jsonl"
    return args


def rows(names: list[str], bounds: list[int], k: int | None) -> dict[str, dict[str, Any] | None]:
    """Row name -> generate's `speculative=` (None: plain); `k`: a fixed draft length."""
    fixed = {} if k is None else {"num_draft_tokens": k}
    out: dict[str, dict[str, Any] | None] = {}
    for name in names:
        if name == "plain":
            out[name] = None
        elif name == "suffix":
            for bound in bounds:
                options = {"max_corpus_tokens": bound}
                out[f"suffix@{bound}"] = {"method": "suffix", "options": options, **fixed}
        else:
            out[name] = {"method": name, **fixed}
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(hf_specdec.demo_model_path())
    profile = PROFILES[args.profile]
    prompts = load_prompt_file(args.prompts) if args.prompts else load_suite(args.suite)
    prompts = prompts[: args.limit]
    pad = pad_token_id(tokenizer, model)
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    eos = eos_token_ids(model)
    table = rows(args.rows.split(","), [int(b) for b in args.bounds.split(",")], args.num_draft_tokens)
    report: dict[str, Any] = {
        "settings": {**{k: str(v) for k, v in vars(args).items()}, "runtime": describe_runtime(model)},
        "calls": defaultdict(list),
    }
    inputs = [encode_prompts(tokenizer, [p], True, pad, model.device) for p in prompts]
    outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
    # Each suffix row drafts for a model object of its own, whose corpus only its calls fill; every
    # row carries its own verify costs from call to call, as generate would for it alone.
    targets = {name: copy.deepcopy(model) if _is_suffix(spec) else model for name, spec in table.items()}
    costs = {name: DeviceCosts() for name in table}
    shapes: dict[str, set[tuple[int, int]]] = {name: set() for name in table}
    warm = {**generation, "max_new_tokens": 8}  # first calls pay for allocations and lazy imports
    for name, spec in table.items():
        warm_spec = {} if spec is None else {"speculative": "ngram"}  # leaves the corpus empty
        targets[name].generate(**inputs[0], **warm, pad_token_id=pad, **warm_spec)
    names = list(table)
    for i, (prompt, encoded) in enumerate(zip(prompts, inputs)):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rows interleaved, order rotated
            spec, target = table[name], targets[name]
            if spec is not None and "num_draft_tokens" not in spec:  # the adaptive length, carried
                spec = {**spec, "policy": costs[name].policy(target)}
            kwargs = {} if spec is None else {"speculative": spec}
            with emulate(target, REAL if spec is None else profile, shapes[name]) as device:
                device.new_call()
                wall, host, start = _wall(), host_clock(), clock(target.device)
                out = target.generate(**encoded, **generation, pad_token_id=pad, **kwargs)
                seconds = clock(target.device) - start
                wall, host = _wall() - wall, host_clock() - host
            if spec is None:  # plain never reads the clock: priced from its forwards
                seconds = priced(wall, host, device.forwards, profile, shapes[name])
            outputs[name].append(out.sequences)
            record = _record(out, encoded, eos, seconds, prompt)
            if _is_suffix(spec):
                corpus, stats = suffix.corpus_for(target), out.speculative_stats
                record["corpus"] = dict(tokens=corpus.num_tokens, bytes=corpus.nbytes, gain=corpus.gain())
                drafted = stats.drafter_counters  # `SuffixDrafter.counters`
                record["corpus"].update(drafting=drafted["corpus_drafting"], drafts=drafted["corpus_drafts"])
                record["corpus"]["finish_seconds"] = stats.finish_seconds  # its replay and add
            report["calls"][name].append(record)
            print(f"{name} [{i + 1}/{len(prompts)}] {_line(record)}", file=sys.stderr, flush=True)
    report["calls"] = dict(report["calls"])
    report["bytes_per_token"] = bytes_per_token(model.config.vocab_size)
    _check_lossless(model, inputs, outputs, report["calls"], {**generation, "pad_token_id": pad})
    return report


def _check_lossless(
    model: Any,
    inputs: list[dict[str, torch.Tensor]],
    outputs: dict[str, list[torch.Tensor]],
    calls: dict[str, list[dict[str, Any]]],
    generation: dict[str, Any],
) -> None:
    """Each call's output against plain greedy's (`hf_specdec.lossless`): where the plain row did not
    run, plain runs (untimed) for the calls whose rows' outputs differ; rows that all agree are
    marked `agree`, not checked one by one."""
    for i, encoded in enumerate(inputs):
        plain = outputs["plain"][i] if "plain" in outputs else None
        if plain is None:
            if len({tuple(rows[i][0].tolist()) for rows in outputs.values()}) == 1:
                for name in outputs:
                    calls[name][i]["lossless"] = "agree"
                continue
            plain = model.generate(**encoded, **{**generation, "return_dict_in_generate": False})
        for name, rows in outputs.items():
            if name != "plain":
                check = check_greedy(model, encoded["input_ids"], plain, rows[i], encoded["attention_mask"])
                calls[name][i]["lossless"] = check[0].kind


def _is_suffix(spec: dict[str, Any] | None) -> bool:
    return spec is not None and spec["method"] == "suffix"


def _record(out: Any, inputs: dict[str, torch.Tensor], eos: set[int], seconds: float, prompt: Any) -> dict:
    new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    stats = getattr(out, "speculative_stats", None)
    return {
        "id": prompt.id,
        "category": prompt.category,
        "new_tokens": stop,
        "forwards": stats.target_forwards if stats is not None else stop,  # plain: one a token
        "seconds": seconds,
        "draft_seconds": stats.draft_seconds if stats is not None else 0.0,
    }


def _line(record: dict[str, Any]) -> str:
    corpus = record.get("corpus")
    held = (
        f" corpus {corpus['tokens']} tokens {corpus['bytes']} B gain {corpus['gain']} drafted "
        f"{corpus['drafts']} finish {corpus['finish_seconds'] * 1e3:.1f} ms"
        if corpus
        else ""
    )
    return (
        f"{record['category']} {record['new_tokens']} tokens / {record['forwards']} forwards, "
        f"{record['seconds']:.2f} s {record.get('lossless', '')}{held}"
    )


def summarize(report: dict[str, Any], skip: int) -> str:
    """Markdown tables: per category and overall, after the first `skip` calls."""
    calls = report["calls"]
    names = list(calls)
    categories = sorted({c["category"] for c in calls[names[0]]})
    lines = [
        "| row | calls | tokens / forward | vs ngram | tokens / s | vs ngram | ties | mismatches |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def totals(name: str, category: str | None) -> tuple[int, float, float, int, int]:
        kept = [c for c in calls[name][skip:] if category is None or c["category"] == category]
        tokens = sum(c["new_tokens"] for c in kept)
        forwards = sum(c["forwards"] for c in kept)
        seconds = sum(c["seconds"] for c in kept)
        kinds = [c.get("lossless") for c in kept]
        per_forward = tokens_per_verify_forward(tokens, forwards, len(kept))
        return len(kept), per_forward, tokens / seconds, kinds.count("tie"), kinds.count("mismatch")

    for category in [None, *categories]:
        base = totals("ngram", category) if "ngram" in calls else None
        for name in names:
            n, per_forward, speed, ties, mismatches = totals(name, category)
            vs = (f"{per_forward / base[1]:.2f}x", f"{speed / base[2]:.2f}x") if base else ("", "")
            label = f"{name} ({category})" if category else f"**{name}**"
            cells = [label, n, f"{per_forward:.2f}", vs[0], f"{speed:.1f}", vs[1], ties, mismatches]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    for name in names:
        held = [c["corpus"] for c in calls[name] if "corpus" in c]
        if not held:
            continue
        bound, top = int(name.split("@")[1]), max(held, key=lambda c: c["bytes"])
        finish, seconds = sum(c["finish_seconds"] for c in held), sum(c["seconds"] for c in calls[name])
        lines += [
            f"\n{name}: at most {max(c['tokens'] for c in held)} tokens held (bound {bound}), "
            f"{top['bytes']} bytes at most (the bound x {report['bytes_per_token']} B a token = "
            f"{bound * report['bytes_per_token']} B, plus 20 B a sequence); gain after the last call "
            f"{held[-1]['gain']}",
            f"{name}: the corpus drafted in {sum(c['drafting'] for c in held)} of {len(held)} calls "
            f"({sum(c['drafts'] for c in held)} drafts); its end-of-call work (replay and add) took "
            f"{finish * 1e3 / len(held):.1f} ms a call on the host clock, {finish / seconds:.2%} of the "
            "calls' time",
        ]
    draft = {n: statistics.mean(c["draft_seconds"] / max(c["forwards"], 1) for c in calls[n]) for n in names}
    per_forward = ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in draft.items())
    lines.append(f"\ndrafter host time per target forward: {per_forward}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = measure(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(summarize(report, args.skip))


if __name__ == "__main__":
    main()
