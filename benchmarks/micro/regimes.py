"""The draft-length policy held against fixed draft lengths in emulated device regimes.

    python benchmarks/micro/regimes.py [--profiles flat,flat+oneoff,linear,real] [--suite specbench-quick]
        [--limit 3] [--max-new-tokens 64] [--batch-size 1] [--ks 2,4,6,8,10,12,16] [--repeats 1]
        [--out bench_out/regimes.json] [--markdown bench_out/regimes.md]

SmolLM2-135M computes every token for real (acceptance is real) while the clock follows a cost
profile (`hf_specdec.bench.regimes`: flat, flat+oneoff, gpu-batch, linear; `real` is this machine).
Rows, per prompt: plain `generate`, transformers' prompt lookup (its default 10 tokens; batch 1
only), ours with the adaptive policy (`auto`, chain and tree) and ours with every fixed k of
`--ks` (chain and tree). Rows whose decisions never read the clock (plain, prompt lookup, fixed k)
run once per round and are priced under every profile from their recorded forwards; the adaptive
rows run once per profile per round, each starting from what verifying cost in its earlier calls
under the same profile, as `generate` carries it (`CostModel.carry`). Each prompt's best fixed k in
hindsight is the oracle the policy is held against. Rounds interleave every row; `--repeats` keeps
each row's median time per generated token (each run's own: texts can differ from a rounding tie
on); the other figures (forwards, widths, the text checked against plain) are the first run's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hf_specdec.bench.regimes import PROFILES, REAL, priced, timed_generate
from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.runner import PROMPT_LOOKUP_TOKENS, _new_tokens, _select_prompts
from hf_specdec.core.policy import DeviceCosts
from hf_specdec.loading import (
    describe_runtime,
    encode_prompts,
    eos_token_ids,
    load_model,
    pad_token_id,
    use_chat_template,
)
from hf_specdec.lossless import MISMATCH, check_greedy

PLAIN, LOOKUP = "plain", "prompt_lookup"


def rows(
    ks: list[int], options: dict[str, Any], batch_size: int, trees: str = "all"
) -> dict[str, tuple[dict[str, Any], bool]]:
    """Row name -> (generate's extra keywords, whether its decisions read the clock). `trees`: tree
    rows for auto and every fixed k ("all"), for auto alone ("auto"), or none."""
    out: dict[str, tuple[dict[str, Any], bool]] = {PLAIN: ({}, False)}
    if batch_size == 1:
        out[LOOKUP] = ({"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}, False)
    for tree in (False, True):
        if tree and trees == "none":
            continue
        suffix = "+tree" if tree else ""
        spec = {"method": "ngram", "options": options, "tree": tree}
        out["auto" + suffix] = ({"speculative": {**spec, "num_draft_tokens": "auto"}}, True)
        for k in ks if not tree or trees == "all" else ():
            out[f"k{k}{suffix}"] = ({"speculative": {**spec, "num_draft_tokens": k}}, False)
    return out


def run_once(model: Any, inputs: dict, generation: dict[str, Any], kwargs: dict, profile, shapes=None):
    """One `generate` call under `profile` (`timed_generate`)."""
    return timed_generate(model, profile, shapes, **inputs, **generation, **kwargs)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    profiles = [PROFILES[name] for name in args.profiles]
    profiles = [p.with_step(args.step_ms / 1000) if p.emulated else p for p in profiles]
    prompts = _select_prompts(args.suite, None, None, args.limit, args.categories)
    chat = use_chat_template(tokenizer, None)
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    generation["pad_token_id"] = pad_token_id(tokenizer, model)
    eos = eos_token_ids(model)
    table = rows(args.ks, json.loads(args.options), args.batch_size, args.trees)
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    report: dict[str, Any] = {
        "settings": {**vars(args), "runtime": describe_runtime(model)},
        "profiles": {p.name: {**p.__dict__} for p in profiles},
        "prompts": [],
    }
    # The shapes each emulated device has paid its one-off cost for, per row: each row runs as a
    # process of its own, so none pays for the shapes another row's calls fed first.
    shapes: dict[tuple[str, str], set[tuple[int, int]]] = defaultdict(set)  # (profile, row)
    device_costs: dict[tuple[str, str], DeviceCosts] = defaultdict(DeviceCosts)  # (profile, row)

    def encode(batch: list) -> dict[str, torch.Tensor]:
        return encode_prompts(tokenizer, batch, chat, generation["pad_token_id"], model.device)

    warm = encode(batches[0])
    for name, (kwargs, _) in table.items():  # first calls pay for allocations and lazy imports
        _, _, _, forwards, _ = run_once(model, warm, {**generation, "max_new_tokens": 8}, kwargs, REAL)
        for p in profiles:
            priced(0.0, 0.0, forwards, p, shapes[(p.name, name)])

    for i, batch in enumerate(batches):
        inputs = encode(batch)
        names = list(table)
        order = names[i % len(names) :] + names[: i % len(names)]
        times: dict[tuple[str, str], list[float]] = defaultdict(list)
        first: dict[tuple[str, str], dict[str, Any]] = {}

        def note(
            profile: str,
            name: str,
            seconds: float,
            out: Any,
            forwards: list,
            times=times,
            first=first,
            inputs=inputs,
        ) -> None:
            # Per token of this run's own text: an adaptive row's text can leave another run's at a
            # rounding tie (bf16), so runs of one row may generate different numbers of tokens.
            tokens = sum(len(t) for t in _new_tokens(out.sequences, inputs, eos))
            times[(profile, name)].append(seconds / max(tokens, 1))
            if (profile, name) not in first:
                first[(profile, name)] = _record(out, forwards, inputs, eos)

        for _ in range(args.repeats):
            for name in order:
                kwargs, adaptive = table[name]
                if adaptive:  # its decisions read the clock: run under each profile
                    for p in profiles:
                        # What verifying costs is carried from call to call, as generate does, but
                        # per emulated device (generate's own store would mix the profiles).
                        carried = {"policy": device_costs[(p.name, name)].policy(model)}
                        spec = {"speculative": {**kwargs["speculative"], **carried}}
                        seconds, _, _, forwards, out = run_once(
                            model, inputs, generation, spec, p, shapes[(p.name, name)]
                        )
                        note(p.name, name, seconds, out, forwards)
                else:  # run once, priced under each profile
                    _, wall, host, forwards, out = run_once(model, inputs, generation, kwargs, REAL)
                    for p in profiles:
                        seconds = priced(wall, host, forwards, p, shapes[(p.name, name)])
                        note(p.name, name, seconds, out, forwards)
        plain_out = first[(profiles[0].name, PLAIN)]["sequences"]
        entry = {"ids": [p.id for p in batch], "category": batch[0].category, "rows": {}}
        for (profile_name, name), record in first.items():
            record = dict(record)
            sequences = record.pop("sequences")
            record["seconds"] = statistics.median(times[(profile_name, name)]) * record["new_tokens"]
            if name != PLAIN:
                checks = check_greedy(
                    model, inputs["input_ids"], plain_out, sequences, inputs["attention_mask"]
                )
                record["lossless"] = [c.kind for c in checks]
            entry["rows"].setdefault(profile_name, {})[name] = record
        report["prompts"].append(entry)
        print(f"[{i + 1}/{len(batches)}] {entry['category']} {entry['ids']}", file=sys.stderr, flush=True)
    return report


def _record(out: Any, forwards: list, inputs: dict[str, torch.Tensor], eos: set[int]) -> dict[str, Any]:
    stats = getattr(out, "speculative_stats", None)
    record: dict[str, Any] = {
        "sequences": out.sequences,
        "new_tokens": sum(len(t) for t in _new_tokens(out.sequences, inputs, eos)),
        "forwards": len(forwards),
        "widths": [f.width for f in forwards],
    }
    if stats is not None:
        record["stats"] = stats.to_dict()
        record["draft_lengths"] = list(stats.draft_lengths)
    return record


# --- the report ------------------------------------------------------------------------------


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _speed(record: dict[str, Any]) -> float:
    return record["new_tokens"] / record["seconds"]


def summarize(report: dict[str, Any]) -> str:
    ks = report["settings"]["ks"]
    lines = [
        "# Draft-length policy in emulated device regimes",
        "",
        f"Command: `{report['settings']['command']}`",
        "",
        f"Runtime: {json.dumps(report['settings']['runtime'])}",
        "",
    ]
    for name, profile in report["profiles"].items():
        lines += [
            f"## {name}",
            "",
            profile["description"] + (f"; step {profile['step'] * 1000:g} ms" if name != "real" else ""),
            "",
        ]
        lines += _profile_table(report, name, ks)
    return "\n".join(lines) + "\n"


def _profile_table(report: dict[str, Any], profile: str, ks: list[int]) -> list[str]:
    by_category: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in report["prompts"]:
        by_category[entry["category"]].append(entry["rows"][profile])
    every = [r for rs in by_category.values() for r in rs]
    have_lookup = any(LOOKUP in r for r in every)
    auto_tree = any("auto+tree" in r for r in every)  # `--trees`: which tree rows were run
    k_trees = any(f"k{ks[0]}+tree" in r for r in every)
    head = ["category", "n", "plain tok/s", "auto"] + (["auto+tree"] if auto_tree else [])
    head += [LOOKUP, "auto/PL"] if have_lookup else []
    head += ["oracle k (chain)", "auto/oracle"]
    head += ["oracle (tree)", "auto+tree/oracle"] if auto_tree and k_trees else []
    head += ["auto tok/fwd", "k10 tok/fwd"] + (["PL tok/fwd"] if have_lookup else [])
    head += ["auto spec steps", "auto mean k", "mismatches"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    columns: dict[str, list[float]] = defaultdict(list)
    for category, entries in list(by_category.items()) + [("all", sum(by_category.values(), []))]:
        ratio = defaultdict(list)
        best_k_chain, best_k_tree = [], []
        for rows in entries:
            plain = _speed(rows[PLAIN])
            for name, record in rows.items():
                ratio[name].append(_speed(record) / plain)
            chain = max(ks, key=lambda k: _speed(rows[f"k{k}"]))
            best_k_chain.append(chain)
            ratio["oracle"].append(_speed(rows[f"k{chain}"]) / plain)
            ratio["auto/oracle"].append(_speed(rows["auto"]) / _speed(rows[f"k{chain}"]))
            if have_lookup:
                ratio["auto/PL"].append(_speed(rows["auto"]) / _speed(rows[LOOKUP]))
            if auto_tree and k_trees:
                tree = max(ks, key=lambda k: _speed(rows[f"k{k}+tree"]))
                best_k_tree.append(tree)
                ratio["oracle+tree"].append(_speed(rows[f"k{tree}+tree"]) / plain)
                ratio["auto+tree/oracle"].append(_speed(rows["auto+tree"]) / _speed(rows[f"k{tree}+tree"]))

        def g(name: str, ratio=ratio, category=category) -> str:
            value = _geomean(ratio[name])
            if category != "all":
                columns[name].append(value)
            else:  # the geometric mean over categories, as the other benchmarks report it
                value = _geomean(columns[name])
            return f"{value:.2f}x"

        def per_forward(name: str, entries=entries) -> str:
            tokens = sum(r[name]["new_tokens"] for r in entries)
            forwards = sum(r[name]["forwards"] for r in entries)
            return f"{tokens_per_verify_forward(tokens, forwards, len(entries)):.2f}"

        autos = [r["auto"]["stats"] for r in entries]
        spec = sum(s["speculative_steps"] for s in autos) / max(sum(s["steps"] for s in autos), 1)
        lengths = [k for r in entries for k in r["auto"]["draft_lengths"] if k > 0]
        mismatches = sum(
            kind == MISMATCH for r in entries for rec in r.values() for kind in rec.get("lossless", [])
        )
        plain_speed = statistics.median(_speed(r[PLAIN]) for r in entries)
        cells = [category, str(len(entries)), f"{plain_speed:.1f}", g("auto")]
        cells += [g("auto+tree")] if auto_tree else []
        cells += [g(LOOKUP), g("auto/PL")] if have_lookup else []
        cells += [f"{g('oracle')} (k {statistics.median(best_k_chain):g})", g("auto/oracle")]
        if auto_tree and k_trees:
            cells += [f"{g('oracle+tree')} (k {statistics.median(best_k_tree):g})", g("auto+tree/oracle")]
        cells += [per_forward("auto"), per_forward("k10") if 10 in ks else "–"]
        cells += [per_forward(LOOKUP)] if have_lookup else []
        cells += [f"{spec:.0%}", f"{statistics.mean(lengths):.1f}" if lengths else "–", str(mismatches)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    suffixes = ("", "+tree") if k_trees else ("",)
    names = [f"k{k}{suffix}" for suffix in suffixes for k in ks]
    sweep = ["| category | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    for category, entries in by_category.items():
        cells = [category]
        for name in names:
            cells.append(f"{_geomean([_speed(r[name]) / _speed(r[PLAIN]) for r in entries]):.2f}x")
        sweep.append("| " + " | ".join(cells) + " |")
    return lines + ["Fixed k, speedup over plain:", ""] + sweep + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profiles", default="flat,flat+oneoff,linear,real")
    parser.add_argument("--step-ms", type=float, default=20.0, help="an emulated plain step (default 20 ms)")
    parser.add_argument("--suite", default="specbench-quick")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--categories", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--ks", default="2,4,6,8,10,12,16")
    parser.add_argument("--options", default="{}", help="ngram options as JSON, e.g. '{\"min_ngram\": 1}'")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--trees", choices=["all", "auto", "none"], default="all", help="tree rows: every one, auto's, none"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: 1 unless the real profile is measured, whose clock is the machine's: "
        "emulated clocks count host CPU time, and one thread cannot be slowed by other processes' spinning)",
    )
    parser.add_argument("--out", default="bench_out/regimes.json")
    parser.add_argument("--markdown", default="bench_out/regimes.md")
    args = parser.parse_args(argv)
    args.profiles = [p for p in args.profiles.split(",") if p]
    unknown = sorted(set(args.profiles) - set(PROFILES))
    if unknown:
        parser.error(f"unknown profile(s) {unknown}; valid: {sorted(PROFILES)}")
    args.ks = [int(k) for k in args.ks.split(",")]
    args.categories = args.categories.split(",") if args.categories else None
    if args.threads or "real" not in args.profiles:
        torch.set_num_threads(args.threads or 1)
    args.command = "python benchmarks/micro/regimes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    markdown = summarize(report)
    Path(args.markdown).write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
