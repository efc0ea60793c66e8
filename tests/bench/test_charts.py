import logging

from iterserve.bench.charts import serve_charts


def _run(cap: int, tpot_ms: float) -> dict:
    return {"request_rate": "inf", "max_concurrency": cap, "output_throughput": cap * 1000 / tpot_ms,
            "median_tpot_ms": tpot_ms, "median_ttft_ms": 50.0}


def test_concurrency_knee_is_not_called_on_a_non_monotone_sweep(tmp_path, caplog):
    """TPOT that falls as concurrency grows measured something else on the machine: no knee."""
    noisy = {"label": "noisy", "runs": [_run(1, 20.0), _run(2, 40.0), _run(4, 21.0), _run(8, 22.0)]}
    with caplog.at_level(logging.WARNING, logger="iterserve.bench.charts"):
        written = serve_charts([noisy], tmp_path / "noisy")
    assert all(p.is_file() for p in written)
    assert "noisy: knee not called" in caplog.text and "concurrency=4" in caplog.text


def test_concurrency_knee_on_a_clean_sweep_says_nothing(tmp_path, caplog):
    clean = {"label": "clean", "runs": [_run(1, 20.0), _run(2, 20.5), _run(4, 21.0), _run(8, 40.0)]}
    with caplog.at_level(logging.WARNING, logger="iterserve.bench.charts"):
        serve_charts([clean], tmp_path / "clean")
    assert "knee" not in caplog.text
