"""Two data-parallel replicas behind one server: requests sharing a long prefix go to one replica and
hit its prefix cache, unrelated ones balance over both, greedy outputs equal one engine's, and a dead
replica fails only its own requests (the server then stops taking new ones and drains the others,
each of which ends with its last tokens or an error event, and [DONE])."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve import SamplingParams
from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.server.conftest import MAX_MODEL_LEN, MODEL, TINY_MODEL, ServerThread, wait_until_idle
from tests.server.test_api import sse_events
from tests.server.test_engine_process import _stream, serve

SYSTEM = ("You are a careful assistant for a small library. Answer questions about opening hours, loans, "
          "renewals and fines in one short sentence, and never invent a policy you were not told about. The "
          "library opens at nine on weekdays and at ten on Saturdays; a loan lasts three weeks.")
QUESTIONS = [" When do you open?", " How long is a loan?", " Can I renew twice?", " What is the fine?"]
TOPICS = ["Bananas grow in", "The speed of light", "Chess openings are", "Volcanoes erupt when"]


def by_engine(server: ServerThread, name: str) -> dict[str, float]:
    """A series from /metrics, summed per ``engine`` label."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


def test_shared_prefixes_stay_on_one_replica_the_rest_balance_and_outputs_match_one_engine(reference):
    tok = reference.tokenizer
    prefix = tok.encode(SYSTEM)
    assert len(prefix) >= 3 * 16
    shared = [prefix + tok.encode(q, add_special_tokens=False) for q in QUESTIONS]
    unrelated = [tok.encode(t)[:4] for t in TOPICS]  # the same length, so the load ties alternate
    assert len({p[0] for p in unrelated}) == len(unrelated)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate([*shared, *unrelated], params)]

    config = EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)
    app = build_app(config, ServerConfig(served_model_name=MODEL, data_parallel_size=2))

    async def complete(c: httpx.AsyncClient, prompt: list[int]) -> str:
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run(url: str, prompts: list[list[int]]) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(complete(c, p) for p in prompts))

    with ServerThread(app) as s:
        assert len(set(s.engine.pids)) == 2
        texts = asyncio.run(run(s.url, shared[:1]))  # its blocks are cached once it has run
        for prompt in shared[1:]:  # one at a time: with equal loads the recorded prefix decides
            texts += asyncio.run(run(s.url, [prompt]))
        wait_until_idle(s)
        served = by_engine(s, "vllm:request_prompt_tokens_count")
        hits = by_engine(s, "vllm:prefix_cache_hits_total")
        home = max(served, key=lambda e: served[e])
        assert served == {home: 4, str(1 - int(home)): 0}, served
        assert hits[home] >= 3 * (len(prefix) // 16) * 16, hits  # each later request reused the whole prefix

        texts += asyncio.run(run(s.url, unrelated))
        wait_until_idle(s)
        served = by_engine(s, "vllm:request_prompt_tokens_count")
        assert served[home] == 4 + 2 and sum(served.values()) == 8, served
    assert texts == expected


@pytest.mark.slow  # about as long as test_engine_process's one-core kill test, whose path this shares
def test_a_dead_replica_fails_its_own_requests_the_other_finishes_its_and_it_comes_back():
    config = EngineConfig(model=TINY_MODEL, dtype="float32", num_kv_blocks=64, max_model_len=256)
    app = build_app(config, ServerConfig(served_model_name=MODEL, data_parallel_size=2, max_waiting=8))
    body = {"max_tokens": 250, "ignore_eos": True, "stream": True}
    with ServerThread(app) as s:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "prompt": [1, 2, 3]}, timeout=60) as a, \
                httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "prompt": [4, 5, 6]}, timeout=60) as b:
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            next(line for line in lines_a if line.startswith("data: "))
            next(line for line in lines_b if line.startswith("data: "))
            os.kill(s.engine.pids[0], signal.SIGKILL)  # the first request went to replica 0, the second to 1
            events_a, events_b = sse_events(lines_a), sse_events(lines_b)
        error = events_a[-1]["error"]
        assert error["code"] == "engine_unavailable" and error["message"].startswith("replica 0: "), error
        assert events_b[-1]["choices"][0]["finish_reason"] == "length"
        # replica 1 serves while replica 0's new core loads
        assert httpx.get(f"{s.url}/health").status_code == 200
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 120
        while s.engine.num_restarts < 1 or None in s.engine.pids:
            assert time.monotonic() < deadline, "replica 0 was not restarted"
            time.sleep(0.2)
        served = [httpx.post(f"{s.url}/v1/completions", json={"prompt": [9, i], "max_tokens": 8, "ignore_eos": True},
                             timeout=60) for i in range(2)]
        assert all(r.status_code == 200 for r in served)


@pytest.mark.slow
def test_without_restarts_a_dead_replica_makes_the_server_drain_the_other_and_exit_1():
    with serve("--data-parallel-size", "2", "--num-kv-blocks", "256", "--max-model-len", "2048",
               "--shutdown-timeout", "1", "--max-engine-restarts", "0") as p:
        replica0 = int(re.search(r"engine core process (\d+) ready \(replica 0 of 2\)", p.log).group(1))

        async def scenario() -> tuple[list[list[dict]], httpx.Response]:
            async with httpx.AsyncClient(base_url=p.url, timeout=120) as c:
                started = [asyncio.Event() for _ in range(4)]  # alternate: replicas 0, 1, 0, 1
                streams = [asyncio.create_task(_stream(c, {"prompt": [7, i + 1], "max_tokens": 2000, "ignore_eos": True,
                                                           "stream": True}, started[i])) for i in range(4)]
                for event in started:
                    await event.wait()
                os.kill(replica0, signal.SIGKILL)
                await asyncio.sleep(0.3)
                health = await c.get("/health")
                return await asyncio.gather(*streams), health

        streams, health = asyncio.run(scenario())  # each stream ended with [DONE] (sse_events checks)
        assert health.status_code == 503 and "replica 0" in health.json()["error"]["message"], health.text
        errors = [events[-1]["error"] for events in streams]
        assert all(e["code"] == "engine_unavailable" for e in errors), errors
        assert sorted(e["message"].startswith("replica 0: ") for e in errors) == [False, False, True, True], errors
        assert p.proc.wait(timeout=60) == 1
