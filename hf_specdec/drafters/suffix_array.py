"""The `suffix` drafter's index of its corpus: a suffix array of the reversed sequences.

Every position of every sequence in the corpus is keyed by the `MAX_MATCH` tokens before it read
backwards (nearest first), and the keys are kept sorted: a suffix array of the reversed sequences.
The positions whose preceding tokens end as the context does form one contiguous range for each
match length m, and those ranges are nested, so one vectorised binary search gives all of them and
the longest match (`Snapshot.occurrences`); a `Match` carries the positions that continue it, the
most recent `MAX_OCCURRENCES`, and each one's vote, 2^(-age / half-life) with age in sequences
added since (`Snapshot.weights`). Sequences are added at the newest end and dropped from the oldest
once the corpus holds more tokens than its bound (`Snapshot.added`).

Why this structure. A suffix tree (arctic-inference's, in C++) touches up to its depth of nodes for
every token added, and each node would be a Python object here, its size depending on how the text
branches. A suffix automaton finds the longest match in constant time per token, but cannot forget
a sequence, and first-in-first-out eviction is the contract. The sorted array is numpy's: an add
sorts the call's keys and merges them in, an eviction is a mask, a look-up a binary search; it
costs a fixed `bytes_per_token` a token (40 for a vocabulary under 65535), so the bound in tokens
is a bound in bytes; and readers take the arrays as they are while a writer builds the next ones
(a `Snapshot` is never changed once built: thread-safe without readers waiting).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MAX_MATCH = 16  # tokens of context a corpus match can span: the sort keys' width
MAX_OCCURRENCES = 64  # occurrences of a match voted among, the most recent


def unit_bytes(vocab_size: int) -> int:
    """Bytes a token takes in a sort key: id + 1 big-endian (0 marks no token), and an all-0xFF
    unit left free to bound a range from above."""
    for width in (2, 3):
        if vocab_size + 1 < 256**width - 1:
            return width
    raise ValueError(
        f"The suffix corpus keys tokens in at most 3 bytes; a vocabulary of {vocab_size} ids is larger. "
        "Use method='ngram'."
    )


def bytes_per_token(vocab_size: int) -> int:
    """What the corpus holds per token: its key, its key's position, the token itself."""
    return MAX_MATCH * unit_bytes(vocab_size) + 4 + 4


def encode(codes: np.ndarray, width: int) -> np.ndarray:
    """Rows of token codes (id + 1, 0 for none) [n, MAX_MATCH] as big-endian units of `width`
    bytes [n, MAX_MATCH * width]: compared as bytes, rows order as their codes do."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.uint32) * 8
    units = (codes.astype(np.uint32)[..., None] >> shifts) & 0xFF  # [n, MAX_MATCH, width]
    return np.ascontiguousarray(units.astype(np.uint8)).reshape(len(codes), -1)


def as_keys(encoded: np.ndarray) -> np.ndarray:
    """`encode`'s rows as fixed-width byte strings [n], which numpy sorts and searches."""
    return encoded.view(f"S{encoded.shape[1]}")[:, 0]


def preceding_codes(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each of `positions` in `tokens`, the codes of the MAX_MATCH tokens before it, nearest
    first (0 past the start) [n, MAX_MATCH]."""
    padded = np.concatenate([np.zeros(MAX_MATCH, dtype=np.int64), tokens.astype(np.int64) + 1])
    before = positions[:, None] + MAX_MATCH - 1 - np.arange(MAX_MATCH)  # padded index of each
    return padded[before]


@functools.cache
def _range_masks(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per match length m (row m - 1) of keys of `width`-byte units: 1 on the first m units' bytes,
    and 0xFF on the unit after them (none for m = MAX_MATCH) [MAX_MATCH, MAX_MATCH * width]."""
    m = np.arange(1, MAX_MATCH + 1)[:, None]
    column = np.arange(MAX_MATCH * width)[None, :]
    prefix = (column < m * width).astype(np.uint8)
    after = ((column >= m * width) & (column < (m + 1) * width)).astype(np.uint8) * 0xFF
    return prefix, after


@dataclass(frozen=True)
class Snapshot:
    """The corpus at one moment; never changed once built (a writer builds the next one), so a
    reader needs no lock. Sequences lie one after another in `tokens`, each followed by -1."""

    width: int  # bytes a token takes in a key
    keys: np.ndarray  # [N] sorted: the MAX_MATCH tokens before each position, nearest first
    where: np.ndarray  # [N] int32: the position in `tokens` each key precedes (a continuation start)
    tokens: np.ndarray  # [T] int32
    starts: np.ndarray  # [S] int64: where each sequence starts in `tokens`, oldest first
    numbers: np.ndarray  # [S] int64: each sequence's number, counted since the corpus was made

    @classmethod
    def empty(cls, width: int) -> Snapshot:
        return cls(
            width,
            np.zeros(0, dtype=f"S{MAX_MATCH * width}"),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
        )

    @property
    def num_tokens(self) -> int:
        """Tokens held, separators left out."""
        return len(self.tokens) - len(self.starts)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.where, self.tokens, self.starts, self.numbers))

    def added(self, sequences: list[list[int]], bound: int) -> Snapshot:
        """This corpus with `sequences` added (numbered after the newest), then its oldest
        sequences dropped until it holds at most `bound` tokens; a sequence longer than the
        bound keeps its last `bound` tokens."""
        sequences = [s[len(s) - bound :] for s in sequences if s and bound > 0]
        if not sequences:
            return self._within(bound)
        base = len(self.tokens)
        new_tokens = np.concatenate([np.asarray(s + [-1], dtype=np.int32) for s in sequences])
        ends = base + np.cumsum([len(s) + 1 for s in sequences])  # one past each separator
        starts = ends - np.asarray([len(s) + 1 for s in sequences])
        # Keys for positions 1..len(s) of each sequence: len(s) is its end, whose continuation is
        # the separator (an occurrence that stops there dilutes the vote, as in a suffix tree).
        codes, where = [], []
        for seq, start in zip(sequences, starts):
            positions = np.arange(1, len(seq) + 1)
            codes.append(preceding_codes(np.asarray(seq), positions))
            where.append(start + positions)
        new_keys = as_keys(encode(np.concatenate(codes), self.width))
        order = np.argsort(new_keys, kind="stable")
        new_keys, new_where = new_keys[order], np.concatenate(where)[order].astype(np.int32)
        at = np.searchsorted(self.keys, new_keys)
        newest = int(self.numbers[-1]) + 1 if len(self.numbers) else 0
        grown = Snapshot(
            self.width,
            np.insert(self.keys, at, new_keys),
            np.insert(self.where, at, new_where),
            np.concatenate([self.tokens, new_tokens]),
            np.concatenate([self.starts, starts.astype(np.int64)]),
            np.concatenate([self.numbers, np.arange(newest, newest + len(sequences), dtype=np.int64)]),
        )
        return grown._within(bound)

    def _within(self, bound: int) -> Snapshot:
        """The oldest sequences dropped until at most `bound` tokens are held."""
        lengths = np.diff(np.append(self.starts, len(self.tokens))) - 1
        held_after = np.cumsum(lengths[::-1])[::-1]  # tokens held from each sequence on
        drop = int(np.count_nonzero(held_after > bound))
        if drop == 0:
            return self
        cut = int(self.starts[drop]) if drop < len(self.starts) else len(self.tokens)
        kept = self.where >= cut
        return Snapshot(
            self.width,
            self.keys[kept],
            (self.where[kept] - cut).astype(np.int32),
            self.tokens[cut:],
            self.starts[drop:] - cut,
            self.numbers[drop:],
        )

    def occurrences(self, tail: list[int]) -> tuple[np.ndarray, int]:
        """The positions that continue the longest match of `tail` (the context's last tokens,
        oldest first) and its length; the most recent MAX_OCCURRENCES of them."""
        tail = tail[-MAX_MATCH:]
        if not len(self.keys) or not tail:
            return np.zeros(0, dtype=np.int64), 0
        w, width = self.width, MAX_MATCH * self.width
        query = np.zeros(width, dtype=np.uint8)  # the tail's codes, nearest first, as `encode` lays them
        query[: len(tail) * w] = np.frombuffer(
            b"".join((token + 1).to_bytes(w, "big") for token in reversed(tail)), dtype=np.uint8
        )
        # The keys starting with the query's first m tokens, for every m at once: from that prefix
        # followed by no-token units (0) to the prefix followed by an all-0xFF unit, which no key
        # holds (for m = MAX_MATCH, which leaves no room after it, the whole query, side="right").
        prefix, after = _range_masks(w)
        lows = query * prefix[: len(tail)]  # [len(tail), width]
        lows, highs = as_keys(lows), as_keys(lows | after[: len(tail)])
        lo, hi = np.searchsorted(self.keys, lows), np.searchsorted(self.keys, highs, side="right")
        found = np.flatnonzero(hi > lo)
        if not len(found):
            return np.zeros(0, dtype=np.int64), 0
        m = int(found[-1]) + 1  # the ranges nest: the longest match is the last one not empty
        occurrences = self.where[lo[m - 1] : hi[m - 1]].astype(np.int64)
        if len(occurrences) > MAX_OCCURRENCES:
            occurrences = np.partition(occurrences, -MAX_OCCURRENCES)[-MAX_OCCURRENCES:]
        return np.sort(occurrences), m

    def match(self, tail: list[int], half_life: float | None) -> Match | None:
        """The longest match of `tail` with its occurrences' votes (`weights`), or None."""
        occurrences, size = self.occurrences(tail)
        return Match(self, occurrences, self.weights(occurrences, half_life), size) if size else None

    def weights(self, occurrences: np.ndarray, half_life: float | None) -> np.ndarray:
        """Each occurrence's vote: 2^(-age / half_life), age in sequences added after its own.

        Votes are only ever compared with each other, so ages count from the newest occurrence's
        sequence, and a vote is never under the smallest positive float: past ~1075 half-lives
        2^(-age / half_life) is 0, and a vote among occurrences all that old would divide by 0."""
        if half_life is None or not len(occurrences):
            return np.ones(len(occurrences))
        numbers = self.numbers[np.searchsorted(self.starts, occurrences, side="right") - 1]
        return np.maximum(np.exp2((numbers - numbers.max()) / half_life), np.finfo(np.float64).tiny)


@dataclass
class Match:
    """The longest match of a context's last tokens in a corpus."""

    snapshot: Snapshot
    occurrences: np.ndarray  # [n] increasing: the positions that continue it
    weights: np.ndarray  # [n] each occurrence's vote
    size: int  # its length in tokens
