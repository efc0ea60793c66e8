"""A server with --kv-events-config: its engine core process publishes vLLM's KV events, /kv_event_sources
lists the publisher, and /metrics counts dropped events."""

from __future__ import annotations

import httpx
import zmq

from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.block_manager import chain_hash
from iterserve.engine.kv_events import external_hash
from iterserve.server import build_app
from iterserve.server.serving_discovery import _reachable
from tests.engine import kv_event_schema as vllm
from tests.server.conftest import MODEL, TINY_MODEL, ServerThread, metric_samples, wait_until_idle


def test_the_core_process_publishes_and_the_server_lists_the_publisher():
    ctx = zmq.Context()
    sub, endpoint = vllm.subscriber(ctx)
    events = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "w0"}
    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=16,
                          kv_events_config=events)
    try:
        with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL))) as s:
            source = {"data_parallel_rank": 0, "endpoint": endpoint, "replay_endpoint": None, "topic": "w0"}
            # keyed by rank, with the publisher's settings: the body vllm-router's discovery deserializes
            assert httpx.get(f"{s.url}/kv_event_sources").json() == {
                "0": {**source, "publisher": "zmq", "enable_kv_cache_events": True, "hwm": 100_000,
                      "buffer_steps": 10_000}}
            assert httpx.get(f"{s.url}/server_info").json()["kv_events"] == [source]
            prompt = list(range(1, 41))  # two full blocks of 16
            stored = []
            for _ in range(20):  # the first batches may go before the subscription reaches the publisher
                r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                while (message := vllm.receive(sub, 500)) is not None:
                    stored += [e for e in message[2].events if isinstance(e, vllm.BlockStored)]
                if stored:
                    break
                prompt = [t + 100 for t in prompt]  # a new prompt: its blocks are stored again
            assert stored and stored[0].token_ids == prompt[:32] and stored[0].parent_block_hash is None
            first = chain_hash(None, tuple(prompt[:16]))
            assert stored[0].block_hashes == [external_hash(first), external_hash(chain_hash(first,
                                                                                              tuple(prompt[16:32])))]
            assert metric_samples(s)[("iterserve:kv_events_dropped_total", ())] == 0
            assert_reset_clears_the_cache(s, sub, prompt)
    finally:
        ctx.destroy(linger=0)


def completion(s: ServerThread, prompt: list[int]) -> dict:
    r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def assert_reset_clears_the_cache(s: ServerThread, sub: zmq.Socket, prompt: list[int]) -> None:
    """POST /reset_prefix_cache: 200, AllBlocksCleared published, and the same prompt again hits nothing."""
    assert completion(s, prompt)["prompt_tokens_details"]["cached_tokens"] == 32  # cached before the reset
    r = httpx.post(f"{s.url}/reset_prefix_cache", timeout=10)
    assert r.status_code == 200, r.text
    cleared = []
    while not cleared and (message := vllm.receive(sub, 5000)) is not None:
        cleared += [e for e in message[2].events if isinstance(e, vllm.AllBlocksCleared)]
    assert cleared
    assert completion(s, prompt)["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.post(f"{s.url}/flush_cache", timeout=10).status_code == 200  # SGLang's name, no body either
    wait_until_idle(s)  # no request and no block held: nothing leaked


def test_a_wildcard_bind_is_listed_as_the_host_the_client_used():
    assert _reachable("tcp://*:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert _reachable("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert _reachable("tcp://10.0.0.9:5557", "other") == "tcp://10.0.0.9:5557"
    assert _reachable("tcp://*:5557", None) == "tcp://*:5557" and _reachable(None, "h") is None
