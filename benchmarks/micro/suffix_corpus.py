"""What the `suffix` drafter's corpus costs a call at its bound: the add, and the replay.

    python benchmarks/micro/suffix_corpus.py [--vocab 49152] [--bound 262144] [--rows 1,8,64]
        [--repeats 3]

Fills a corpus (`SuffixCorpus`, the defaults of `SuffixConfig`) to `--bound` tokens with rows of
356 ids (100 of prompt, 256 of output) drawn Zipf-like (s = 1.2) from a vocabulary the size of
SmolLM2's, so that short matches abound as in text, then times one call's end for each of
`--rows` rows that repeat nothing in it: the add alone (sequences keyed and merged in, the oldest
dropped: the best of `--repeats`), and the add with the replay that decides whether the corpus
drafts (forced, as every call while the corpus pays; one run) with the rows it replayed.
"""

from __future__ import annotations

import argparse

import numpy as np

from hf_specdec.core.timing import clock
from hf_specdec.drafters.suffix import SuffixConfig, SuffixCorpus

PROMPT, OUTPUT = 100, 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152, help="ids drawn below this (SmolLM2's)")
    parser.add_argument("--bound", type=int, default=1 << 18, help="max_corpus_tokens")
    parser.add_argument("--rows", default="1,8,64", help="rows a call, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(0)

    def rows(n: int) -> list[list[int]]:
        return [(np.minimum(rng.zipf(1.2, PROMPT + OUTPUT), args.vocab) - 1).tolist() for _ in range(n)]

    config = SuffixConfig(max_corpus_tokens=args.bound)
    corpus = SuffixCorpus(args.vocab)
    snapshot = corpus.snapshot
    for _ in range(args.bound // (8 * (PROMPT + OUTPUT)) + 2):  # full, and dropping the oldest
        snapshot = snapshot.added(rows(8), args.bound)
    corpus.snapshot = snapshot
    replay = SuffixCorpus._replay
    replayed = 0

    def counted(*call_args, **kwargs):
        nonlocal replayed
        replayed += 1
        return replay(*call_args, **kwargs)

    SuffixCorpus._replay = counted
    print(f"corpus: {corpus.num_tokens:,} tokens, {corpus.nbytes:,} bytes, vocabulary {args.vocab:,}")
    print("| rows a call | add | replay + add | rows replayed |")
    print("|---:|---:|---:|---:|")
    for n in map(int, args.rows.split(",")):
        adds = []
        for _ in range(args.repeats):
            batch = rows(n)
            corpus._until_replay = 1  # this call not replayed
            started = clock("cpu")
            corpus.add(batch, [PROMPT] * n, config)
            adds.append(clock("cpu") - started)
        batch, replayed = rows(n), 0
        corpus._until_replay = 0
        started = clock("cpu")
        corpus.add(batch, [PROMPT] * n, config)
        both = clock("cpu") - started
        print(f"| {n} | {min(adds) * 1e3:.1f} ms | {both * 1e3:.0f} ms | {replayed} |")
    SuffixCorpus._replay = replay


if __name__ == "__main__":
    main()
