"""The adaptive policy's own host time per step: one `trim`, `draft_length` and `update`, on fake timings.

    python benchmarks/micro/policy_cost.py [--repeats 3000] [--rounds 5] [--oneoff]

The loop calls all three every step on its host path, the first two before the target's forward
can start (on a GPU, time the device waits); `update` learns the step's timing, so every step
prices its widths afresh. The policy is fed a flat verify curve (1% of a step a token, widths 1, 2,
9 and 17 timed three times each) and ten 16-token drafts that held, as after a call's first
steps; `--oneoff` adds a six-step first call at each width, so that one-offs are learnt and
drafts get widened to a width already paid for (`CostModel.feeding`). Prints the best of
`--rounds` means over `--repeats` steps, in microseconds, and the draft the cut returned.
"""

from __future__ import annotations

import argparse

import torch

from hf_specdec.core.draft import Draft
from hf_specdec.core.policy import AdaptiveDraftLength
from hf_specdec.core.timing import clock

CPU = torch.device("cpu")
FLAT = {width: 1.0 + 0.01 * (width - 1) for width in range(1, 18)}


def policy_after_a_few_steps(oneoff: bool) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength()
    for width in (1, 2, 9, 17):
        first = FLAT[width] + (6.0 if oneoff else 0.0)
        for seconds in (first, FLAT[width], FLAT[width]):
            policy.costs.add_verify(1, width, seconds)
    confidence = torch.full((1, 16), 0.9)
    held = Draft(torch.ones(1, 16, dtype=torch.long), [16], confidence=confidence)
    for _ in range(10):
        policy.update(1, held, [16], 0.0, FLAT[17])
    return policy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--oneoff", action="store_true", help="one-offs learnt: drafts get widened")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = policy_after_a_few_steps(args.oneoff)
    draft = Draft(torch.ones(1, 12, dtype=torch.long), [12], confidence=torch.full((1, 12), 0.9))
    best = float("inf")
    for _ in range(args.rounds):
        started = clock(CPU)
        for _ in range(args.repeats):
            cut = policy.trim(draft, 1, [100])
            policy.draft_length(1)
            policy.update(1, cut, [cut.lengths[0]], 0.0, FLAT[1 + cut.tokens.shape[1]])
        best = min(best, (clock(CPU) - started) / args.repeats)
    cut = policy.trim(draft, 1, [100])
    print(
        f"trim + draft_length + update: {best * 1e6:.1f} us a step (best of {args.rounds} x {args.repeats}); "
        f"a 12-token draft cut to {cut.lengths[0]} tokens, fed {1 + cut.tokens.shape[1]} wide"
    )


if __name__ == "__main__":
    main()
