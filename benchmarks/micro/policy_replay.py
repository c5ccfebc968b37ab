"""The draft-length policy replayed on the target's own greedy answers under emulated cost profiles.

    python benchmarks/micro/policy_replay.py [--suite specbench-quick] [--limit 3] [--max-new-tokens 128]
        [--profiles flat,flat+oneoff,flat+oneoff-call,gpu-batch,linear] [--tree] [--host-ms 1.5]
        [--batch-sizes 1,8,32] [--no-carry] [--ask-ms 0.05] [--noise-seeds 0,1000] [--passes 4]

Fast (a minute) and deterministic in its acceptance: each prompt's plain greedy answer is generated
once (`benchmarks/micro/ngram_rules.py`'s cache, SmolLM2-135M in its checkpoint's dtype), then the
decoding loop is replayed step by step against it with the shipped `ngram` drafter and
`AdaptiveDraftLength`: the policy asks for k tokens, the drafter proposes them from the text so far,
the policy cuts the draft,
and the target keeps the longest prefix its own answer agrees with plus one token of its own,
exactly as greedy verification does (rounding ties aside: `hf_specdec.lossless`). Only the clock is
emulated: each target forward costs what the profile says (`hf_specdec.bench.regimes`, a 20 ms
plain step), drafting costs its real CPU time (or `--ask-ms` a row: deterministic), and each step
adds `--host-ms` of loop work (the loop's own cost per step, `benchmarks/micro/overhead.py`). The
policy learns from that clock as it does in `generate`, and, as there, each prompt's `auto` starts
from what verifying cost in the calls before it under the same profile (`CostModel.carry`;
`--no-carry`: every call from nothing).

Rows per prompt: plain decoding, transformers' prompt lookup (its rule and its fixed 10 tokens),
`auto`, and every fixed k of `--ks` (fed k + 1 wide, holes past a shorter draft, where a new shape
costs a one-off: `PaddedDraftLength`); a prompt's fastest fixed k in hindsight is the oracle
(`Oracle`: of the set of ks best for the whole process, charged, as `auto` is, a one-off the first
time the process feeds a shape).
Printed per profile and category: speedup over plain (geometric mean), the oracle's, auto / oracle
(the regret), auto against the one fixed k best over the category's prompts (a per-prompt oracle
also takes whichever k was luckiest on each prompt), auto / prompt lookup, the share of steps that
verified a draft, and a bound no n-gram draft can beat whatever its length or policy
(`bound_seconds`: drafts chosen knowing the answer, verify forwards as cheap as a plain step). In
a batch the bound is the slowest row's: a static batch of mixed prompts gains little from any draft
where one of its rows finds few matches.
For what the real loop does end to end on a real model, see `benchmarks/micro/regimes.py` (slow) and
`hf-specdec bench`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_specdec.bench.regimes import PROFILES, CostProfile, Forward, Jitter, host_clock
from hf_specdec.core.draft import Draft, DraftRequest
from hf_specdec.core.policy import AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from hf_specdec.core.verify_shape import VerifyShape
from hf_specdec.drafters.ngram import NgramConfig, NgramDrafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_rules import (  # noqa: E402
    add_answer_arguments,
    answers,
    count_forwards,
    hindsight,
    prompt_lookup,
    tree_path,
)

CPU = torch.device("cpu")
LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens default
ASK_SECONDS: float | None = None  # `--ask-ms`: what an ask costs a row, instead of its host time


def replay(
    prompts: list[list[int]],
    answers: list[list[int]],
    policy: DraftLengthPolicy,
    profile: CostProfile,
    host_seconds: float,
    shapes: set[tuple[int, int]],
    tree: bool = False,
    lookup: bool = False,
    seed: int = 0,
    ask_seconds: float | None = None,
) -> dict[str, Any]:
    """One greedy call over a batch of prompts replayed: its emulated seconds, target forwards, the
    share of steps that verified a draft, the decoding shapes it fed (`fed`) and those whose one-off
    it paid (`paid`). Rows share each forward, hence its width (rows with a shorter draft, or done,
    are holes); finished rows leave the forward's batch once half of it has finished, unless the
    policy keeps its shape, as they leave the target's cache in the loop (`core/loop.py`).
    `ask_seconds`: drafting costs this much a row instead of its host time."""
    shapes = set() if profile.oneoff_scope == "call" else shapes
    rng = Jitter(seed)  # the profile's noise: every row of a prompt draws the same sequence

    fed: set[tuple[int, int]] = set()
    paid: set[tuple[int, int]] = set()

    def forward_cost(batch: int, width: int, past: int) -> float:
        forward, shape = Forward(batch, width, past), (batch, width)
        first = not forward.prefill and shape not in shapes  # a prefill pays no one-off
        if not forward.prefill:
            shapes.add(shape)
            fed.add(shape)
            if first:
                paid.add(shape)
        return profile.seconds(forward, first, rng) + host_seconds

    drafter = NgramDrafter(NgramConfig())
    seconds = forward_cost(len(prompts), max(map(len, prompts)), 0)  # the prefill gives the first token
    done = [1] * len(prompts)
    forwards, speculative, cached = 1, 0, len(prompts)
    policy.begin_call(VerifyShape(), drafter.draft_cost, max(map(len, prompts)))
    while active := [b for b, answer in enumerate(answers) if done[b] < len(answer)]:
        if len(active) <= cached // 2 and not policy.keeps_batch_shape():
            cached = len(active)
        rooms = [len(answers[b]) - done[b] for b in active]
        k = policy.draft_length(cached)
        contexts = [prompts[b] + answers[b][: done[b]] for b in active]
        if k > 0 and not lookup:
            width = max(map(len, contexts))
            ids = torch.tensor([c + [0] * (width - len(c)) for c in contexts])
            request = DraftRequest(
                ids,
                torch.ones_like(ids),
                [len(c) for c in contexts],
                [min(k, room - 1) for room in rooms],
                False,
                None,
                active,
                tree=tree,
            )
        # Only the ask is timed: the loop holds the sequence as a tensor already (building this one
        # from lists, up to a thousand tokens a row, cost more than the ask itself).
        started = host_clock()
        if k <= 0:
            draft = Draft.empty(len(active), CPU)
        elif lookup:  # transformers' prompt lookup: batch 1 only, as in transformers
            proposed = prompt_lookup(contexts[0], min(k, rooms[0] - 1))
            draft = Draft(torch.tensor([proposed]), [len(proposed)]) if proposed else Draft.empty(1, CPU)
        else:
            draft = drafter.propose(request)
        draft_seconds = host_clock() - started
        ask_seconds = ASK_SECONDS if ask_seconds is None else ask_seconds
        if ask_seconds is not None:  # a fixed cost a row: deterministic, whatever the machine
            draft_seconds = ask_seconds * len(active) if k > 0 else 0.0
        draft = policy.trim(draft, cached, rooms)
        accepted, paths = [], []
        for row, b in enumerate(active):
            n, answer = draft.lengths[row], answers[b]
            if draft.parents is not None and n:
                path = tree_path(draft.tokens[row].tolist(), draft.parents[row].tolist(), n, answer, done[b])
                accepted.append(len(path))
                paths.append(path)
                continue
            proposed, hits = draft.tokens[row, :n].tolist(), 0
            while hits < n and done[b] + hits < len(answer) and proposed[hits] == answer[done[b] + hits]:
                hits += 1
            accepted.append(hits)
            paths.append(list(range(hits)))
        width = 1 + draft.tokens.shape[1]  # as the loop feeds it: holes past the drafts included
        verify_seconds = forward_cost(cached, width, max(map(len, contexts)) - 1)
        trees = paths if draft.parents is not None else None
        policy.update(cached, draft, accepted, draft_seconds, verify_seconds, trees)
        chosen = torch.full((len(active), width), -1)  # as the loop tells it: what the target chose
        for row, b in enumerate(active):
            emitted = answers[b][done[b] : done[b] + accepted[row] + 1]
            chosen[row, : len(emitted)] = torch.tensor(emitted, dtype=torch.long)
        policy.observe_target(chosen)
        drafter.observe(draft, accepted)
        seconds += draft_seconds + verify_seconds
        for row, b in enumerate(active):
            done[b] += accepted[row] + 1
        forwards += 1
        speculative += width > 1
    share = speculative / max(forwards - 1, 1)
    return {"seconds": seconds, "forwards": forwards, "speculative": share, "fed": fed, "paid": paid}


@dataclass
class Oracle:
    """The fastest fixed k per call in hindsight that one process could have had. Over each set of
    `ks`, every call takes its set's fastest k at steady cost and pays, as `auto` does, a one-off
    the first time the process feeds a shape (`CostProfile.oneoff`, once a process); the oracle's set
    is the one whose calls took least in total. Each fixed k's row runs as a process of its own,
    paying its shapes' one-offs on its first call alone, so the fastest row of each call would feed
    every k's widths for one one-off. Without once-a-process one-offs: each call's fastest row."""

    profile: CostProfile
    calls: list[dict[int, dict]] = field(default_factory=list)  # each call's run of each fixed k
    _seconds: list[float] | None = field(default=None, init=False, repr=False)

    def add(self, runs: dict[int, dict]) -> int:
        """Record one call's runs (`replay`'s results per k); its place in `seconds`."""
        self.calls.append(runs)
        self._seconds = None
        return len(self.calls) - 1

    def seconds(self) -> list[float]:
        """The oracle's seconds for each call, in order."""
        if self._seconds is None:
            ks = sorted(self.calls[0])
            if not self._oneoff:
                sets: list[tuple[int, ...]] = [tuple(ks)]
            else:
                sets = [subset for n in range(1, len(ks) + 1) for subset in itertools.combinations(ks, n)]
            self._seconds = min((self._charged(subset) for subset in sets), key=sum)
        return self._seconds

    @property
    def _oneoff(self) -> float:
        """What a shape new to the process costs on top: nothing where one-offs are paid once a call
        (each row's seconds hold its call's own) or not at all."""
        return self.profile.oneoff_seconds if self.profile.oneoff_scope == "process" else 0.0

    def _charged(self, ks: tuple[int, ...]) -> list[float]:
        """Each call's seconds where the process takes its fastest k of `ks`."""
        oneoff = self._oneoff
        fed: set[tuple[int, int]] = set()
        out = []
        for runs in self.calls:  # the set's fastest k without one-offs, then the set's own paid
            steady = {k: runs[k]["seconds"] - oneoff * len(runs[k]["paid"]) for k in ks}
            best = min(steady, key=steady.__getitem__)
            out.append(steady[best] + oneoff * len(runs[best]["fed"] - fed))
            fed |= runs[best]["fed"]
        return out


@dataclass
class PaddedDraftLength(FixedDraftLength):
    """Draft `k` tokens and feed k + 1 columns whatever came back, holes past a shorter draft: a
    fixed k where each new shape costs a one-off keeps to one shape, as `auto` pads to widths it
    paid for. A tree, or no draft (a plain step), is fed as it is."""

    def trim(self, draft: Draft, batch_size: int, remaining: list[int] | None = None) -> Draft:
        return draft if draft.parents is not None or not any(draft.lengths) else draft.widened(self.k)


def fixed_rows(profile: CostProfile) -> type[FixedDraftLength]:
    """The fixed-k policy the oracle is made of: padded to one shape where new shapes cost a one-off."""
    return PaddedDraftLength if profile.oneoff else FixedDraftLength


def bound_seconds(
    prompts: list[list[int]], answers: list[list[int]], profile: CostProfile, host_seconds: float
) -> float:
    """Emulated seconds no n-gram draft of the text can beat, whatever its length and the policy:
    every row drafts, knowing its answer, the continuation of any earlier occurrence of any 1- to
    4-token suffix that the answer keeps longest (`ngram_rules.hindsight`; a trie's paths are
    prefixes of such continuations, so it bounds n-gram trees too), and every verify forward costs
    a plain batch-1 step. A batch calls as many forwards as its slowest row needs: `generate`
    returns a batch when its last row is done."""
    # Forwards after the prefill, of the row that needs the most.
    decoding = max(count_forwards(p, a, hindsight(p, a), len(a)) - 1 for p, a in zip(prompts, answers))
    prefill = profile.seconds(Forward(len(prompts), max(map(len, prompts)), 0))
    return prefill + host_seconds + decoding * (profile.seconds(Forward(1, 1, 1)) + host_seconds)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _draws(data: list[dict], profile: CostProfile, noise_seeds: tuple[int, ...]):
    """(noise seed, the prompt's place, prompt) for each draw of a noisy profile's noise (`--noise-
    seeds`: one draw's figures per category move by a few percent), one draw where it has none."""
    for noise_seed in noise_seeds if profile.noise or profile.drift else noise_seeds[:1]:
        for seed, row in enumerate(data):
            yield noise_seed, seed, row


def evaluate(
    data: list[dict],
    profile: CostProfile,
    ks: list[int],
    tree: bool,
    host_seconds: float,
    carry: bool = True,
    noise_seeds: tuple[int, ...] = (0,),
    passes: int = 1,
) -> dict:
    by_category: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    fixed_k = fixed_rows(profile)
    oracles = []  # per reported call: once its process's calls are all in
    for noise_seed, seed, row in _draws(data * passes, profile, noise_seeds):
        if seed == 0:  # each draw of the noise is a process of its own
            # The one-offs already paid, per row: each row runs as a process of its own, so none
            # pays for the shapes another row's calls fed first.
            shapes: dict[Any, set[tuple[int, int]]] = defaultdict(set)
            device_costs = None  # what auto measured in the calls before (`carry`), as generate keeps it
            best_fixed = Oracle(profile)

        def run(
            name: Any,
            policy: DraftLengthPolicy,
            row=row,
            seed=seed + noise_seed,
            shapes=shapes,
            **kwargs: Any,
        ) -> dict[str, Any]:
            prompts, answers_ = [row["prompt"]], [row["answer"]]
            return replay(prompts, answers_, policy, profile, host_seconds, shapes[name], seed=seed, **kwargs)

        plain = run("plain", FixedDraftLength(0))["seconds"]
        policy = AdaptiveDraftLength(device_costs=device_costs)
        auto = run("auto", policy, tree=tree)
        device_costs = policy.costs if carry else None
        runs = {k: run(k, fixed_k(k), tree=tree) for k in ks}
        fixed = {k: r["seconds"] for k, r in runs.items()}
        call = best_fixed.add(runs)
        lookup = run("lookup", FixedDraftLength(LOOKUP_TOKENS), lookup=True)["seconds"]
        if seed < (passes - 1) * len(data):
            continue  # the process's earlier passes: only its last is reported
        bound = bound_seconds([row["prompt"]], [row["answer"]], profile, host_seconds)
        c = by_category[row["category"]]
        oracles.append((c, best_fixed, call, plain, auto["seconds"]))
        c["bound"].append(plain / bound)
        c["bound_vs_lookup"].append(lookup / bound)
        c["auto"].append(plain / auto["seconds"])
        c["vs_lookup"].append(lookup / auto["seconds"])
        c["lookup"].append(plain / lookup)
        c["speculative"].append(auto["speculative"])
        for k, seconds in fixed.items():
            c[f"k={k}"].append(plain / seconds)
    for c, best_fixed, call, plain, auto_seconds in oracles:
        oracle = best_fixed.seconds()[call]
        c["oracle"].append(plain / oracle)
        c["regret"].append(oracle / auto_seconds)
    out = {}
    for category, c in by_category.items():
        out[category] = {
            name: statistics.mean(v) if name == "speculative" else _geomean(v)
            for name, v in c.items()
            if not name.startswith("k=")
        }
        # One k for the whole category, chosen in hindsight: a per-prompt oracle also picks whichever
        # k was luckiest on each prompt, worth a forward or two on calls of 20 forwards.
        best_k = max(_geomean(v) for name, v in c.items() if name.startswith("k="))
        out[category]["vs_best_k"] = out[category]["auto"] / best_k
    return out


def batches(data: list[dict], batch: int) -> list[list[dict]]:
    """`data` in batches of `batch` prompts, categories interleaved (as a server's batch mixes
    requests); a suite smaller than the batch is cycled to fill it."""
    per_category: dict[str, int] = defaultdict(int)
    place = []
    for row in data:
        place.append(per_category[row["category"]])
        per_category[row["category"]] += 1
    order = sorted(range(len(data)), key=lambda i: place[i])
    return [
        [data[order[(g * batch + j) % len(order)]] for j in range(batch)]
        for g in range(max(1, round(len(data) / batch)))
    ]


def evaluate_batches(
    data: list[dict],
    profile: CostProfile,
    ks: list[int],
    tree: bool,
    host_seconds: float,
    batch: int,
    carry: bool = True,
    noise_seeds: tuple[int, ...] = (0,),
) -> dict[str, float]:
    """Batches of `batch` prompts (`batches`). Speedups over plain batched decoding of the same
    batch (geometric mean over batches and draws of the noise); the oracle is each batch's best
    fixed k of the best set for the process (`Oracle`)."""
    groups = batches(data, batch)
    results: dict[str, list[float]] = defaultdict(list)
    calls = []
    fixed_k = fixed_rows(profile)
    for noise_seed, seed, group in _draws(groups, profile, noise_seeds):
        if seed == 0:
            shapes: dict[Any, set[tuple[int, int]]] = defaultdict(set)  # per row, as in `evaluate`
            device_costs = None
            best_fixed = Oracle(profile)

        def run(
            name: Any, policy: DraftLengthPolicy, group=group, seed=seed + noise_seed, shapes=shapes
        ) -> dict[str, Any]:
            prompts, answers_ = [r["prompt"] for r in group], [r["answer"] for r in group]
            return replay(
                prompts,
                answers_,
                policy,
                profile,
                host_seconds,
                shapes[name],
                tree=tree,
                seed=seed,
            )

        plain = run("plain", FixedDraftLength(0))["seconds"]
        policy = AdaptiveDraftLength(device_costs=device_costs)
        auto = run("auto", policy)
        device_costs = policy.costs if carry else None
        calls.append((best_fixed, best_fixed.add({k: run(k, fixed_k(k)) for k in ks}), plain, auto))
        prompts, answers_ = [r["prompt"] for r in group], [r["answer"] for r in group]
        results["bound"].append(plain / bound_seconds(prompts, answers_, profile, host_seconds))
        results["auto"].append(plain / auto["seconds"])
        results["speculative"].append(auto["speculative"])
    for best_fixed, call, plain, auto in calls:  # once each process's calls are all in
        oracle = best_fixed.seconds()[call]
        results["oracle"].append(plain / oracle)
        results["regret"].append(oracle / auto["seconds"])
    return {
        name: statistics.mean(v) if name == "speculative" else _geomean(v) for name, v in results.items()
    } | {"batches": len(groups)}


def batch_markdown(results: dict[str, dict[int, dict]], tree: bool) -> str:
    lines = [
        "\n| profile | batch | batches | auto | oracle | auto / oracle | bound | auto's speculative steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for profile, by_batch in results.items():
        for batch, v in by_batch.items():
            lines.append(
                f"| {profile}{' (trees)' if tree else ''} | {batch} | {v['batches']} | {v['auto']:.2f}x"
                f" | {v['oracle']:.2f}x | {v['regret']:.2f} | {v['bound']:.2f}x | {v['speculative']:.0%} |"
            )
    return "\n".join(lines)


def markdown(results: dict[str, dict], tree: bool) -> str:
    lines = []
    for profile, by_category in results.items():
        lines += [
            f"\n{profile} ({PROFILES[profile].description}){', trees' if tree else ''}\n",
            "| category | auto | oracle | auto / oracle | auto / best k | prompt lookup"
            " | auto / prompt lookup | bound | bound / prompt lookup | auto's speculative steps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for category, v in by_category.items():
            lines.append(
                f"| {category} | {v['auto']:.2f}x | {v['oracle']:.2f}x | {v['regret']:.2f}"
                f" | {v['vs_best_k']:.2f}"
                f" | {v['lookup']:.2f}x | {v['vs_lookup']:.2f} | {v['bound']:.2f}x"
                f" | {v['bound_vs_lookup']:.2f} | {v['speculative']:.0%} |"
            )
        mean = {
            name: _geomean([v[name] for v in by_category.values()])
            for name in (
                "auto",
                "oracle",
                "regret",
                "vs_best_k",
                "lookup",
                "vs_lookup",
                "bound",
                "bound_vs_lookup",
            )
        }
        lines.append(
            f"| **geometric mean** | **{mean['auto']:.2f}x** | {mean['oracle']:.2f}x | {mean['regret']:.2f}"
            f" | {mean['vs_best_k']:.2f}"
            f" | {mean['lookup']:.2f}x | {mean['vs_lookup']:.2f} | {mean['bound']:.2f}x"
            f" | {mean['bound_vs_lookup']:.2f} | |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_answer_arguments(parser, "specbench-quick", 3)
    parser.add_argument("--profiles", default="flat,flat+oneoff,flat+oneoff-call,gpu-batch,linear")
    parser.add_argument("--ks", default="2,4,6,8,10,12,16")
    parser.add_argument("--tree", action="store_true", help="auto and the fixed k draft n-gram tries")
    parser.add_argument("--host-ms", type=float, default=1.5, help="loop work per step (default 1.5 ms)")
    parser.add_argument(
        "--ask-ms", type=float, default=None, help="an ask's cost a row (default: its host time, timed)"
    )
    parser.add_argument(
        "--no-carry",
        action="store_true",
        help="each call's policy starts from nothing (generate carries verify costs from call to call)",
    )
    parser.add_argument(
        "--noise-seeds",
        default="0",
        help="comma-separated, each added to every prompt's seed of a noisy profile's jitter (default 0):"
        " the figures of noisy profiles pool as many draws of the noise, each a process of its own",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="batch 1: each process runs the suite this many times and its last pass is reported"
        " (a long-running process, where what a new width's one-off buys has more calls to pay back)",
    )
    parser.add_argument(
        "--batch-sizes",
        default="1",
        help="comma-separated; batches above 1 get their own table against plain batched decoding",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # drafting is timed on the CPU: keep other work from moving it
    global ASK_SECONDS
    ASK_SECONDS = None if args.ask_ms is None else args.ask_ms / 1000
    data = answers(args)
    ks = [int(k) for k in args.ks.split(",")]
    seeds = tuple(int(s) for s in args.noise_seeds.split(","))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"{args.suite}: {len(data)} prompts, {args.max_new_tokens} greedy tokens, fixed k {ks}")
    profiles = args.profiles.split(",")
    host = args.host_ms / 1000
    if 1 in batch_sizes:
        results = {
            name: evaluate(data, PROFILES[name], ks, args.tree, host, not args.no_carry, seeds, args.passes)
            for name in profiles
        }
        print(markdown(results, args.tree))
    if wide := [b for b in batch_sizes if b > 1]:
        batched = {
            name: {
                b: evaluate_batches(
                    data,
                    PROFILES[name],
                    ks,
                    args.tree,
                    args.host_ms / 1000,
                    b,
                    not args.no_carry,
                    seeds,
                )
                for b in wide
            }
            for name in profiles
        }
        print(batch_markdown(batched, args.tree))


if __name__ == "__main__":
    main()
