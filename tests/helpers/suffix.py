"""Hand-made `suffix` corpora: a snapshot of given sequences, the sequences a snapshot holds, and
the chain the drafter would vote in one."""

from __future__ import annotations

import numpy as np

from hf_specdec.drafters.suffix import SuffixConfig, corpus_chain
from hf_specdec.drafters.suffix_array import Snapshot
from hf_specdec.drafters.suffix_speculation import Chain


def corpus(*sequences: list[int], bound: int = 1000) -> Snapshot:
    return Snapshot.empty(2).added([list(s) for s in sequences], bound)


def held(snapshot: Snapshot) -> list[list[int]]:
    """The sequences a snapshot holds, oldest first."""
    rows = np.split(snapshot.tokens, np.flatnonzero(snapshot.tokens < 0) + 1)
    return [row[:-1].tolist() for row in rows if len(row)]


def chain(snapshot: Snapshot, tail: list[int], budget: int = 8, half_life=None, **options) -> Chain:
    """The chain the drafter votes after `tail` under `SuffixConfig(**options)`, occurrences weighed
    by `half_life` (None: all alike)."""
    return corpus_chain(snapshot, tail, budget, SuffixConfig(recency_half_life=half_life, **options))
