"""What routers probe on a worker (sglang-router's server and model info, vllm-router's render and KV-event
sources, SGLang's generating health check, vLLM's cache_config_info gauge), answered with this server's
real values."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL, metric_samples

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers=AUTH, timeout=60)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_has_sglangs_fields_with_real_values(server, path):
    r = get(server, path)
    assert r.status_code == 200, r.text
    info = r.json()
    engine = server.engine
    assert info["model_id"] == info["served_model_name"] == MODEL and "model" not in info  # serde: model aliases it
    assert info["model_path"] == engine.config.model
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["max_total_tokens"] == engine.capacity.total_tokens and info["context_length"] == MAX_MODEL_LEN
    assert info["max_running_requests"] == engine.config.max_num_seqs
    assert info["max_prefill_tokens"] == engine.config.max_num_batched_tokens
    assert info["page_size"] == engine.capacity.block_size
    # vllm-router's kv_aware discovery reads the block size under these names, and refuses a body that also
    # has "block_size" (its alias of kv_block_size: a duplicate field)
    assert info["kv_block_size"] == info["effective_attention_block_size"] == engine.capacity.block_size
    assert "block_size" not in info
    assert info["kv_events"] == []  # the server fixture publishes none


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_has_sglangs_fields_with_real_values(server, path):
    info = get(server, path).json()
    assert info["model_path"] == server.engine.config.model and info["is_generation"] is True
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["max_context_length"] == MAX_MODEL_LEN and info["vocab_size"] == 49152


def test_chat_render_is_the_prompt_the_engine_would_get(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 7, "temperature": 0.5}
    r = httpx.post(f"{server.url}/v1/chat/completions/render", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    rendered = r.json()
    tokenized = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": MESSAGES}, timeout=60).json()
    assert rendered["token_ids"] == tokenized["tokens"] and rendered["model"] == MODEL
    assert rendered["sampling_params"]["max_tokens"] == 7 and rendered["sampling_params"]["temperature"] == 0.5
    done = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={**body, "max_tokens": 1}, timeout=60)
    assert done.json()["usage"]["prompt_tokens"] == len(rendered["token_ids"])


def test_completion_render_gives_each_prompts_token_ids(server):
    body = {"model": MODEL, "prompt": ["Hello world", "Goodbye"], "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions/render", headers=AUTH, json=body, timeout=60)
    assert r.status_code == 200, r.text
    first, second = r.json()
    for rendered, text in ((first, "Hello world"), (second, "Goodbye")):
        expected = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": text}, timeout=60).json()
        assert rendered["token_ids"] == expected["tokens"]
    ids = [5, 6, 7]
    r = httpx.post(f"{server.url}/v1/completions/render", headers=AUTH, json={"prompt": ids}, timeout=60)
    assert [g["token_ids"] for g in r.json()] == [ids]
    assert first["request_id"] != second["request_id"] and first["sampling_params"]["max_tokens"] == 3


def test_chat_render_refuses_what_the_request_would_be_refused(server):
    r = httpx.post(f"{server.url}/v1/chat/completions/render", headers=AUTH,
                   json={"model": "other", "messages": MESSAGES}, timeout=60)
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/v1/chat/completions/render", headers=AUTH, json={"messages": []}, timeout=60)
    assert r.status_code == 400


def test_kv_event_sources_is_empty_without_events(server):
    r = get(server, "/kv_event_sources")
    assert r.status_code == 200 and r.json() == {}


def test_health_generate_makes_a_token(server):
    r = get(server, "/health_generate")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok"


def test_cache_config_info_has_vllms_labels(server):
    infos = [labels for (name, labels) in metric_samples(server) if name == "vllm:cache_config_info"]
    assert len(infos) == 1
    labels = dict(infos[0])
    assert labels["block_size"] == str(server.engine.capacity.block_size)
    assert labels["num_gpu_blocks"] == str(server.engine.capacity.num_blocks) == "256"
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "float32"


def test_an_http2_preface_gets_505_not_404(server):
    # sglang-router opens every worker it registers with HTTP/2's prior-knowledge preface (its gRPC check)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        status_line = conn.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"505", status_line
    assert get(server, "/health").status_code == 200
