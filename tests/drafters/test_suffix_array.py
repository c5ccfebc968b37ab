"""The `suffix` drafter's index (`suffix_array.py`): the bound in tokens and first-in-first-out
eviction, memory per token, key widths, and the longest match with its occurrences."""

from __future__ import annotations

import pytest

from hf_specdec.drafters.suffix_array import MAX_MATCH, Snapshot, bytes_per_token, unit_bytes

from ..helpers.suffix import corpus, held


def test_the_bound_in_tokens_holds_and_the_oldest_sequences_go_first():
    snapshot = Snapshot.empty(2)
    for n in range(10):
        snapshot = snapshot.added([[n] * 7], bound=20)
        assert snapshot.num_tokens <= 20
    assert held(snapshot) == [[8] * 7, [9] * 7]  # 21 tokens would not fit: the oldest went
    assert snapshot.numbers.tolist() == [8, 9]
    assert snapshot.occurrences([7])[1] == 0  # an evicted sequence matches nothing
    assert snapshot.occurrences([8])[1] == 1
    # Every key still points at the token it precedes.
    for key, where in zip(snapshot.keys, snapshot.where):
        assert key[:2] == bytes([0, int(snapshot.tokens[where - 1]) + 1])


def test_a_sequence_longer_than_the_bound_keeps_its_last_tokens():
    snapshot = corpus([1, 2, 3], list(range(10, 40)), bound=8)
    assert held(snapshot) == [list(range(32, 40))]


def test_memory_is_a_fixed_size_per_token():
    snapshot = corpus(*[[n, n + 1, n + 2] for n in range(6, 30)], bound=40)
    sequences = len(snapshot.starts)
    # A token's key, its key's position and the token; per sequence its separator, start and number.
    assert snapshot.nbytes == snapshot.num_tokens * bytes_per_token(1000) + sequences * (4 + 8 + 8)
    assert snapshot.num_tokens <= 40
    assert bytes_per_token(49152) == MAX_MATCH * 2 + 8 and bytes_per_token(262144) == MAX_MATCH * 3 + 8


def test_token_ids_take_two_bytes_or_three_and_larger_vocabularies_are_refused():
    assert unit_bytes(49152) == 2 and unit_bytes(65533) == 2 and unit_bytes(65534) == 3
    assert unit_bytes(262144) == 3
    with pytest.raises(ValueError, match="method='ngram'"):
        unit_bytes(1 << 24)
    wide = Snapshot.empty(3).added([[70000, 5, 70000, 6]], 100)  # ids past two bytes match as well
    assert wide.occurrences([9, 70000])[1] == 1 and wide.tokens[wide.occurrences([70000])[0]].tolist() == [
        5,
        6,
    ]


def test_the_longest_match_is_found_with_its_occurrences():
    snapshot = corpus([5, 6, 7, 8, 9], [1, 5, 6, 7, 3], [6, 7, 4])
    occurrences, size = snapshot.occurrences([0, 5, 6, 7])
    assert size == 3 and snapshot.tokens[occurrences].tolist() == [8, 3]  # "5 6 7" twice; "0" never
    occurrences, size = snapshot.occurrences([2, 6, 7])
    assert size == 2 and sorted(snapshot.tokens[occurrences].tolist()) == [3, 4, 8]
    assert snapshot.occurrences([42])[1] == 0
    long = list(range(100, 130))  # a match longer than the keys: MAX_MATCH tokens of it count
    assert corpus(long + [1]).occurrences(long)[1] == MAX_MATCH
