"""Batched speculative decoding against plain batched generate on SmolLM2-135M (greedy; the checkpoint's
dtype, bf16, unless --dtype says otherwise; fp32 on a CPU without native bf16).

    python benchmarks/micro/batching.py                      # full table (about 15 minutes on 2 cores)
    python benchmarks/micro/batching.py --batch-sizes 1,8 --repeats 1 --max-new-tokens 32   # quick look
    python benchmarks/micro/batching.py --batch-sizes none --num-draft-tokens auto,1,2,4  # grounded batch 8

Rows: the n-gram drafter and a draft model (a bf16 copy of the target: the only smaller-cost
same-tokenizer draft available offline, since SmolLM2-135M is the smallest of its family), on
input-grounded prompts (Spec-Bench summarization + rag) and open prompts (qa, writing,
math_reasoning). Plain and speculative runs alternate on the same batch (plain, spec, spec, plain
per repeat) so that drift in machine load cancels out of each ratio. Prints a markdown table and
writes JSON with every figure, including the adaptive policy's draft-length choices.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, load_model, runtime_line

SPECBENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "specbench" / "question.jsonl"
GROUNDED = ("summarization", "rag")
OPEN = ("qa", "writing", "math_reasoning")


def load_prompts(categories: tuple[str, ...], count: int, max_chars: int = 1500) -> list[str]:
    items = [json.loads(line) for line in SPECBENCH.read_text().splitlines()]
    picked = [it for it in items if it["category"] in categories]
    # Round-robin over categories so every batch mixes them.
    by_cat = {c: [it["turns"][0][-max_chars:] for it in picked if it["category"] == c] for c in categories}
    out: list[str] = []
    i = 0
    while len(out) < count:
        for c in categories:
            if i < len(by_cat[c]) and len(out) < count:
                out.append(by_cat[c][i])
        i += 1
    return out


def encode(tokenizer, prompts: list[str]):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def run_case(model, inputs, speculative, max_new_tokens: int, repeats: int) -> dict:
    plain_times, spec_times = [], []
    plain = spec = None
    for _ in range(repeats):
        for kind in ("plain", "spec", "spec", "plain"):
            start = clock(model.device)
            if kind == "plain":
                plain = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
                plain_times.append(clock(model.device) - start)
            else:
                spec = model.generate(
                    **inputs,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    speculative=speculative,
                    return_dict_in_generate=True,
                )
                spec_times.append(clock(model.device) - start)
    pad = model.generation_config.pad_token_id
    prompt_len = inputs["input_ids"].shape[1]
    plain_new = int((plain[:, prompt_len:] != pad).sum())
    spec_new = int((spec.sequences[:, prompt_len:] != pad).sum())
    stats = spec.speculative_stats
    t_plain, t_spec = statistics.median(plain_times), statistics.median(spec_times)
    choices = Counter(stats.draft_lengths)
    return {
        "plain_tokens_per_s": plain_new / t_plain,
        "spec_tokens_per_s": spec_new / t_spec,
        "speedup": (spec_new / t_spec) / (plain_new / t_plain),
        "identical": bool(torch.equal(plain, spec.sequences)),
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "mean_accepted_length_speculative": stats.mean_accepted_length_speculative,
        "speculative_steps": stats.speculative_steps,
        "plain_steps": stats.plain_steps,
        "draft_length_choices": dict(sorted(choices.items())),
        "mean_draft_length_chosen": sum(k * n for k, n in choices.items()) / max(1, sum(choices.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--methods", default="ngram,draft_model")
    parser.add_argument(
        "--num-draft-tokens",
        default="auto",
        help="comma-separated draft lengths to compare: 'auto' (the adaptive policy) and/or fixed integers",
    )
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16, float32")
    parser.add_argument("--tree", action="store_true", help="also time ngram drafting trees (ngram+tree)")
    parser.add_argument("--out", default="bench_out/batching.json")
    args = parser.parse_args()
    if not SPECBENCH.exists():
        raise SystemExit(f"Spec-Bench prompts not found at {SPECBENCH}")

    path = hf_specdec.demo_model_path()
    model, _ = load_model(path, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    print(f"# {runtime_line(describe_runtime(model))}")
    sources = {
        "ngram": {"method": "ngram"},
        "ngram+tree": {"method": "ngram", "tree": True},
        "draft_model": {"method": "draft_model", "draft": draft, "draft_tokenizer": tokenizer},
    }
    if args.tree and "ngram+tree" not in args.methods:
        args.methods += ",ngram+tree"
    methods = {}
    for name in args.methods.split(","):
        for k in args.num_draft_tokens.split(","):
            label = name if k == "auto" else f"{name} k={k}"
            methods[label] = {**sources[name], "num_draft_tokens": k if k == "auto" else int(k)}
    sizes = [] if args.batch_sizes == "none" else [int(s) for s in args.batch_sizes.split(",")]
    cases = [("grounded", 8)] + [("open", b) for b in sizes]
    model.generate(**encode(tokenizer, ["Hi"]), max_new_tokens=4)  # warm-up

    results = []
    print(
        "| prompts | batch | method | plain tok/s | spec tok/s | speedup | acceptance | τ | "
        "spec/plain steps | mean k chosen | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, batch in cases:
        prompts = load_prompts(GROUNDED if kind == "grounded" else OPEN, batch)
        inputs = encode(tokenizer, prompts)
        for name in methods:
            r = run_case(model, inputs, methods[name], args.max_new_tokens, args.repeats)
            r.update(prompts=kind, batch=batch, method=name)
            results.append(r)
            print(
                f"| {kind} | {batch} | {name} | {r['plain_tokens_per_s']:.1f} | "
                f"{r['spec_tokens_per_s']:.1f} | "
                f"{r['speedup']:.2f}x | {r['acceptance_rate']:.0%} | "
                f"{r['mean_accepted_length_speculative']:.2f} | "
                f"{r['speculative_steps']}/{r['plain_steps']} | {r['mean_draft_length_chosen']:.1f} | "
                f"{'yes' if r['identical'] else 'no'} |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
