"""What asking the `ngram` drafter for a draft costs per step, on the target's own greedy answers.

    python benchmarks/micro/ngram_cost.py [--suite specbench-quick] [--limit 3] [--max-new-tokens 128]
        [--k 16] [--repeats 3]

Replays each prompt's decoding as `generate` would ask (the text so far, up to k tokens wanted;
`benchmarks/micro/ngram_rules.py`'s cached answers, SmolLM2-135M in its checkpoint's dtype) and
times `NgramDrafter.propose` alone, one torch thread: a step's median over the answer, the first
step (which indexes the prompt) left out, the best of `--repeats` runs. The policy treats drafts
under `FREE_DRAFT` (5%) of a plain step as free and asks every step; on a compiled GPU step of a
few milliseconds the drafter's Python is what that share is made of.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from hf_specdec.core.draft import DraftRequest
from hf_specdec.core.timing import clock
from hf_specdec.drafters.ngram import NgramConfig, NgramDrafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_rules import add_answer_arguments, answers  # noqa: E402


def step_seconds(prompt: list[int], answer: list[int], k: int, repeats: int) -> float:
    requests = []
    for done in range(1, len(answer)):
        ids = torch.tensor([prompt + answer[:done]])
        requests.append(DraftRequest(ids, torch.ones_like(ids), [ids.shape[1]], [k], False, None, [0]))
    cpu, best = torch.device("cpu"), float("inf")
    for _ in range(repeats):
        drafter, times = NgramDrafter(NgramConfig()), []
        for request in requests:
            started = clock(cpu)
            drafter.propose(request)
            times.append(clock(cpu) - started)
        best = min(best, statistics.median(times[1:]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_answer_arguments(parser, "specbench-quick", 3)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = answers(args)
    by_prompt = [step_seconds(r["prompt"], r["answer"], args.k, args.repeats) for r in rows]
    print(
        f"{args.suite}: {len(rows)} prompts, {args.max_new_tokens} tokens, k = {args.k}: a step's ask "
        f"{statistics.median(by_prompt) * 1e6:.0f} us (median over prompts; "
        f"{min(by_prompt) * 1e6:.0f}-{max(by_prompt) * 1e6:.0f} us)"
    )


if __name__ == "__main__":
    main()
