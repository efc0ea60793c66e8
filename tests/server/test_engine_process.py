"""The engine core in its own process, seen from HTTP: a failed step fails only its requests, a dead
core gives errors (never a hang) and a non-zero exit, SIGTERM drains and exits 0, admission counts
what the core has queued, and slow readers do not grow the server's memory."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.core import FAULT_TOKEN_ENV
from iterserve.server import build_app
from tests.server.conftest import MODEL, TINY_MODEL, ServerThread
from tests.server.test_api import metric_samples, sse_events, wait_until_idle

FAULT_TOKEN = 4242


def tiny_config(**kw) -> EngineConfig:
    kw = {"model": TINY_MODEL, "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, **kw}
    return EngineConfig(**kw)


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=60)


# -- dynamic batching ----------------------------------------------------------------------------------


def test_a_dynamic_batch_waits_to_fill_in_the_core_process_then_serves():
    app = build_app(tiny_config(batching="dynamic", max_num_seqs=4, max_batch_wait=0.4),
                    ServerConfig(served_model_name=MODEL, max_waiting=8))
    with ServerThread(app) as s:
        start = time.perf_counter()
        r = completion(s.url, prompt=[1, 2, 3], max_tokens=3, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert time.perf_counter() - start >= 0.4  # alone, it waited for its batch to fill until the window closed
        queued = metric_samples(s)[("vllm:request_queue_time_seconds_sum", ())]
        assert queued >= 0.4
        with ThreadPoolExecutor(4) as pool:  # four at once fill the batch
            done = list(pool.map(lambda p: completion(s.url, prompt=[p, 2], max_tokens=2, ignore_eos=True),
                                 range(10, 14)))
        assert [d.status_code for d in done] == [200] * 4
        wait_until_idle(s)


# -- a failed step -----------------------------------------------------------------------------------


def test_a_failed_step_fails_only_its_requests(monkeypatch):
    monkeypatch.setenv(FAULT_TOKEN_ENV, str(FAULT_TOKEN))  # read by the core process when it starts
    app = build_app(tiny_config(), ServerConfig(served_model_name=MODEL, max_waiting=8))
    with ServerThread(app) as s:
        r = completion(s.url, prompt=[1, 2, FAULT_TOKEN], max_tokens=4)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and "injected" not in error["message"]
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=60,
                          json={"prompt": [FAULT_TOKEN, 5], "max_tokens": 4, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1]["error"]["type"] == "server_error"
        fault_text = s.engine.tokenizer.decode([FAULT_TOKEN])
        assert FAULT_TOKEN in s.engine.tokenizer.encode(fault_text, add_special_tokens=False)
        with httpx.stream("POST", f"{s.url}/v1/responses", timeout=60,
                          json={"input": fault_text, "max_output_tokens": 4, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(lines[-1].removeprefix("data: "))
        assert (last["type"], last["code"]) == ("error", "engine_error") and "injected" not in last["message"]
        ok = completion(s.url, prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{s.url}/health").status_code == 200
        wait_until_idle(s)  # the failed requests' blocks were freed
        assert metric_samples(s)[("vllm:request_success_total", (("finished_reason", "error"),))] == 3


# -- a dead core --------------------------------------------------------------------------------------


def test_killed_core_fails_its_requests_and_a_new_core_takes_over():
    app = build_app(tiny_config(), ServerConfig(served_model_name=MODEL, max_waiting=8))
    with ServerThread(app) as s:
        body = {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            first = s.engine.pids[0]
            os.kill(first, signal.SIGKILL)
            events = sse_events(lines)
        assert events[-1]["error"]["code"] == "engine_unavailable"
        health = httpx.get(f"{s.url}/health")
        if health.status_code == 503:  # while the new core loads
            assert "restarting" in health.json()["error"]["message"], health.text
            r = completion(s.url, prompt=[1, 2], max_tokens=2)
            assert r.status_code in (200, 503), r.text
        deadline = time.monotonic() + 120
        while httpx.get(f"{s.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the core was not restarted"
            time.sleep(0.2)
        assert s.engine.pids[0] not in (None, first)
        r = completion(s.url, prompt=[1, 2], max_tokens=2)
        assert r.status_code == 200, r.text
        assert metric_samples(s)[("iterserve:engine_restarts_total", ())] == 1


# -- the CLI: start-up, SIGTERM, death -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``iterserve serve`` as a subprocess; its log is collected by a reader thread."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "iterserve.cli", "serve", "--model", TINY_MODEL, "--dtype", "float32",
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def core_pid(self) -> int:
        return int(re.search(r"engine core process (\d+) ready", self.log).group(1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)


@contextmanager
def serve(*args: str) -> Iterator[ServeProcess]:
    p = ServeProcess(*args)
    try:
        p.wait_healthy()
        yield p
    finally:
        p.close()


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list[dict]:
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: ") and started is not None:
                started.set()
            lines.append(line)
    return sse_events(lines)


@pytest.mark.slow
def test_sigterm_under_load_finishes_short_requests_ends_long_ones_and_exits_0():
    with serve("--num-kv-blocks", "512", "--max-model-len", "4096", "--shutdown-timeout", "10") as p:

        async def scenario() -> tuple[list[list[dict]], int]:
            async with httpx.AsyncClient(base_url=p.url, timeout=60) as c:
                started = asyncio.Event()
                short = asyncio.create_task(_stream(c, {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
                                                        "stream": True}, started))
                long = [asyncio.create_task(_stream(c, {"prompt": [7, i + 1], "max_tokens": 4000, "ignore_eos": True,
                                                        "stream": True})) for i in range(6)]
                await started.wait()
                p.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)  # the drain has begun: the server refuses new work meanwhile
                late = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return await asyncio.gather(short, *long), late.status_code

        streams, late_status = asyncio.run(scenario())
        assert late_status == 503
        assert streams[0][-1]["choices"][0]["finish_reason"] == "length"  # finished within the timeout
        for events in streams[1:]:  # each ended with an error event (sse_events checked [DONE])
            assert events[-1]["error"]["code"] == "engine_unavailable"
        assert p.proc.wait(timeout=60) == 0
        p.close()
        assert "KV cache: 512 blocks x 16 tokens" in p.log and f"{p.url}/v1" in p.log
        assert "engine core stopped" in p.log


def test_killed_core_makes_the_server_exit_non_zero_when_restarts_are_off():
    with serve("--num-kv-blocks", "64", "--max-model-len", "256", "--max-engine-restarts", "0") as p:
        body = {"prompt": [1, 2, 3], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{p.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(p.core_pid, signal.SIGKILL)
            events = sse_events(lines)
        assert events[-1]["error"]["code"] == "engine_unavailable"
        assert p.proc.wait(timeout=60) == 1
        p.close()
        assert "engine process exited unexpectedly" in p.log


# -- admission ----------------------------------------------------------------------------------------


def test_burst_admits_running_plus_waiting_and_refuses_the_rest():
    app = build_app(tiny_config(max_num_seqs=4), ServerConfig(served_model_name=MODEL, max_waiting=4))
    # long enough that the first four still run when the burst has arrived, even on a fast machine
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 64, "ignore_eos": True}

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(50)))

    with ServerThread(app) as s:
        results = asyncio.run(burst(s.url))
        wait_until_idle(s)
    codes = [r.status_code for r in results]
    assert codes.count(200) == 8 and codes.count(429) == 42, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 64


# -- slow readers ---------------------------------------------------------------------------------------

SLOW_READERS = 100
SLOW_TOKENS = 100
# The stated bound: 1 MB per unread stream (2 MB measured for all 100). Each holds one merged pending
# delta (100 tokens with 20 logprobs each) plus what the transport buffers before flow control stops the
# writer. The old per-step cumulative copies held ~20 MB per such stream at 200 tokens.
RSS_BOUND_MB = SLOW_READERS * 1


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.slow
def test_slow_readers_do_not_grow_server_memory():
    app = build_app(tiny_config(num_kv_blocks=1024, max_model_len=1024, max_num_seqs=128),
                    ServerConfig(served_model_name=MODEL, max_waiting=128))
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": SLOW_TOKENS, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()
    with ServerThread(app) as s:
        assert completion(s.url, prompt=[1, 2], max_tokens=8, logprobs=20).status_code == 200  # warm up
        before = rss_mb()
        host, port = s.url.removeprefix("http://").split(":")
        socks = []
        for _ in range(SLOW_READERS):  # clients that send a request and never read a byte of the answer
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(sock)
        deadline = time.monotonic() + 900
        while metric_samples(s)[("vllm:generation_tokens_total", ())] < 8 + SLOW_READERS * SLOW_TOKENS:
            assert time.monotonic() < deadline, "generation did not finish"
            time.sleep(0.2)
        grown = rss_mb() - before
        for sock in socks:
            sock.close()
        wait_until_idle(s, timeout=30)
    assert grown < RSS_BOUND_MB, f"server RSS grew {grown:.0f} MB with {SLOW_READERS} unread streams"
