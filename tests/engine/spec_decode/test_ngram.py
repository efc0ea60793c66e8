"""N-gram lookup: the longest suffix that occurred before, its first occurrence, at most k tokens after it."""

from __future__ import annotations

import numpy as np

from iterserve.engine.spec_decode.ngram import ngram_lookup


def lookup(tokens, min_n=1, max_n=3, k=4):
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), min_n, max_n, k)


def test_proposes_what_followed_the_suffix_before():
    assert lookup([1, 2, 3, 4, 2, 3], min_n=2) == [4, 2, 3]  # fewer than k follow the match
    assert lookup([5, 6, 7, 8, 9, 5, 6], k=2) == [7, 8]


def test_prefers_the_longest_suffix_then_its_first_occurrence():
    # suffix [1, 2] occurred twice, followed by 9 then 8: the first has the most tokens after it
    assert lookup([1, 2, 9, 1, 2, 8, 1, 2], max_n=2, k=2) == [9, 1]
    # the 1-gram [3] first occurred before 5, but the 2-gram [4, 3] matches, before 7
    assert lookup([3, 5, 4, 3, 7, 4, 3], max_n=2, k=1) == [7]
    # in a run of repeats the first occurrence leaves k tokens to propose, the latest only one
    assert lookup([6, 6, 6, 6, 6, 6], max_n=2, k=3) == [6, 6, 6]


def test_nothing_when_no_suffix_of_min_n_occurred():
    assert lookup([1, 2, 3, 4, 5]) == []
    assert lookup([1, 2, 3, 1], min_n=2) == []  # the 1-gram [1] would match, but 2 are required
    assert lookup([7]) == []
    assert lookup([1, 2, 1, 2], k=0) == []


def windows_lookup(tokens, min_n, max_n, k):
    """The definition, spelled out: every earlier window of each length from the longest down."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_agrees_with_comparing_every_window():
    rng = np.random.default_rng(0)
    for _ in range(500):
        vocab = int(rng.integers(2, 6))  # few distinct tokens: long and repeated matches
        tokens = rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(0, 6))
        assert lookup(tokens, min_n, max_n, k) == windows_lookup(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
