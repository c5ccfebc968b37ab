"""What a batched call costs on this machine, and the speedup ceiling that follows.

    python benchmarks/micro/batch_costs.py   # grounded batch 8 (as in batching.py)
    python benchmarks/micro/batch_costs.py --kind open --batch 1

For one batch of Spec-Bench prompts (SmolLM2-135M in the checkpoint's dtype unless --dtype): the
prefill time, and the time of one target forward over the cached prompt at each width (tokens per
row: 1 = a plain step, k + 1 = a verify of k draft tokens), interleaved over rounds, medians. From
these it prints how much faster the decoding part would have to get for the whole call to reach a
given speedup, and the mean accepted tokens per row and step (τ) a draft of each width would need
to break even and to reach it. The first round's forwards are the process's first at each width:
beside the medians it prints what each cost over the later rounds' median (a device's one-off per
new shape, which the draft-length policy learns where it is over twice a step: `CostModel.first_calls`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from batching import GROUNDED, OPEN, encode, load_prompts
from transformers import AutoTokenizer, DynamicCache

import hf_specdec
from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, load_model, runtime_line


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=("grounded", "open"), default="grounded")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16, float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--widths", default="1,2,3,4,5,6,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target-speedup", type=float, default=1.3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = hf_specdec.demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model, _ = load_model(path, dtype=args.dtype)
    print(f"# {runtime_line(describe_runtime(model))}")
    inputs = encode(tokenizer, load_prompts(GROUNDED if args.kind == "grounded" else OPEN, args.batch))
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    widths = [int(w) for w in args.widths.split(",")]
    print(
        f"{args.kind} batch {args.batch}: padded prompt length {ids.shape[1]}, {int(mask.sum())} real tokens"
    )

    prefill, step = [], {w: [] for w in widths}
    with torch.no_grad():
        for _ in range(args.rounds):
            cache = DynamicCache(config=model.config)
            start = clock(model.device)
            model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
            prefill.append(clock(model.device) - start)
            for w in widths:
                tokens = torch.randint(100, 10_000, (args.batch, w))
                step_mask = torch.cat([mask, torch.ones(args.batch, w, dtype=mask.dtype)], dim=1)
                step_positions = positions[:, -1:] + torch.arange(1, w + 1)
                start = clock(model.device)
                model(
                    input_ids=tokens,
                    attention_mask=step_mask,
                    position_ids=step_positions,
                    cache=cache,
                    logits_to_keep=w,
                )
                step[w].append(clock(model.device) - start)
                cache.crop(-w)

    p = statistics.median(prefill)
    plain = statistics.median(step[1])
    decode = args.max_new_tokens * plain
    print(
        f"prefill {p:.2f} s; plain step {plain * 1000:.1f} ms; plain call of {args.max_new_tokens} tokens ≈ "
        f"{p + decode:.2f} s, {p / (p + decode):.0%} of it prefill"
    )
    wanted = (p + decode) / args.target_speedup - p
    print(f"for {args.target_speedup}x on the whole call, decoding must get {decode / wanted:.2f}x faster")
    print()
    print(
        f"| width (k + 1) | step ms | cost vs plain | τ to break even | τ for {args.target_speedup}x "
        "| first call ms | first - later ms |"
    )
    print("|---|---|---|---|---|---|---|")
    extra = {w: (step[w][0] - statistics.median(step[w][1:])) * 1000 for w in widths if len(step[w]) > 1}
    for w in widths:
        cost = statistics.median(step[w]) / plain
        print(
            f"| {w} | {statistics.median(step[w]) * 1000:.1f} | {cost:.2f} | {cost:.2f} | "
            f"{cost * decode / wanted:.2f} | {step[w][0] * 1000:.1f} | "
            + (f"{extra[w]:+.1f} |" if w in extra else "|")
        )
    print("\nτ: tokens each row gains per step (accepted drafts + 1), before any drafting cost.")
    if extra:
        total = sum(extra.values())
        print(f"First calls' extra over the later rounds' median, every width together: {total:+.0f} ms.")


if __name__ == "__main__":
    main()
