"""What indexing the prompt costs the `ngram` drafter at a call's first draft, and a step's ask after it.

    python benchmarks/micro/ngram_index.py [--lengths 500 2000 8000 32000] [--batches 1 8]
        [--repeats 5] [--steps 200]

Times `NgramDrafter.propose` on one thread, its index as shipped (the prompt indexed in one numpy
pass, `PromptNgrams`) against the index that kept a dict entry per n-gram of every position
(`tests/helpers/ngram_reference.py`), the two interleaved run by run. The prompts are text-like:
random ids of a 49,152-token vocabulary that keep copying runs of themselves. First ask: a fresh
drafter's first `propose` on a batch (index built, draft looked up), the best of `--repeats`, the
garbage collector on as in a call (a full collection walks every object the index made). A step's
ask: the median `propose` of the `--steps` steps after it, each adding 1 to 4 tokens that copy
the text (an accepted draft and its bonus token). CPU time of this thread (`time.thread_time`),
which another process's load on the machine does not count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_specdec.core.draft import DraftRequest
from hf_specdec.drafters import ngram
from hf_specdec.drafters.ngram import NgramConfig, NgramDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers.ngram_reference import ReferenceNgramIndex  # noqa: E402

INDEXES = {"dict per n-gram": ReferenceNgramIndex, "one pass": ngram.NgramIndex}


def text(rng: random.Random, length: int) -> list[int]:
    """Random ids that keep copying runs of themselves, as prompts and answers quote themselves."""
    tokens: list[int] = []
    while len(tokens) < length:
        if len(tokens) > 8 and rng.random() < 0.3:
            at = rng.randrange(len(tokens) - 4)
            tokens += tokens[at : at + rng.randint(2, 12)]
        else:
            tokens.append(rng.randrange(49152))
    return tokens[:length]


def asks(prompts: list[list[int]], steps: int, seed: int) -> Iterator[DraftRequest]:
    """The first ask on the prompts, then `steps` asks each adding 1 to 4 tokens to every row, copied
    from earlier in the row (the same for any `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(prompts)
    rows = list(range(len(prompts)))
    for _ in range(steps + 1):
        yield DraftRequest(
            ids, torch.ones_like(ids), [ids.shape[1]] * len(rows), [16] * len(rows), False, None, rows
        )
        added = int(torch.randint(1, 5, (), generator=generator))
        at = torch.randint(0, ids.shape[1] - added, (len(rows), 1), generator=generator)
        ids = torch.cat([ids, ids.gather(1, at + torch.arange(added))], dim=1)


def times(prompts: list[list[int]], steps: int, seed: int) -> tuple[float, float]:
    """Seconds of a fresh drafter's first ask and the median of its later ones."""
    drafter, spent = NgramDrafter(NgramConfig()), []
    for request in asks(prompts, steps, seed):
        started = time.thread_time()
        drafter.propose(request)
        spent.append(time.thread_time() - started)
    return spent[0], statistics.median(spent[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 2000, 8000, 32000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    print("| prompt tokens | batch | index | first ask (ms) | a step's ask (us) |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        for batch in args.batches:
            prompts = [text(rng, length) for _ in range(batch)]
            first = {name: float("inf") for name in INDEXES}
            step = {name: float("inf") for name in INDEXES}
            for _ in range(args.repeats):
                for name, index in INDEXES.items():  # interleaved: the machine's load falls on both
                    ngram.NgramIndex = index
                    try:
                        seconds = times(prompts, args.steps, seed=length + batch)
                    finally:
                        ngram.NgramIndex = INDEXES["one pass"]
                    first[name], step[name] = min(first[name], seconds[0]), min(step[name], seconds[1])
            for name in INDEXES:
                print(f"| {length} | {batch} | {name} | {first[name] * 1e3:.2f} | {step[name] * 1e6:.0f} |")


if __name__ == "__main__":
    main()
