"""The `ngram` drafter's index as it was before the prompt was indexed in one vectorised pass: one
Python dict entry per n-gram of every position. The property tests check that the index answers
every look-up exactly as this one does."""

from __future__ import annotations

from hf_specdec.drafters.ngram import ALL, ONE, SPLIT


class ReferenceNgramIndex:
    """N-gram → positions after its latest occurrences (most recent last), for one row's tokens."""

    def __init__(self, sizes: range, keep: int) -> None:
        self.sizes = sizes
        self.keep = keep  # occurrences remembered per n-gram (trees branch over them)
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.tokens: list[int] = []
        self.indexed = 0  # continuation positions already indexed
        self.padding = 0  # left padding before the row's prompt, never indexed
        self.last_trie: tuple[list[int], list[int]] | None = None  # tokens, parents of the last trie

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        # Index every n-gram that now has a continuation: ending at position j < len(tokens).
        toks = self.tokens
        for j in range(max(self.indexed, 1), len(toks)):
            for n in self.sizes:
                if j >= n:
                    starts = self.tables[n].setdefault(tuple(toks[j - n : j]), [])
                    starts.append(j)
                    if len(starts) > self.keep:
                        del starts[0]
        self.indexed = max(self.indexed, len(toks))

    def lookup(self, max_tokens: int) -> tuple[list[int], int, list[str]]:
        """The continuation voted among the occurrences of the longest matching suffix (module
        docstring), that suffix's size, and how the occurrences agreed on each token (`ONE`,
        `ALL`, `SPLIT`)."""
        toks = self.tokens
        for n in reversed(self.sizes):
            starts = self.tables[n].get(tuple(toks[-n:])) if len(toks) > n else None
            if not starts:
                continue
            continuation: list[int] = []
            agreement: list[str] = []
            while len(continuation) < max_tokens:
                if len(starts) == 1:  # one occurrence left: the rest is a copy, nothing to vote on
                    start = starts[0]
                    copied = toks[start : start + max_tokens - len(continuation)]
                    continuation += copied
                    agreement += [ONE] * len(copied)
                    break
                votes: dict[int, list[int]] = {}  # next token -> its occurrences, oldest first
                for start in starts:
                    if start < len(toks):
                        votes.setdefault(toks[start], []).append(start)
                if not votes:
                    break
                token = max(votes, key=lambda t: (len(votes[t]), votes[t][-1]))
                continuation.append(token)
                voters = sum(map(len, votes.values()))
                agreement.append(ONE if voters == 1 else ALL if len(votes) == 1 else SPLIT)
                starts = [start + 1 for start in votes[token]]
            return continuation, n, agreement
        return [], 0, []

    def matches(self, max_tokens: int) -> list[tuple[list[int], int]]:
        """Continuations of every remembered match of the current suffix, longest suffix first,
        then most recent first, each with the size of its match."""
        toks, found = self.tokens, []
        for n in reversed(self.sizes):
            if len(toks) <= n:
                continue
            for start in reversed(self.tables[n].get(tuple(toks[-n:]), [])):
                found.append((toks[start : start + max_tokens], n))
        return found
