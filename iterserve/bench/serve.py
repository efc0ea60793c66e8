"""Online load generator for any OpenAI-compatible server (iterserve, vLLM, llama.cpp, TGI).

Requests arrive as a gamma process of rate ``request_rate`` (``burstiness`` 1 is Poisson, lower
is burstier, higher more regular; an infinite rate sends everything at once), optionally capped
at ``max_concurrency`` in flight. Each one streams from ``/v1/completions`` (or
``/v1/chat/completions``) and every server-sent chunk that carries text is timestamped; the
metrics follow :mod:`iterserve.bench.metrics`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from iterserve.bench.metrics import DEFAULT_PERCENTILES, RequestResult, compute_metrics
from iterserve.bench.workloads import Request, WorkloadSpec, is_token_ids
from iterserve.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ServeConfig:
    base_url: str
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first model the server lists
    prompt_format: str = "text"  # text | ids: how token-id prompts are sent to /v1/completions
    temperature: float = 0.0
    ignore_eos: bool = True
    connect_timeout: float = 3.0
    read_timeout: float = 600.0
    api_key: str | None = None
    lora_modules: tuple[str, ...] = ()  # vLLM's: each request names one of these LoRA adapters, chosen at random

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests: gamma-distributed gaps of mean 1/rate.

    As in vLLM, the gaps have shape ``burstiness`` and scale ``1 / (rate * burstiness)``; the
    first request goes at once.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def request_models(n: int, model: str, lora_modules: tuple[str, ...], seed: int) -> list[str]:
    """The model each of ``n`` requests names: ``model``, or with ``lora_modules`` (names, or the server's
    ``name=path``) one of those adapters drawn at random (seeded), as ``vllm bench serve --lora-modules`` does."""
    if not lora_modules:
        return [model] * n
    names = [m.partition("=")[0] for m in lora_modules]
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(n)]


def request_payload(
    r: Request, cfg: ServeConfig, model: str, tokenizer: Tokenizer | None, max_tokens: int
) -> dict[str, Any]:
    """The JSON body for one request; token-id prompts become text unless ``prompt_format`` is ids."""
    prompt = r.prompt
    is_messages = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if prompt and is_token_ids(prompt) and (cfg.prompt_format == "text" or cfg.chat):
        if tokenizer is None:
            raise ValueError(
                "sending token-id prompts as text needs a tokenizer; pass --tokenizer or --prompt-format ids"
            )
        prompt = tokenizer.decode(prompt)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.chat:
        body["messages"] = prompt if is_messages else [{"role": "user", "content": prompt}]
    elif is_messages:
        raise ValueError(f"chat-message prompts need --endpoint {CHAT}")
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int, chat: bool,
    tokenizer: Tokenizer | None, headers: dict[str, str], run_start: float,
) -> RequestResult:
    """Stream one request, timestamping each chunk that carries text."""
    result = RequestResult(prompt_len=prompt_len)
    sent = time.perf_counter()
    result.start_time = sent - run_start
    last = sent
    chunks, usage_tokens, text = 0, None, []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = f"server error: {data['error']}"
                    return result
                if piece := _chunk_text(data, chat):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(piece)
                if usage := data.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if chunks == 0:
        result.error = "the stream carried no generated text"
        return result
    if usage_tokens:
        result.output_len = usage_tokens
    elif tokenizer is not None:
        result.output_len = len(tokenizer.encode("".join(text), add_special_tokens=False))
    else:
        result.output_len = chunks
    result.latency = last - sent
    result.success = True
    return result


def _client(cfg: ServeConfig) -> httpx.AsyncClient:
    # trust_env=False: talk to the server directly, never through a proxy that would distort latency
    timeout = httpx.Timeout(cfg.read_timeout, connect=cfg.connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), timeout=timeout, limits=limits, trust_env=False)


def _headers(cfg: ServeConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def probe(client: httpx.AsyncClient, cfg: ServeConfig) -> str:
    """Fail fast when the server is unreachable; return the model to ask for."""
    try:
        resp = await client.get("/v1/models", headers=_headers(cfg), timeout=cfg.connect_timeout + 5)
    except httpx.HTTPError as e:
        reason = f"{type(e).__name__}: {e or 'no answer'}"
        raise ValueError(f"cannot reach {cfg.base_url} ({reason}); is the server running?") from None
    if cfg.model:
        return cfg.model
    try:
        models = resp.json()["data"]
        return models[0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(
            f"{cfg.base_url}/v1/models answered HTTP {resp.status_code} without a model list; pass --model"
        ) from None


async def _run_once(
    client: httpx.AsyncClient, cfg: ServeConfig, model: str, requests: list[Request], tokenizer: Tokenizer | None,
    request_rate: float, burstiness: float, max_concurrency: int | None, seed: int, use_tqdm: bool, desc: str,
) -> tuple[list[RequestResult], float]:
    models = request_models(len(requests), model, cfg.lora_modules, seed)
    bodies = [request_payload(r, cfg, name, tokenizer, r.output_len) for r, name in zip(requests, models)]
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = _headers(cfg)
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not use_tqdm)
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        send = send_request(client, cfg.endpoint, bodies[i], requests[i].prompt_len, cfg.chat, tokenizer, headers,
                            start)
        if gate is None:
            result = await send
        else:
            async with gate:
                result = await send
        bar.update(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


@dataclass(frozen=True)
class LoadPoint:
    """One run of a sweep: the arrival rate (inf: all at once) and the cap on requests in flight."""

    request_rate: float = math.inf
    max_concurrency: int | None = None


async def _bench(
    cfg: ServeConfig, requests: list[Request], tokenizer: Tokenizer | None, points: list[LoadPoint],
    burstiness: float, seed: int, percentiles: list[float], goodput: dict[str, float] | None, use_tqdm: bool,
) -> tuple[str, list[dict[str, Any]]]:
    async with _client(cfg) as client:
        model = await probe(client, cfg)
        first = requests[0]
        body = request_payload(first, cfg, model, tokenizer, min(2, first.output_len))
        check = await send_request(client, cfg.endpoint, body, first.prompt_len, cfg.chat, tokenizer, _headers(cfg),
                                   time.perf_counter())
        if not check.success:
            raise ValueError(f"test request to {cfg.base_url}{cfg.endpoint} failed: {check.error}")
        runs = []
        for point in points:
            label = f"rate {point.request_rate:g}"
            if point.max_concurrency:
                label += f", concurrency {point.max_concurrency}"
            results, duration = await _run_once(client, cfg, model, requests, tokenizer, point.request_rate, burstiness,
                                                point.max_concurrency, seed, use_tqdm, label)
            run: dict[str, Any] = {
                "request_rate": "inf" if math.isinf(point.request_rate) else point.request_rate,
                "burstiness": burstiness,
                "max_concurrency": point.max_concurrency,
                "num_prompts": len(requests),
            }
            runs.append(run | compute_metrics(results, duration, percentiles, goodput))
    return model, runs


def run_serve(
    cfg: ServeConfig,
    requests: list[Request],
    tokenizer: Tokenizer | None,
    points: list[LoadPoint],
    *,
    burstiness: float = 1.0,
    workload: WorkloadSpec | None = None,
    tokenizer_id: str | None = None,
    label: str | None = None,
    percentiles: list[float] | None = None,
    goodput: dict[str, float] | None = None,
    use_tqdm: bool = True,
) -> dict[str, Any]:
    """Probe the server, then run the workload once per load point; returns the JSON-ready result.

    Raises ValueError at once when the server cannot be reached or rejects a first test request.
    """
    if not requests or not points:
        raise ValueError("bench serve needs at least one request and one load point")
    seed = workload.seed if workload is not None else 0
    model, runs = asyncio.run(_bench(cfg, requests, tokenizer, points, burstiness, seed,
                                     percentiles or list(DEFAULT_PERCENTILES), goodput, use_tqdm))
    result = {
        "benchmark": "serve",
        "label": label or cfg.base_url,
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": model,
        "tokenizer_id": tokenizer_id,
        "percentiles": percentiles or list(DEFAULT_PERCENTILES),
        "goodput": goodput,
        "lora_modules": list(cfg.lora_modules),
        "workload": asdict(workload) if workload is not None else None,
        "runs": runs,
    }
    if len(runs) == 1:
        # what `vllm bench serve --save-result` writes: one run's figures at the top level, so tools that
        # read vLLM's result files read ours (endpoint_type is vLLM's newer name of backend)
        kind = "openai-chat" if cfg.chat else "openai"
        result |= {"backend": kind, "endpoint_type": kind, **runs[0]}
    return result
