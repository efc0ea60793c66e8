"""What runs beside a hostile request: /health polled from a thread, and a streaming completion whose
token gaps are timed, so that a test can assert that the server kept serving everyone else."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

# Generous for a loaded two-core machine; the stalls these probes caught lasted 6 to 44 s.
HEALTH_BOUND_S = 2.0
STREAM_GAP_BOUND_S = 4.0


class HealthProbe:
    """Polls /health from another thread while the block runs; ``worst`` is the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    r = c.get("/health")
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    @property
    def worst(self) -> float:
        assert self.latencies, "/health was never answered"
        return max(self.latencies)


class StreamProbe:
    """A long streaming completion read from another thread; ``worst_gap`` is the longest wait between
    two of its chunks (or since the last one) while the block ran. The request is aborted on exit."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, max_tokens: int = 1500) -> None:
        self.url = url
        self.headers = headers or {}
        self.body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.times: list[float] = []
        self.error: str | None = None
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._start = self._end = 0.0

    def _run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, headers=self.headers,
                              timeout=120) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read().decode()}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.perf_counter())
                        self._started.set()
                    if self._stop.is_set() or line == "data: [DONE]":
                        return
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self._started.set()

    def __enter__(self) -> StreamProbe:
        self._thread.start()
        assert self._started.wait(120) and self.error is None, f"the probe stream did not start: {self.error}"
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = time.perf_counter()
        self._stop.set()
        self._thread.join(120)

    @property
    def worst_gap(self) -> float:
        during = [t for t in self.times if self._start <= t <= self._end]
        marks = [self._start, *during, self._end]
        return max(b - a for a, b in zip(marks, marks[1:]))


@contextmanager
def others_served(url: str, headers: dict[str, str] | None = None) -> Iterator[None]:
    """Assert that while the block runs /health keeps answering 200 quickly and a concurrent stream keeps
    getting tokens."""
    with HealthProbe(url) as health, StreamProbe(url, headers) as stream:
        yield
        time.sleep(0.2)
    assert not health.failures, health.failures[:3]
    assert health.worst < HEALTH_BOUND_S, f"/health took {health.worst:.1f} s"
    assert stream.error is None, stream.error
    assert stream.worst_gap < STREAM_GAP_BOUND_S, f"the concurrent stream stalled {stream.worst_gap:.1f} s"
