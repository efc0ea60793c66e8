"""The HTTP server end to end on SmolLM2-135M: the official openai client, greedy outputs equal to
offline runs, batching across connections, disconnects freeing KV blocks, API keys, graceful
shutdown, and bad input that only ever gets a 4xx. Engine faults and admission: test_engine_process.py."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import re

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import iterserve
from iterserve import SamplingParams
from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.server.conftest import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL,
    TINY_MODEL,
    ServerThread,
    aborted,
    metric_samples,
    wait_until_idle,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def http(server: ServerThread, **kw) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=kw.pop("timeout", 120), **kw)


def sse_events(lines) -> list[dict]:
    """Parse an SSE body up to ``data: [DONE]``; fails if [DONE] never comes."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return events
        events.append(json.loads(line.removeprefix("data: ")))
    raise AssertionError("stream ended without data: [DONE]")


# -- the openai client against offline greedy outputs -------------------------------------------------


def test_completion_matches_offline_greedy(server, reference):
    expected = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    n_prompt = len(reference.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(expected.token_ids))
    assert r.usage.total_tokens == n_prompt + len(expected.token_ids)
    assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")

    chunks = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.token_ids)


def test_chat_matches_offline_greedy_streaming_or_not(server, reference):
    expected = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))[0]
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0)
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    prompt_ids = reference.tokenizer.apply_chat_template(CHAT, tokenize=True)
    assert prompt_ids == expected.prompt_token_ids
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == expected.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt_ids)
    # the same prompt was just computed: its full blocks come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // 16 * 16
    assert metric_samples(server)[("iterserve:prefix_cache_hit_rate", ())] > 0


def test_completion_logprobs_legacy_format(server):
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert math.isclose(logprob, max(top.values()))  # greedy: the sampled token is the most likely
        assert top[token] == logprob

    streamed = list(client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                      logprobs=3, stream=True))
    assert [t for ch in streamed for t in ch.choices[0].logprobs.tokens] == lp.tokens
    assert [o for ch in streamed for o in ch.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprobs(server):
    r = client(server).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)


def test_stop_string_ends_the_text_before_it(server, reference):
    full = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    stop = full.split()[2]
    r = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop


# -- batching, disconnects, overload ------------------------------------------------------------------


def test_concurrent_streams_batch_and_match_running_alone(server, reference, trace_path):
    prompts = [f"Here is a fact about the number {i}:" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.outputs[0].text for o in reference.generate(prompts, params)]
    for i in (0, 31):  # batch-invariance of the reference itself
        assert reference.generate(prompts[i], params)[0].outputs[0].text == expected[i]
    wait_until_idle(server)
    first_step = len(trace_path.read_text().splitlines())

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(run_all()) == expected
    wait_until_idle(server)
    records = [json.loads(line) for line in trace_path.read_text().splitlines()[first_step:]]
    steps = [r for r in records if r["type"] == "step"]
    assert max(s["num_decode_seqs"] for s in steps) >= 8, "requests from different connections were not batched"
    m = metric_samples(server)
    finished = sum(v for (name, labels), v in m.items() if name == "vllm:request_success_total"
                   and labels[0][1] in ("stop", "length"))
    assert finished >= 32
    assert m[("vllm:time_to_first_token_seconds_count", ())] >= 32
    assert m[("vllm:generation_tokens_total", ())] >= 32
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "stream": True}
    with http(server) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert sum(line.startswith("data: ") for line in (next(lines), next(lines), next(lines))) >= 2
        assert metric_samples(server)[("vllm:num_requests_running", ())] == 1
    # leaving the block closes the connection with the generation far from done
    assert wait_until_idle(server, timeout=5.0) < 5.0
    assert aborted(server) == before + 1


def test_non_streaming_disconnect_aborts(server):
    before = aborted(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), http(server, timeout=httpx.Timeout(30, read=1.0)) as c:
        c.post("/v1/completions", json=body)
    wait_until_idle(server, timeout=5.0)
    assert aborted(server) == before + 1


# -- auth, errors, auxiliary endpoints -----------------------------------------------------------------


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200
    for public in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{public}").status_code == 200


LONG_PROMPT = "hello " * MAX_MODEL_LEN
BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": ["x"] * 257}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["x", [1, 2, 10**9]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e300}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{p}:{json.dumps(b)[:50]}" for p, b, *_ in
                                                                     BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    with http(server) as c:
        r = c.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_malformed_json_and_unknown_routes(server):
    with http(server) as c:
        for raw in (b"{bad", b'{"prompt": "x",', b"[1, 2]", b"", b"\xff\xfe"):
            r = c.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (raw, r.text)
        r = c.get("/v1/nothing-here")
        assert r.status_code == 404 and "error" in r.json()
        assert c.get("/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="no-such-model", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model=MODEL, prompt="x", n=0)


def test_tokenize_detokenize_models_version(server, reference):
    tok = reference.tokenizer
    with http(server) as c:
        r = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert r == {"tokens": tok.encode("Hello world"), "count": len(tok.encode("Hello world")),
                     "max_model_len": MAX_MODEL_LEN, "token_strs": None}  # as vLLM sends it unasked
        chat_ids = tok.apply_chat_template(CHAT, tokenize=True)
        assert c.post("/tokenize", json={"messages": CHAT}).json()["tokens"] == chat_ids
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
        assert c.get("/version").json() == {"version": iterserve.__version__}
    models = client(server).models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_openapi_documents_every_request_body(server):
    with http(server) as c:
        doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, field in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                        ("/v1/responses", "input"), ("/tokenize", "prompt"), ("/detokenize", "tokens")]:
        body = doc["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert body["required"] and field in schemas[ref.rsplit("/", 1)[-1]]["properties"], path
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= set(schemas), refs - set(schemas)  # every reference resolves
    operations = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(operations) == len(set(operations))


def test_openapi_documents_every_answer(server):
    """What a schema-driven fuzzer checks responses against: errors as OpenAI bodies (never FastAPI's 422),
    the generation routes' bodies and streams, and the routes that answer neither JSON nor 200."""
    with http(server) as c:
        doc = c.get("/openapi.json").json()
        refused = c.post("/v1/completions", json={"prompt": "Hi", "n": 0})
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            assert "422" not in responses, (method, path)
            assert all(responses[k]["content"]["application/json"]["schema"] == error_ref for k in ("4XX", "5XX"))
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert refused.status_code == 400 and set(refused.json()["error"]) == \
        set(doc["components"]["schemas"]["ErrorInfo"]["properties"])
    for path, model in [("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionResponse"),
                        ("/v1/responses", "ResponseObject")]:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert content["text/event-stream"]["schema"]["properties"]["data"] == {"type": "string"}
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "204" in doc["paths"]["/favicon.ico"]["get"]["responses"]


def test_startup_objects_are_frozen_out_of_garbage_collection():
    """Full collections walk every tracked object with the GIL held: with startup's objects in them, they
    held /health for about a second during a large logprobs response (docs/compatibility.md)."""
    gc.collect()
    before = gc.get_freeze_count()
    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=16, max_model_len=64)
    with ServerThread(build_app(config, ServerConfig(served_model_name=MODEL))) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert gc.get_freeze_count() > before


# -- fuzz ----------------------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
    st.lists(st.integers(-3, 70_000), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)
# Valid token limits stay tiny so the fuzz is fast; a junk limit is never a valid (slow) one.
SMALL_MAX_TOKENS = st.integers(1, 3)
BAD_MAX_TOKENS = st.one_of(st.integers(-(2**70), 0), st.integers(10**4, 2**70),
                           st.sampled_from([2.5, float("nan"), float("inf"), 1e30, "three", [2], {}, None]))
# Plausible values: mostly valid, with the boundaries on both sides.
PLAUSIBLE = {
    "temperature": st.floats(-0.5, 2.5),
    "top_p": st.floats(-0.2, 1.2),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-0.2, 1.2),
    "repetition_penalty": st.floats(0, 3),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(-2, 70_000), max_size=3),
    "n": st.sampled_from([1, 2, 0]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.one_of(st.integers(-1, 22), st.booleans()),
    "top_logprobs": st.integers(-1, 22),
    "echo": st.booleans(),
    "min_tokens": st.integers(-1, 4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "best_of": st.sampled_from([1, None, 2, 0]),
    "suffix": st.sampled_from([None, "", "end"]),
    "logit_bias": st.sampled_from([None, {}, {"42": 1.0}]),
    "user": st.text(max_size=8),
    "model": st.sampled_from([MODEL, "other-model"]),
    "tools": st.sampled_from([None, [], [{"type": "function", "function": {"name": "f"}}]]),
    "tool_choice": st.sampled_from([None, "none", "auto"]),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
}
PROMPTS = st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(-5, 60_000), min_size=1, max_size=6),
                    st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "user", "developer", "tool", "bogus"]),
    "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}), max_size=2)),
}), min_size=1, max_size=3)
KNOWN = {"prompt", "messages", "max_tokens", "max_completion_tokens", *PLAUSIBLE}


@st.composite
def request_bodies(draw) -> tuple[str, bytes]:
    """A request with a few plausible options, a few junk ones and unknown extras; now and then
    a malformed body instead."""
    chat = draw(st.booleans())
    prompt_field = "messages" if chat else "prompt"
    body = {"model": MODEL, "max_tokens": draw(SMALL_MAX_TOKENS), "temperature": 0,
            prompt_field: draw(MESSAGES if chat else PROMPTS)}
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), unique=True, max_size=4)):
        body[name] = draw(PLAUSIBLE[name])
    junk_targets = sorted(PLAUSIBLE) + [prompt_field, "max_tokens"] + (["max_completion_tokens"] if chat else [])
    for name in draw(st.lists(st.sampled_from(junk_targets), unique=True, max_size=2)):
        body[name] = draw(BAD_MAX_TOKENS if name.startswith("max_") else JUNK)
    if draw(st.integers(0, 9)) == 9:
        body.pop(prompt_field)
    for key, value in draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in KNOWN), JUNK,
                                           max_size=2)).items():
        body[key] = value
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 7)) == 7:  # cut short or replaced by noise
        raw = draw(st.one_of(st.integers(0, len(raw) - 1).map(lambda k: raw[:k]), st.binary(max_size=20)))
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=request_bodies())
def test_fuzzed_bodies_never_get_a_5xx(server, case):
    path, raw = case
    with http(server) as c:
        r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (raw, r.text)
    event(f"HTTP {r.status_code} " + (r.json()["error"]["message"][:50] if r.status_code >= 400 else ""))
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        sse_events(r.text.splitlines())
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_server_is_healthy_after_fuzzing(server, reference):
    # runs after the fuzz (file order): nothing leaked and a normal request still works
    wait_until_idle(server)
    expected = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text \
        == expected
    assert httpx.get(f"{server.url}/health").status_code == 200
