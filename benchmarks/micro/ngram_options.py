"""n-gram settings side by side with transformers' prompt lookup, batch 1, greedy (issue 12 study).

    python benchmarks/micro/ngram_options.py [--dtype auto|float32] [--limit 2] [--max-new-tokens 96]

Spec-Bench quick, SmolLM2-135M-Instruct: plain `generate`, our `ngram` as shipped (min_ngram 2),
the same as a tree, with `min_ngram=1` (single-token matches too, as transformers' lookup falls
back to) as a chain and as a tree, and transformers' `prompt_lookup_num_tokens=10`; rows
interleaved prompt by prompt with the order rotated. Prints total tokens / total time over plain,
the geometric mean over categories of the per-category median speedup, and each category's.
"""

from __future__ import annotations

import argparse
import math
import statistics

import hf_specdec  # noqa: F401  (adds speculative= to generate)
from hf_specdec.bench.suites import load_suite, take_per_category
from hf_specdec.core.timing import clock
from hf_specdec.loading import (
    describe_runtime,
    encode_prompts,
    load_model,
    pad_token_id,
    runtime_line,
    use_chat_template,
)

ROWS = {
    "plain": {},
    "ngram": {"speculative": "ngram"},
    "ngram+tree": {"speculative": {"method": "ngram", "tree": True}},
    "ngram min_ngram=1": {"speculative": {"method": "ngram", "options": {"min_ngram": 1}}},
    "ngram+tree min_ngram=1": {"speculative": {"method": "ngram", "tree": True, "options": {"min_ngram": 1}}},
    "transformers prompt lookup": {"prompt_lookup_num_tokens": 10},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--limit", type=int, default=2, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    model, tokenizer = load_model(None, dtype=args.dtype)
    print(f"# {runtime_line(describe_runtime(model))}")
    prompts = take_per_category(load_suite("specbench-quick"), args.limit)
    pad, chat = pad_token_id(tokenizer, model), use_chat_template(tokenizer)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    model.generate(**encode_prompts(tokenizer, ["Hi"], chat, pad, model.device), max_new_tokens=4)  # warm-up
    totals = {row: [0, 0.0] for row in ROWS}
    per_category: dict[str, dict[str, list[float]]] = {}
    names = list(ROWS)
    for i, prompt in enumerate(prompts):
        inputs = encode_prompts(tokenizer, [prompt], chat, pad, model.device)
        for row in names[i % len(names) :] + names[: i % len(names)]:
            start = clock(model.device)
            out = model.generate(**inputs, **settings, **ROWS[row])
            seconds = clock(model.device) - start
            tokens = out.shape[1] - inputs["input_ids"].shape[1]
            totals[row][0] += tokens
            totals[row][1] += seconds
            per_category.setdefault(prompt.category, {}).setdefault(row, []).append(tokens / seconds)
    plain = totals["plain"][0] / totals["plain"][1]
    print("| row | total tokens / total time vs plain | geometric mean over categories |")
    print("|---|---|---|")
    for row in ROWS:
        ratios = [statistics.median(c[row]) / statistics.median(c["plain"]) for c in per_category.values()]
        geomean = math.exp(statistics.mean(math.log(r) for r in ratios))
        print(f"| {row} | {totals[row][0] / totals[row][1] / plain:.2f}x | {geomean:.2f}x |")
    for category, rows in per_category.items():
        cells = ", ".join(
            f"{row} {statistics.median(v) / statistics.median(rows['plain']):.2f}x" for row, v in rows.items()
        )
        print(f"- {category}: {cells}")


if __name__ == "__main__":
    main()
