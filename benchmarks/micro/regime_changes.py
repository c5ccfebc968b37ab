"""The draft-length policy when the device's cost regime changes inside one process, replayed.

    python benchmarks/micro/regime_changes.py [--suite specbench-train] [--limit 4] [--max-new-tokens 128]
        [--warm-suite specbench-quick] [--warm-limit 3] [--warm-calls 6] [--batch 8]

Each scenario is one process: `--warm-calls` calls of `auto` under a first regime (prompts of
`--warm-suite`), each starting from what the calls before it measured (`CostModel.carry`, as
`generate` does through `DEVICE_COSTS`), then every prompt of `--suite` under a second regime,
still carrying. The second phase is held against plain decoding of the same prompts under the
second regime, against `auto` in a fresh process (no warm calls), and against `oracle`: each call
at its fastest fixed k of `ORACLE_KS` (0: plain) in hindsight, which no policy fixing k for a call
beats (a batch ends with its slowest row: a static batch of mixed answers gains little). Scenarios:

- `flat -> linear`, `linear -> flat`: the device's cost curve changes (another job takes the cores,
  the model is cast), batch 1;
- `flat -> flat:b8`, `linear -> linear:b8`, and with the regime changing too: the warm calls at
  batch 1, then batches of `--batch` prompts of one group (cycled to fill a batch), held against
  plain batched decoding.

Prompts are grouped as grounded (summarization, rag: the answer copies the input) and open (qa,
mt_bench, math_reasoning); translation apart. Like `policy_replay.py`, it replays each prompt's
cached plain greedy answer with the shipped `ngram` drafter, and only the clock is emulated
(`hf_specdec.bench.regimes`); each ask costs a fixed 0.05 ms a row, so that a run is deterministic.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hf_specdec.bench.regimes import PROFILES, CostProfile
from hf_specdec.core.policy import AdaptiveDraftLength, FixedDraftLength

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_rules import add_answer_arguments, answers  # noqa: E402
from policy_replay import batches, replay  # noqa: E402

GROUPS = {"grounded": ("summarization", "rag"), "open": ("qa", "mt_bench", "math_reasoning")}
HOST_SECONDS = 0.0015  # the loop's own work per step, as policy_replay.py's default
ASK_SECONDS = 0.00005  # an n-gram lookup a row (the median measured: 0.03-0.05 ms), fixed: deterministic
ORACLE_KS = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)


class Process:
    """One process's state that outlives a call: what `auto` carries, and the shapes paid for."""

    def __init__(self) -> None:
        self.costs = None
        self.shapes: dict[str, set[tuple[int, int]]] = defaultdict(set)

    def call(self, group: list[dict], profile: CostProfile, seed: int) -> dict[str, float]:
        """One call of `auto` and one of plain decoding on `group` (a batch of prompts): seconds each."""
        prompts, answers_ = [r["prompt"] for r in group], [r["answer"] for r in group]
        policy = AdaptiveDraftLength(device_costs=self.costs)
        auto = replay(
            prompts,
            answers_,
            policy,
            profile,
            HOST_SECONDS,
            self.shapes["auto"],
            seed=seed,
            ask_seconds=ASK_SECONDS,
        )
        self.costs = policy.costs
        plain = replay(
            prompts, answers_, FixedDraftLength(0), profile, HOST_SECONDS, self.shapes["plain"], seed=seed
        )
        return {"auto": auto["seconds"], "plain": plain["seconds"], "speculative": auto["speculative"]}


def oracle(calls: list[tuple[str, list[dict]]], profile: CostProfile) -> list[dict[str, Any]]:
    """Each call's plain seconds and, as `auto`, its fastest fixed k's (`ORACLE_KS`), labelled."""
    out = []
    for seed, (label, group) in enumerate(calls):
        prompts, answers_ = [r["prompt"] for r in group], [r["answer"] for r in group]
        seconds = {
            k: replay(
                prompts,
                answers_,
                FixedDraftLength(k),
                profile,
                HOST_SECONDS,
                set(),
                seed=seed,
                ask_seconds=ASK_SECONDS,
            )["seconds"]
            for k in ORACLE_KS
        }
        out.append({"label": label, "plain": seconds[0], "auto": min(seconds.values())})
    return out


def phase(
    process: Process, calls: list[tuple[str, list[dict]]], profile: CostProfile
) -> list[dict[str, Any]]:
    """Each call of `calls` (a label and its prompts) in turn: its results, labelled."""
    return [
        process.call(group, profile, seed) | {"label": label} for seed, (label, group) in enumerate(calls)
    ]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def _cell(speedup: float | None) -> str:
    """A speedup, or nothing for a group the scenario did not run (translation in batches)."""
    return "" if speedup is None or math.isnan(speedup) else f"{speedup:.2f}x"


def summary(results: list[dict[str, Any]]) -> dict[str, float]:
    """Speedup of auto over plain (geometric mean of calls) per group, per category and over all."""
    speed = [(r["label"], r["plain"] / r["auto"]) for r in results]
    out = {"all": _geomean([s for _, s in speed]), "first": speed[0][1]}
    for name, categories in GROUPS.items():
        out[name] = _geomean([s for c, s in speed if c in categories or c == name])
    for category in sorted({c for c, _ in speed}):
        out[category] = _geomean([s for c, s in speed if c == category])
    return out


def scenario(
    warm: list[tuple[str, list[dict]]],
    test: list[tuple[str, list[dict]]],
    first: CostProfile,
    second: CostProfile,
) -> dict[str, dict[str, float]]:
    """`test` under `second` after `warm` under `first` in one process, and in a fresh one."""
    process = Process()
    phase(process, warm, first)
    changed = summary(phase(process, test, second))
    fresh = summary(phase(Process(), test, second))
    return {"after": changed, "fresh": fresh, "oracle": summary(oracle(test, second))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_answer_arguments(parser, "specbench-train", 4)
    parser.add_argument("--warm-suite", default="specbench-quick")
    parser.add_argument("--warm-limit", type=int, default=3)
    parser.add_argument("--warm-calls", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--scenarios",
        default="flat->linear,linear->flat,flat->flat:b8,linear->linear:b8,flat->linear:b8,linear->flat:b8",
        help="first->second regime, :b8 after the second for batches of --batch (warm calls: batch 1)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    test_rows = answers(args)
    warm_args = argparse.Namespace(**{**vars(args), "suite": args.warm_suite, "limit": args.warm_limit})
    warm_rows = answers(warm_args)[: args.warm_calls]
    print(f"warm: {len(warm_rows)} calls of {args.warm_suite}; then {len(test_rows)} prompts of {args.suite}")
    header = (
        "| scenario | calls after the change | " + " | ".join(GROUPS) + " | translation | all | first call |"
    )
    print(f"\n{header}\n|---|---|" + "---:|" * (len(GROUPS) + 3))
    for name in args.scenarios.split(","):
        before, after = name.split("->")
        first, second = PROFILES[before], PROFILES[after.split(":")[0]]
        if after.endswith(":b8"):  # batches of one group's prompts, labelled by the group
            test = [
                (group, rows)
                for group, categories in GROUPS.items()
                for rows in batches([r for r in test_rows if r["category"] in categories], args.batch)
            ]
        else:
            test = [(r["category"], [r]) for r in test_rows]
        result = scenario([(r["category"], [r]) for r in warm_rows], test, first, second)
        labels = {"after": f"after {len(warm_rows)} warm calls", "fresh": "fresh process", "oracle": "oracle"}
        for when, label in labels.items():
            v = result[when]
            groups = " | ".join(_cell(v.get(g)) for g in GROUPS)
            print(
                f"| {name} | {label} | {groups} | {_cell(v.get('translation'))}"
                f" | {v['all']:.2f}x | {v['first']:.2f}x |"
            )


if __name__ == "__main__":
    main()
