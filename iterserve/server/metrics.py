"""Prometheus metrics for one server, named like vLLM's (``iterserve:`` for ``vllm:``).

Each app owns a private CollectorRegistry, so several apps can live in one process (tests do).
Engine-derived values come from the counters the core sends with every step
(:class:`iterserve.engine.messages.SchedulerStats`); request histograms from finished outputs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.engine.messages import SchedulerStats
from iterserve.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)

# Core counters mirrored as Prometheus counters: SchedulerStats field -> metric name.
_CORE_COUNTERS = {
    "num_preemptions": ("iterserve:num_preemptions", "Sequences preempted to free KV cache blocks."),
    "num_prompt_tokens": ("iterserve:prompt_tokens", "Prompt tokens computed in prefill (prefix-cache hits excluded)."),
    "num_generation_tokens": ("iterserve:generation_tokens", "Tokens generated."),
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.running = gauge("iterserve:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("iterserve:num_requests_waiting", "Requests waiting for the scheduler (or on their way).")
        self.kv_cache_usage = gauge("iterserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.prefix_hit_rate = gauge(
            "iterserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up."
        )
        self._counters = {
            field: Counter(name, doc, names, registry=self.registry).labels(**labels)
            for field, (name, doc) in _CORE_COUNTERS.items()
        }
        self._request_success = Counter(
            "iterserve:request_success", "Finished requests by finish reason.", [*names, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self.ttft = histogram("iterserve:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram("iterserve:time_per_output_token_seconds", "Mean time per token after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("iterserve:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("iterserve:request_queue_time_seconds", "Arrival to first scheduled.",
                                    LATENCY_BUCKETS)
        self._last = dict.fromkeys(_CORE_COUNTERS, 0)  # each app's core starts from zero
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(**labels, finished_reason=reason)

    def record_stats(self, stats: SchedulerStats, num_waiting: int) -> None:
        """Refresh gauges and counters from the core's latest stats."""
        self.running.set(stats.num_running)
        self.waiting.set(num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.prefix_query_tokens:
            self.prefix_hit_rate.set(stats.prefix_hit_tokens / stats.prefix_query_tokens)
        for field, counter in self._counters.items():
            value = getattr(stats, field)
            counter.inc(value - self._last[field])
            self._last[field] = value

    def record_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e_latency),
                                 (self.queue_time, m.queue_time)):
            if value is not None:
                histogram.observe(value)
        self.record_finish_reason(output.outputs[0].finish_reason or "abort")

    def record_finish_reason(self, reason: str) -> None:
        self._request_success.labels(**self._labels, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
