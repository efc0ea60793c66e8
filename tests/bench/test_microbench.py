from __future__ import annotations

import itertools

from iterserve.bench import microbench


def test_median_seconds_warms_up_once_and_takes_the_median(monkeypatch):
    calls = []
    # perf_counter pairs around each timed call: durations 5, 1, 3 seconds.
    clock = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])
    monkeypatch.setattr(microbench.time, "perf_counter", lambda: next(clock))
    assert microbench.median_seconds(lambda: calls.append(1), 3) == 3.0
    assert len(calls) == 4  # the warm-up call is not timed


def test_streaming_read_is_the_bytes_summed_over_the_median_time(monkeypatch):
    clock = itertools.count(step=0.5)  # every timed sum takes half a second
    monkeypatch.setattr(microbench.time, "perf_counter", lambda: next(clock))
    assert microbench.streaming_read_gbs(repeats=3) == 512 * 2**20 / 0.5 / 1e9
