"""Serving metrics on hand-made timelines: every number below is worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from iterserve.bench.metrics import (
    RequestResult,
    compute_metrics,
    is_good,
    parse_goodput,
    parse_percentiles,
    percentile_key,
)
from iterserve.bench.serve import arrival_offsets

# r1: first token at 100 ms, then gaps of 10, 20, 30 and 240 ms: 5 tokens, done at 400 ms.
R1 = RequestResult(prompt_len=10, output_len=5, ttft=0.1, itl=[0.01, 0.02, 0.03, 0.24], latency=0.4, success=True)
# r2: a single token at 200 ms (no TPOT).
R2 = RequestResult(prompt_len=20, output_len=1, ttft=0.2, latency=0.2, success=True)
# r3: failed; counts toward the per-request lists only.
R3 = RequestResult(prompt_len=7, error="HTTP 500: boom")


def test_tpot_excludes_the_first_token():
    assert R1.tpot == pytest.approx((0.4 - 0.1) / 4)  # 75 ms
    assert R2.tpot is None


def test_run_metrics_on_a_hand_made_timeline():
    m = compute_metrics([R1, R2, R3], duration=2.0, percentiles=[90, 99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["request_goodput"] is None
    # TTFT over completed requests: 100 and 200 ms; numpy's linear percentiles.
    assert m["mean_ttft_ms"] == pytest.approx(150)
    assert m["median_ttft_ms"] == pytest.approx(150)
    assert m["std_ttft_ms"] == pytest.approx(50)
    assert m["p90_ttft_ms"] == pytest.approx(190)
    assert m["p99_ttft_ms"] == pytest.approx(199)
    # TPOT only from r1.
    assert m["mean_tpot_ms"] == m["median_tpot_ms"] == m["p99_tpot_ms"] == pytest.approx(75)
    assert m["std_tpot_ms"] == pytest.approx(0)
    # ITL pools every gap: 10, 20, 30, 240 ms.
    assert m["mean_itl_ms"] == pytest.approx(75)
    assert m["median_itl_ms"] == pytest.approx(25)
    assert m["p90_itl_ms"] == pytest.approx(30 + 0.7 * 210)
    assert m["p99_itl_ms"] == pytest.approx(30 + 0.97 * 210)
    assert m["mean_e2el_ms"] == pytest.approx(300)
    assert m["p90_e2el_ms"] == pytest.approx(380)
    # per-request lists in vLLM's shape, failures included
    assert m["input_lens"] == [10, 20, 7]
    assert m["output_lens"] == [5, 1, 0]
    assert m["ttfts"] == [0.1, 0.2, 0.0]
    assert m["itls"] == [R1.itl, [], []]
    assert m["errors"] == ["", "", "HTTP 500: boom"]


def test_goodput_counts_requests_within_every_slo():
    # r1: TTFT 100, TPOT 75, E2EL 400; r2: TTFT 200, TPOT 0 (one token), E2EL 200
    assert compute_metrics([R1, R2], 2.0, goodput={"ttft": 150, "tpot": 80})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics([R1, R2], 2.0, goodput={"tpot": 50})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics([R1, R2], 2.0, goodput={"ttft": 200, "e2el": 400})["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics([R1, R2, R3], 2.0, goodput={"e2el": 100})["request_goodput"] == 0.0
    assert is_good(R1, {"ttft": 100}) and not is_good(R1, {"ttft": 99.9})


def test_field_names_follow_vllm():
    m = compute_metrics([R1], 1.0, percentiles=[50, 99.9])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{name}_ms" in m
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_no_completed_request_gives_zeros_not_errors():
    m = compute_metrics([R3], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_parse_percentiles_and_goodput():
    assert parse_percentiles("90, 99,99.9") == [90.0, 99.0, 99.9]
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in ("", "0", "101", "x"):
        with pytest.raises(ValueError, match="percentiles"):
            parse_percentiles(bad)
    for bad in ("itl:5", "ttft", "ttft:-1", "ttft:fast"):
        with pytest.raises(ValueError, match="METRIC:MILLISECONDS"):
            parse_goodput([bad])
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([R1], 0.0)


def test_arrivals_poisson_and_gamma():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    a = arrival_offsets(4000, 4.0, 1.0, 0)
    assert a == arrival_offsets(4000, 4.0, 1.0, 0) and a != arrival_offsets(4000, 4.0, 1.0, 1)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.06)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0, rel=0.1)  # exponential: CV^2 = 1
    bursty = np.diff(arrival_offsets(4000, 4.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)  # gamma: CV^2 = 1 / burstiness
    with pytest.raises(ValueError, match="positive"):
        arrival_offsets(3, 0.0, 1.0, 0)
