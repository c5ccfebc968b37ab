"""What the target's first forward at each verify width costs in a fresh process, against later ones.

    python benchmarks/micro/first_calls.py [--widths 2,3,4,5,6,7,8,9,11,13,17] [--dtype auto] [--repeats 3]

A device may pay once per new shape (kernel selection, allocator growth, a CPU library's per-shape
setup). Where the first call at a width costs over twice the next, the draft-length policy learns it
as a one-off (`CostModel.first_calls`) and keeps to the widths already paid for; below that it is
noise to the policy, but still time a process's first speculative call pays. SmolLM2-135M (the
offline demo model) in its checkpoint's dtype, ~100 cached tokens. The plain step is warmed first,
then each width's first forward is timed and the same widths again `--repeats` times, each forward's
new tokens dropped from the cache after it. Printed per width: the first forward's ms, the median of
the later ones, their difference.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

from hf_specdec.core.timing import clock
from hf_specdec.loading import describe_runtime, load_model, runtime_line

PROMPT = "Explain how a hash map works and when to use one. " * 8


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", default="2,3,4,5,6,7,8,9,11,13,17")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model, tokenizer = load_model(None, dtype=args.dtype)
    print(runtime_line(describe_runtime(model)))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(model.device)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)

        def forward_ms(width: int) -> float:
            tokens = torch.randint(100, 1000, (1, width), device=model.device)
            started = clock(model.device)
            model(tokens, cache=cache, use_cache=True)
            elapsed = clock(model.device) - started
            cache.crop(-width)  # back to the prompt: every forward sees the same cached length
            return elapsed * 1000

        for _ in range(3):
            forward_ms(1)
        plain = statistics.median(forward_ms(1) for _ in range(5))
        first = {w: forward_ms(w) for w in widths}
        later: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(args.repeats):
            for w in widths:
                later[w].append(forward_ms(w))
    print(f"{ids.shape[1]} cached tokens; a plain step {plain:.1f} ms (median of 5, warmed)\n")
    print("| width | first ms | later ms (median) | first - later |")
    print("|---:|---:|---:|---:|")
    for w in widths:
        steady = statistics.median(later[w])
        print(f"| {w} | {first[w]:.1f} | {steady:.1f} | {first[w] - steady:+.1f} |")
    extra = sum(first[w] - statistics.median(later[w]) for w in widths)
    print(f"\nfirst forwards' extra over all widths: {extra:.0f} ms")


if __name__ == "__main__":
    main()
