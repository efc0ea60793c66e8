"""/metrics under vLLM's names: every series vLLM's published Grafana dashboard queries is there, with
the model_name label its panels select on, and holds what one request did."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from iterserve.server.metrics import count_buckets
from tests.server.conftest import MODEL, TINY_MODEL, ServerThread, speculating_server, wait_until_idle

DASHBOARD = Path(__file__).parent / "data" / "vllm_grafana_queries.json"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers followed by a label matcher."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values could hold anything
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", expr))


def test_metric_names_parses_promql():
    expr = 'rate(a:x_sum{model_name="$m"}[$__rate_interval])\n/\nrate(a:x_count{model_name="{b}"}[5m])'
    assert metric_names(expr) == {"a:x_sum", "a:x_count"}
    assert metric_names('sum by(le) (increase(a:y_bucket{m="1"}[1m]))') == {"a:y_bucket"}


def test_count_buckets_are_vllms():
    assert count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert count_buckets(256)[-1] == 200


def test_every_series_vllms_dashboard_queries_is_served():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len(panels) == 12
    queried = {name for exprs in panels.values() for e in exprs for name in metric_names(e)}
    assert len(queried) >= 18 and all(n.startswith("vllm:") for n in queried)

    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=64, max_model_len=256)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL, max_waiting=8))) as s:
        prompt = [1, 2, 3, 4, 5, 6, 7]
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        wait_until_idle(s)
        text = httpx.get(f"{s.url}/metrics").text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    # the panels select {model_name="$model_name"}; the variable lists model_name of every vllm:* series
    served = {s.name for s in samples if s.labels.get("model_name") == MODEL}
    assert not queried - served, f"series the dashboard queries but /metrics lacks: {sorted(queried - served)}"
    assert all(s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0"
               for s in samples if s.name.startswith("vllm:"))

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    # what one 7-token prompt generating 4 tokens did, step by step: prefill + 3 decodes
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_prompt_tokens_sum") == 7 and value("vllm:request_prompt_tokens_count") == 1
    assert value("vllm:request_generation_tokens_sum") == 4
    assert value("vllm:request_max_num_generation_tokens_sum") == 4
    assert value("vllm:request_params_max_tokens_sum") == 4
    assert value("vllm:prompt_tokens_total") == 7 and value("vllm:generation_tokens_total") == 4
    assert value("vllm:iteration_tokens_total_count") == 4 and value("vllm:iteration_tokens_total_sum") == 7 + 3
    assert value("vllm:time_per_output_token_seconds_count") == value("vllm:inter_token_latency_seconds_count") == 3
    assert value("vllm:time_to_first_token_seconds_count") == value("vllm:e2e_request_latency_seconds_count") == 1
    for part in ("queue", "prefill", "decode", "inference"):
        assert value(f"vllm:request_{part}_time_seconds_count") == 1
    assert value("vllm:request_prefill_time_seconds_sum") + value("vllm:request_decode_time_seconds_sum") \
        <= value("vllm:e2e_request_latency_seconds_sum")
    assert value("vllm:prefix_cache_queries_total") >= 7
    assert value("vllm:num_requests_running") == value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:gpu_cache_usage_perc") == 0 and value("vllm:num_preemptions_total") == 0
    # one home per series: only what vLLM has no name for stays under iterserve:
    assert {s.name for s in samples if s.name.startswith("iterserve:")} == {
        "iterserve:prefix_cache_hit_rate", "iterserve:weight_bytes", "iterserve:weight_tensors",
        "iterserve:engine_restarts_total", "iterserve:engine_restarts_created"}
    assert value("iterserve:engine_restarts_total") == 0
    assert not any(s.name.startswith("vllm:spec_decode") for s in samples)  # registered only with speculation


def test_speculative_decoding_counters_under_vllms_names():
    with speculating_server() as s:
        text = httpx.get(f"{s.url}/metrics").text
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    drafts, drafted = value("vllm:spec_decode_num_drafts_total"), value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert {s.labels["position"] for s in samples if "per_pos" in s.name} == {"0", "1", "2"}
    assert 0 < drafts <= drafted <= 3 * drafts and 0 <= accepted <= drafted
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert value("vllm:generation_tokens_total") == 40
    # each verification pass yields its accepted drafts plus one token: fewer steps than tokens
    assert value("vllm:iteration_tokens_total_count") == 40 - accepted
