"""Prometheus metrics for one server under vLLM's names, buckets and labels (``model_name``, ``engine``),
so dashboards and alerts written for vLLM read iterserve unchanged; see
https://github.com/vllm-project/vllm/blob/main/vllm/v1/metrics/loggers.py. Series vLLM has no
counterpart for are named ``iterserve:``.

Each app owns a private CollectorRegistry, so several apps can live in one process (tests do).
Engine-derived values come from the counters the core sends with every step
(:class:`iterserve.engine.messages.SchedulerStats`); request histograms from finished outputs. With
data-parallel replicas every series has one child per replica (``engine="0"``, ``"1"``, ...), as
vLLM labels its data-parallel engines; a query sums over ``engine`` for the server's total.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.engine.messages import LoadedWeights, SchedulerStats
from iterserve.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")

# Core counters mirrored as Prometheus counters: SchedulerStats field -> (name, help).
_CORE_COUNTERS = {
    "num_preemptions": ("vllm:num_preemptions", "Sequences preempted to free KV cache blocks."),
    "num_prompt_tokens": ("vllm:prompt_tokens", "Prompt tokens computed in prefill (prefix-cache hits excluded)."),
    "num_generation_tokens": ("vllm:generation_tokens", "Tokens generated."),
    "prefix_query_tokens": ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_hit_tokens": ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."),
}

# KV-cache events' counter (only where the cores publish events); vLLM has no such series.
_KV_EVENT_COUNTERS = {
    "kv_events_dropped": ("iterserve:kv_events_dropped", "KV-cache events dropped because the publisher's queue "
                          "was full (--kv-events-config max_queue_size)."),
}


# Speculative decoding's counters (only where it is configured, as vLLM registers them).
_SPEC_COUNTERS = {
    "spec_num_drafts": ("vllm:spec_decode_num_drafts", "Draft proposals verified (one per sequence per step)."),
    "spec_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified."),
    "spec_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


# The weights a core holds, by storage format (one child per format, set when the core is ready): LoadedWeights
# field -> (name, help). vLLM has no such series.
_WEIGHT_GAUGES = {
    "bytes": ("iterserve:weight_bytes", "Bytes of the loaded weights in each storage format (under tensor "
              "parallelism, rank 0's shard)."),
    "tensors": ("iterserve:weight_tensors", "Weight tensors loaded in each storage format."),
}


def count_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets for token counts, up to ``max_value``: 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, num_engines: int = 1,
                 num_speculative_tokens: int = 0, kv_events: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._labels = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        names = ["model_name", "engine"]
        counts = count_buckets(max_model_len)

        families: list[Gauge | Counter | Histogram] = []  # each gets a child per engine below

        def gauge(name: str, doc: str) -> Gauge:
            g = Gauge(name, doc, names, registry=self.registry)
            families.append(g)
            return g

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name, doc, names, buckets=buckets, registry=self.registry)
            families.append(h)
            return h

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for the scheduler (or on their way).")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 is all).")
        # vLLM's name before 0.9, still queried by its published Grafana dashboard
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of KV cache blocks in use (1 is all). "
                                     "Older name of vllm:kv_cache_usage_perc.")
        self._weights = {field: Gauge(name, doc, [*names, "format"], registry=self.registry)
                         for field, (name, doc) in _WEIGHT_GAUGES.items()}
        self.prefix_hit_rate = gauge("iterserve:prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens looked up.")
        self._counters = {
            field: Counter(name, doc, names, registry=self.registry) for field, (name, doc) in _CORE_COUNTERS.items()
        }
        self._request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", [*names, "finished_reason"],
            registry=self.registry,
        )
        self._restarts = Counter("iterserve:engine_restarts", "Engine cores started in place of one that died.",
                                 names, registry=self.registry)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request.", counts)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Tokens generated by each finished "
                                           "request.", counts)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens", "Most tokens generated by "
                                               "one sequence of each finished request.", counts)
        self.max_tokens_param = histogram("vllm:request_params_max_tokens", "max_tokens of each admitted request "
                                          "(resolved against max_model_len).", counts)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gaps between a request's consecutive tokens.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Gaps between a request's consecutive tokens "
                              "(vLLM's older name of vllm:inter_token_latency_seconds).", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        optional = {**(_SPEC_COUNTERS if num_speculative_tokens else {}), **(_KV_EVENT_COUNTERS if kv_events else {})}
        self._counters.update({field: Counter(name, doc, names, registry=self.registry)
                               for field, (name, doc) in optional.items()})
        self._accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the proposal.",
            [*names, "position"], registry=self.registry) if num_speculative_tokens else None
        self._num_positions = num_speculative_tokens
        self._last = [dict.fromkeys(self._counters, 0) for _ in self._labels]  # each core starts from zero
        self._last_per_pos = [[0] * num_speculative_tokens for _ in self._labels]
        self._last_step = [0 for _ in self._labels]
        for labels in self._labels:  # every engine's series is there from the start, at zero
            for family in [*families, self._restarts, *self._counters.values()]:
                family.labels(**labels)
            for reason in FINISH_REASONS:
                self._request_success.labels(**labels, finished_reason=reason)
            if self._accepted_per_pos is not None:
                for pos in range(self._num_positions):
                    self._accepted_per_pos.labels(**labels, position=str(pos))

    _lora_info: Gauge | None = None  # vllm:lora_requests_info, where the server runs LoRA adapters

    def record_lora_info(self, max_loras: int) -> None:
        """Publish vLLM's ``vllm:lora_requests_info``: one series whose labels name the running and waiting
        adapters (comma-separated, over every engine) and ``max_lora``, its value when they were last seen."""
        self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        self._max_loras = str(max_loras)
        self._loras: list[tuple[list[str], list[str]]] = [([], []) for _ in self._labels]
        self._lora_info.labels(self._max_loras, "", "").set(time.time())

    def _record_loras(self, engine: int, stats: SchedulerStats) -> None:
        assert self._lora_info is not None
        self._loras[engine] = (stats.waiting_loras, stats.running_loras)
        waiting = sorted({name for w, _ in self._loras for name in w})
        running = sorted({name for _, r in self._loras for name in r})
        self._lora_info.clear()  # one series, the adapters of now: a series per past set would grow without end
        self._lora_info.labels(self._max_loras, ",".join(waiting), ",".join(running)).set(time.time())

    def record_stats(self, engine: int, stats: SchedulerStats, num_waiting: int) -> None:
        """Refresh the engine's gauges and counters from its core's latest stats."""
        labels, last = self._labels[engine], self._last[engine]
        if self._lora_info is not None:
            self._record_loras(engine, stats)
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(num_waiting)
        self.kv_cache_usage.labels(**labels).set(stats.kv_cache_usage)
        self.gpu_cache_usage.labels(**labels).set(stats.kv_cache_usage)
        if stats.prefix_query_tokens:
            self.prefix_hit_rate.labels(**labels).set(stats.prefix_hit_tokens / stats.prefix_query_tokens)
        for field, counter in self._counters.items():
            value = getattr(stats, field)
            counter.labels(**labels).inc(value - last[field])
            last[field] = value
        if self._accepted_per_pos is not None:
            seen = self._last_per_pos[engine]
            for pos, value in enumerate(stats.spec_accepted_per_pos[:self._num_positions]):
                self._accepted_per_pos.labels(**labels, position=str(pos)).inc(value - seen[pos])
                seen[pos] = value
        if stats.num_steps > self._last_step[engine]:  # stats also arrive between steps, repeating the last one's
            self.iteration_tokens.labels(**labels).observe(stats.step_tokens)
            self._last_step[engine] = stats.num_steps

    def record_weights(self, engine: int, weights: list[LoadedWeights]) -> None:
        """The weights a core holds, by format (once, as it reports ready)."""
        for w in weights:
            for field, g in self._weights.items():
                g.labels(**self._labels[engine], format=w.format).set(getattr(w, field))

    def record_admitted(self, engine: int, max_tokens: int) -> None:
        self.max_tokens_param.labels(**self._labels[engine]).observe(max_tokens)

    def record_finished(self, engine: int, output: RequestOutput) -> None:
        m, labels = output.metrics, self._labels[engine]
        self.prompt_tokens.labels(**labels).observe(len(output.prompt_token_ids))
        self.generation_tokens.labels(**labels).observe(sum(len(c.token_ids) for c in output.outputs))
        self.max_generation_tokens.labels(**labels).observe(max(len(c.token_ids) for c in output.outputs))
        itl, tpot = self.itl.labels(**labels), self.tpot.labels(**labels)
        for gap in m.itl:
            itl.observe(gap)
            tpot.observe(gap)
        last_token = m.token_times[-1] if m.token_times else None
        spans = (
            (self.ttft, m.arrival_time, m.first_token_time),
            (self.e2e, m.arrival_time, m.finished_time),
            (self.queue_time, m.arrival_time, m.first_scheduled_time),
            (self.inference_time, m.first_scheduled_time, last_token),
            (self.prefill_time, m.first_scheduled_time, m.first_token_time),
            (self.decode_time, m.first_token_time, last_token),
        )
        for histogram, start, end in spans:
            if start is not None and end is not None:
                histogram.labels(**labels).observe(end - start)
        self.record_finish_reason(engine, output.outputs[0].finish_reason or "abort")

    def record_restart(self, engine: int) -> None:
        """A new core process for ``engine``: its counters start again from zero."""
        self._restarts.labels(**self._labels[engine]).inc()
        self._last[engine] = dict.fromkeys(self._counters, 0)
        self._last_per_pos[engine] = [0] * self._num_positions
        self._last_step[engine] = 0

    def record_finish_reason(self, engine: int, reason: str) -> None:
        self._request_success.labels(**self._labels[engine], finished_reason=reason).inc()

    def record_cache_config(self, info: dict[str, str]) -> None:
        """vLLM's ``vllm:cache_config_info``: the KV cache's settings as labels of a gauge set to 1, one child
        per engine; with model_name too, as every series here, which dashboards' model variable lists."""
        g = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                  [*info, "model_name", "engine"], registry=self.registry)
        for labels in self._labels:
            g.labels(**info, **labels).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
