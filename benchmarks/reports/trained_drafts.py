"""Trained drafts side by side under emulated device regimes: an EAGLE head, an MTP head, a DFlash
block draft and n-grams, per Spec-Bench category (BENCHMARKS_HEADS.md, "Trained drafts").

    bash benchmarks/reports/trained_drafts.sh        # trains the three on the same text, then runs this
    python benchmarks/reports/trained_drafts.py --head eagle=DIR --head mtp=DIR --head dflash=DIR
        [--methods eagle,mtp,dflash,dflash:7,ngram] [--profiles flat,real] [--suite specbench-quick]
        [--categories qa,mt_bench,...] [--limit 3] [--max-new-tokens 128]
        [--out bench_out/trained_drafts.json] [--markdown bench_out/trained_drafts.md]

Each head's `training.json` (steps, seconds, held-out τ) is summarised first.

SmolLM2-135M computes every token for real (acceptance is real); the clock follows the cost profile
(`hf_specdec.bench.regimes`: `flat` a memory-bound GPU at batch 1, each extra token +1% of a 20 ms
step; drafting and the loop count at this machine's CPU time of the calling thread, so other processes
do not move it; `real` is this machine's wall clock). Per prompt, in rotated order: plain `generate`
(run once, priced under every profile from its recorded forwards) and each method with the adaptive
policy (run under each profile, each carrying what verifying cost from its own earlier calls, as
`generate` does per device), or with a fixed draft length (`dflash:7`). Reported per category:
tokens per second and the ratio to plain, τ (1 + accepted / steps that verified a draft), tokens
per target forward (`tokens_per_verify_forward`) and how many outputs equal plain greedy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hf_specdec.bench.regimes import PROFILES, REAL, priced, timed_generate
from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.runner import _new_tokens, _select_prompts
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

PLAIN = "plain"


def run_once(model: Any, inputs: dict, generation: dict, speculative: dict | None, profile, shapes) -> tuple:
    """One `generate` call under `profile` (`timed_generate`), plain where `speculative` is None."""
    extra = {} if speculative is None else {"speculative": speculative}
    return timed_generate(model, profile, shapes, **inputs, **generation, **extra)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    profiles = [PROFILES[name] for name in args.profiles.split(",")]
    profiles = [p.with_step(args.step_ms / 1000) if p.emulated else p for p in profiles]
    categories = args.categories.split(",") if args.categories else None
    prompts = _select_prompts(args.suite, None, None, args.limit, categories)
    chat = use_chat_template(tokenizer, None)
    pad = pad_token_id(tokenizer, model)
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    generation["pad_token_id"] = pad
    eos = eos_token_ids(model)
    heads = dict(h.split("=", 1) for h in args.head)
    methods = args.methods.split(",")
    specs = {}
    for row in methods:  # "dflash" (the adaptive policy) or "dflash:7" (7 draft tokens every step)
        name, _, k = row.partition(":")
        specs[row] = {"method": name, **({"draft": heads[name]} if name in heads else {})}
        if k:
            specs[row]["num_draft_tokens"] = int(k)
    shapes: dict[tuple[str, str], set] = defaultdict(set)
    costs: dict[tuple[str, str], DeviceCosts] = defaultdict(DeviceCosts)
    report: dict[str, Any] = {"settings": {**vars(args), "runtime": describe_runtime(model)}, "prompts": []}
    report["training"] = [training_summary(m, Path(folder)) for m, folder in heads.items()]

    def speculative(profile: Any, row: str) -> dict:
        if "num_draft_tokens" in specs[row]:
            return specs[row]
        return {**specs[row], "policy": costs[(profile.name, row)].policy(model)}

    warm = encode_prompts(tokenizer, prompts[:1], chat, pad, model.device)
    for method in methods:  # first calls pay for allocations, lazy imports and loading the drafts
        run_once(model, warm, {**generation, "max_new_tokens": 8}, speculative(REAL, method), REAL, set())
    rows = [PLAIN, *methods]
    for i, prompt in enumerate(prompts):
        inputs = encode_prompts(tokenizer, [prompt], chat, pad, model.device)
        order = rows[i % len(rows) :] + rows[: i % len(rows)]
        entry: dict[str, Any] = {"id": prompt.id, "category": prompt.category, "rows": defaultdict(dict)}
        outputs = {}
        for row in order:
            if row == PLAIN:  # its decisions never read the clock: priced under every profile
                _, wall, host, forwards, out = run_once(model, inputs, generation, None, REAL, set())
                outputs[row] = out.sequences
                for p in profiles:
                    seconds = priced(wall, host, forwards, p, shapes[(p.name, row)])
                    entry["rows"][p.name][row] = _record(out, forwards, inputs, eos, seconds)
                continue
            for p in profiles:
                seconds, _, _, forwards, out = run_once(
                    model, inputs, generation, speculative(p, row), p, shapes[(p.name, row)]
                )
                outputs.setdefault(row, out.sequences)
                entry["rows"][p.name][row] = _record(out, forwards, inputs, eos, seconds)
        for row in methods:
            checks = check_greedy(
                model, inputs["input_ids"], outputs[PLAIN], outputs[row], inputs["attention_mask"]
            )
            entry.setdefault("lossless", {})[row] = [c.kind for c in checks]
        report["prompts"].append(entry)
        print(f"[{i + 1}/{len(prompts)}] {prompt.category} {prompt.id}", file=sys.stderr, flush=True)
    return report


def _record(out: Any, forwards: list, inputs: dict, eos: set[int], seconds: float) -> dict[str, Any]:
    stats = getattr(out, "speculative_stats", None)
    record = {
        "new_tokens": sum(len(t) for t in _new_tokens(out.sequences, inputs, eos)),
        "seconds": seconds,
        "target_forwards": len(forwards),
    }
    if stats is not None:
        record["stats"] = stats.to_dict()
    return record


def training_summary(method: str, folder: Path) -> str:
    """A line on how a head was trained, from its `training.json` (none for a published draft)."""
    path = folder / "training.json"
    if not path.is_file():
        return f"- {method}: {folder} (no training log)"
    log = json.loads(path.read_text())
    last = log["history"][-1] if log["history"] else {"tau": "-", "acceptance": []}
    acceptance = ", ".join(f"{a:.0%}" for a in last["acceptance"])
    return (
        f"- {method}: {log['steps']} steps in {log['train_seconds']} s on {log['train_sequences']} "
        f"sequences, held-out τ ≈ {last['tau']} (acceptance by position {acceptance})"
    )


def summarize(report: dict[str, Any]) -> str:
    settings = report["settings"]
    methods = settings["methods"].split(",")
    lines = [*report.get("training", []), ""]
    for profile in settings["profiles"].split(","):
        lines += [
            f"### {profile}",
            "",
            "| category | "
            + " | ".join(f"{m} speedup | {m} τ | {m} tok/fwd" for m in methods)
            + " | plain tok/s |",
            "|---|" + "---:|" * (3 * len(methods) + 1),
        ]
        by_category: dict[str, list] = defaultdict(list)
        for entry in report["prompts"]:
            by_category[entry["category"]].append(entry)
        for category, entries in [*by_category.items(), ("all", report["prompts"])]:
            cells = []
            plain = _speed([e["rows"][profile][PLAIN] for e in entries])
            for m in methods:
                records = [e["rows"][profile][m] for e in entries]
                stats = [r["stats"] for r in records]
                steps = sum(s["speculative_steps"] for s in stats)
                tau = 1 + sum(s["accepted"] for s in stats) / steps if steps else 1.0
                tokens, forwards = (sum(r[key] for r in records) for key in ("new_tokens", "target_forwards"))
                per_forward = tokens_per_verify_forward(tokens, forwards, len(records))
                cells.append(f"{_speed(records) / plain:.2f}x | {tau:.2f} | {per_forward:.2f}")
            name = f"**{category}**" if category == "all" else category
            lines.append(f"| {name} ({len(entries)}) | " + " | ".join(cells) + f" | {plain:.1f} |")
        lines.append("")
    identical = {
        m: sum(all(k != MISMATCH for k in e["lossless"][m]) for e in report["prompts"]) for m in methods
    }
    lines.append(
        "Outputs without a greedy mismatch (equal to plain, or leaving it at a bf16 rounding tie): "
        + ", ".join(f"{m} {n}/{len(report['prompts'])}" for m, n in identical.items())
        + "."
    )
    return "\n".join(lines) + "\n"


def _speed(records: list[dict[str, Any]]) -> float:
    return sum(r["new_tokens"] for r in records) / sum(r["seconds"] for r in records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--head", action="append", default=[], help="METHOD=FOLDER, e.g. dflash=runs/dflash")
    parser.add_argument("--methods", default="eagle,mtp,dflash,ngram")
    parser.add_argument("--profiles", default="flat,real")
    parser.add_argument("--step-ms", type=float, default=20.0, help="an emulated plain step (default 20 ms)")
    parser.add_argument("--suite", default="specbench-quick")
    parser.add_argument("--categories", default="", help="comma-separated (default: every category)")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="bench_out/trained_drafts.json")
    parser.add_argument("--markdown", default="bench_out/trained_drafts.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    text = summarize(report)
    Path(args.markdown).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
