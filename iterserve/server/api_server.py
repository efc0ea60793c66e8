"""OpenAI-compatible HTTP API over one engine (one or more core replicas): the app and the server.

:func:`build_app` assembles the engine's client, the routes (a ``serving_*`` module per endpoint over the
shared steps of :mod:`.serving`), the error handlers (:mod:`.errors`), the middlewares
(:mod:`.middleware`) and the dashboard; :func:`run_server` runs it under uvicorn, draining running
requests on SIGINT/SIGTERM.

Every refusal is an OpenAI-style ``{"error": {...}}`` body with a 4xx status; only genuine faults give
a 5xx. Hostile input is refused before it costs much: bodies over a size limit are cut off as they
arrive (413), POST bodies must be declared JSON (415), invalid Unicode and malformed lists are
refused when the body is parsed (stopping at the first bad element), and a prompt too long for
the context is refused before it is tokenized when its length alone proves it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from iterserve import __version__
from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.async_llm import AsyncLLM
from iterserve.engine.core_client import EngineCoreClient
from iterserve.server.dashboard import add_dashboard
from iterserve.server.errors import add_error_handlers
from iterserve.server.grammars import GrammarChecker
from iterserve.server.metrics import ServerMetrics
from iterserve.server.middleware import (
    APIKeyMiddleware,
    BodyReadTimeoutMiddleware,
    BodySizeLimitMiddleware,
    HTTP2PrefaceMiddleware,
    JSONBodyMiddleware,
)
from iterserve.server.request_body import document_bodies, streamed_or_whole
from iterserve.server.response_bodies import ChatCompletionResponse, CompletionResponse, ResponseObject
from iterserve.server.serving_chat import ChatServing
from iterserve.server.serving_completions import CompletionServing
from iterserve.server.serving_discovery import DiscoveryServing, cache_config_info
from iterserve.server.serving_info import InfoServing
from iterserve.server.serving_lora import LoRAServing, add_lora_routes
from iterserve.server.serving_responses import ResponsesServing
from iterserve.server.serving_tokenize import TokenizeServing
from iterserve.tokenizer.chat_template import load_chat_template

logger = logging.getLogger(__name__)


def build_app(config: EngineConfig, server: ServerConfig | None = None) -> FastAPI:
    """An app serving ``config``'s model; its lifespan starts and stops the engine core process.

    ``app.state.llm`` is the :class:`AsyncLLM` the routes run on, ``app.state.engine`` its
    :class:`EngineCoreClient` (set its ``on_dead`` to hear of a dead core).
    Request bodies over ``server.max_request_body_bytes`` are refused with a 413.
    """
    server = server or ServerConfig()
    if server.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    served_model_name, api_key = server.model_name(config), server.api_key
    llm = AsyncLLM(config, max_waiting=server.max_waiting, log_level=server.log_level,
                   data_parallel_size=server.data_parallel_size, stall_timeout=server.engine_stall_timeout,
                   max_restarts=server.max_engine_restarts, data_parallel_backend=server.data_parallel_backend)
    engine = llm.engine_core
    spec = config.speculative_config
    events = config.kv_events_config
    metrics = ServerMetrics(served_model_name, engine.capacity.max_model_len, server.data_parallel_size,
                            spec.num_speculative_tokens if spec else 0, events is not None and events.publishes)
    engine.observer = metrics
    grammars = GrammarChecker(engine.tokenizer, engine.model_config.vocab_size, server.grammar_workers,
                              server.grammar_timeout)
    completion = CompletionServing(engine, metrics, served_model_name, grammars)
    chat = ChatServing(engine, metrics, served_model_name, grammars)
    responses = ResponsesServing(engine, metrics, served_model_name, grammars)
    tokenize = TokenizeServing(engine, metrics, served_model_name)
    info = InfoServing(engine, metrics, served_model_name)
    discovery = DiscoveryServing(engine, metrics, served_model_name, grammars)
    metrics.record_cache_config(cache_config_info(engine))
    for route in (completion, chat, responses):
        route.max_response_logprobs = server.max_response_logprobs
    lora = LoRAServing.serving(engine, metrics, served_model_name, server.lora_paths(),
                               [completion, chat, responses, tokenize, info, discovery])
    if server.chat_template is not None:
        chat.chat_template = responses.chat_template = tokenize.chat_template = discovery.chat_template = \
            load_chat_template(server.chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await llm.start()
        gc.freeze()  # startup's objects live as long as the process: full collections (GIL held) now skip them
        logger.info("engine core started; serving %r on %s (%s)", served_model_name, config.resolved_device,
                    config.resolved_dtype)
        try:
            yield
        finally:
            grammars.close()
            await llm.shutdown()
            logger.info("engine core stopped")

    app = FastAPI(title="iterserve", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.llm = llm
    add_error_handlers(app)
    add_middlewares(app, server)

    app.post("/v1/completions", response_model=None, responses=streamed_or_whole(CompletionResponse))(
        completion.completions)
    app.post("/v1/chat/completions", response_model=None, responses=streamed_or_whole(ChatCompletionResponse))(
        chat.chat_completions)
    app.post("/v1/responses", response_model=None, responses=streamed_or_whole(ResponseObject))(responses.responses)
    app.get("/v1/models")(info.models)
    app.get("/v1/models/{model_id:path}")(info.model)
    app.post("/tokenize")(tokenize.tokenize)
    app.post("/detokenize")(tokenize.detokenize)
    app.get("/health", response_model=None)(info.health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) name; a route per method, each its own operation id
        app.api_route("/ping", methods=[method], response_model=None, operation_id=f"ping_{method.lower()}")(
            info.health)
    app.post("/v1/embeddings", response_model=None)(info.embeddings)
    # browsers ask; nothing to send
    app.get("/favicon.ico", response_model=None, status_code=204)(lambda: Response(status_code=204))
    app.get("/version")(info.version)
    app.get("/metrics", response_model=None, response_class=PlainTextResponse)(info.prometheus)
    add_discovery_routes(app, discovery)
    add_lora_routes(app, lora)
    add_dashboard(app, engine, served_model_name, api_key, server.max_dashboard_viewers)
    document_bodies(app)
    return app


def add_middlewares(app: FastAPI, server: ServerConfig) -> None:
    """The last added runs first: an HTTP/2 preface is answered, the key is checked, then the Content-Type,
    then the body's size and time."""
    app.add_middleware(BodyReadTimeoutMiddleware, timeout=server.request_body_timeout)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server.max_request_body_bytes)
    app.add_middleware(JSONBodyMiddleware)
    if server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server.api_key)
    app.add_middleware(HTTP2PrefaceMiddleware)


def add_discovery_routes(app: FastAPI, discovery: DiscoveryServing) -> None:
    """The routes routers probe (:mod:`.serving_discovery`), under vLLM's and SGLang's names."""
    for path in ("/server_info", "/get_server_info"):
        app.get(path)(discovery.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.get(path)(discovery.model_info)
    app.get("/kv_event_sources", response_model=None)(discovery.kv_event_sources)
    app.post("/v1/chat/completions/render", response_model=None)(discovery.render_chat)
    app.post("/v1/completions/render", response_model=None)(discovery.render_completion)
    app.get("/health_generate", response_model=None)(discovery.health_generate)
    for path in ("/reset_prefix_cache", "/flush_cache"):
        app.post(path, response_model=None)(discovery.reset_prefix_cache)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _GracefulServer(uvicorn.Server):
    """uvicorn, but SIGINT/SIGTERM first drains: new requests get 503, running ones get
    ``shutdown_timeout`` seconds, the rest end with an error; then the server stops. A second
    signal stops at once."""

    def __init__(self, config: uvicorn.Config, engine: EngineCoreClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self.drain_and_exit)

    def drain_and_exit(self) -> None:
        """Stop taking requests, give running ones ``shutdown_timeout`` seconds, end the rest with an
        error, then stop (on the event loop; a second call does nothing)."""
        if self._draining:
            return
        self._draining = True
        logger.info("shutting down: finishing running requests (up to %.1f s)", self.shutdown_timeout)
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self.engine.drain(self.shutdown_timeout)
        self.should_exit = True


def run_server(config: EngineConfig, server: ServerConfig) -> int:
    """``iterserve serve``: serve until SIGINT/SIGTERM (exit 0 after draining) or until the engine core
    dies (exit 1, so a supervisor restarts the server)."""
    name = server.model_name(config)
    app = build_app(config, server)
    engine: EngineCoreClient = app.state.engine
    cap = engine.capacity
    replicas = f" in each of {server.data_parallel_size} replicas" if server.data_parallel_size > 1 else ""
    logger.info("KV cache: %d blocks x %d tokens = %d tokens, max_model_len %d (%d full-length sequences)%s",
                cap.num_blocks, cap.block_size, cap.total_tokens, cap.max_model_len, cap.max_full_length_seqs,
                replicas)
    logger.info("OpenAI-compatible API for %r at %s/v1", name, _url(server.host, server.port))
    uv = _GracefulServer(uvicorn.Config(
        app, host=server.host, port=server.port, log_level=server.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout) + 1,
    ), engine, server.shutdown_timeout)

    # A dead core has failed its own requests; the other replicas' running ones are drained as on
    # SIGTERM, so that each ends with its last tokens or an error event, never cut off by uvicorn.
    engine.on_dead = uv.drain_and_exit
    # uvicorn re-raises a signal it handled once it has shut down; a no-op handler turns that into a
    # normal return, so a requested stop exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uv.run()
    if not uv.started:
        return 1  # the engine core did not start; the log says why
    if engine.error is not None:
        logger.error("exiting because the engine core died: %s", engine.error)
        return 1
    return 0
