"""The asyncio engine: vLLM's ``AsyncLLM`` shape over the engine core process.

One object an asyncio program holds (a FastAPI app, a Ray Serve replica, a script): ``generate`` is an
async iterator of a request's outputs, cumulative, as deltas or the final one alone as its
``SamplingParams.output_kind`` says; ``abort`` stops requests; ``shutdown`` stops the core processes.
The engine core steps in a process of its own (:class:`~iterserve.engine.core_client.EngineCoreClient`),
so a caller's event loop never waits on a forward pass. The OpenAI server runs on one of these.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from iterserve.config import EngineConfig, ModelConfig
from iterserve.config.runtime import DataParallelBackend
from iterserve.engine.core_client import DEFAULT_MAX_RESTARTS, EngineCoreClient
from iterserve.engine.request_stream import RequestStream
from iterserve.errors import EngineDeadError
from iterserve.inputs import PromptType, parse_prompt
from iterserve.lora.request import LoRARequest
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import Tokenizer

DEFAULT_MAX_WAITING = 1024  # requests queued before add_request refuses more (QueueFullError)


class AsyncLLM:
    """Requests from any number of coroutines batched together by one engine core (or ``data_parallel_size``
    replicas). Start it with ``await llm.start()`` or ``async with``; ``generate`` starts it when needed."""

    def __init__(self, config: EngineConfig, *, max_waiting: int = DEFAULT_MAX_WAITING, data_parallel_size: int = 1,
                 log_level: str = "INFO", stall_timeout: float = 60.0,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, data_parallel_backend: DataParallelBackend = "mp") -> None:
        self.config = config
        self.engine_core = EngineCoreClient(config, max_waiting=max_waiting, log_level=log_level,
                                            data_parallel_size=data_parallel_size, stall_timeout=stall_timeout,
                                            max_restarts=max_restarts, data_parallel_backend=data_parallel_backend)
        self._started: asyncio.Future[None] | None = None
        self._streams: dict[str, RequestStream] = {}  # the requests generate() is running

    @classmethod
    def from_engine_args(cls, model: str | None = None, **options: Any) -> AsyncLLM:
        """Build from ``EngineConfig`` fields (vLLM's engine arguments: ``dtype``, ``max_num_seqs``, ...), plus
        this class's own ``max_waiting``, ``data_parallel_size``, ``log_level``, ``stall_timeout`` and
        ``max_restarts`` (of a core that dies, within ten minutes)."""
        own = {k: options.pop(k) for k in ("max_waiting", "data_parallel_size", "log_level", "stall_timeout",
                                           "max_restarts", "data_parallel_backend") if k in options}
        config = EngineConfig(**options) if model is None else EngineConfig(model=model, **options)
        return cls(config, **own)

    async def start(self) -> None:
        """Spawn the core processes and wait until they have loaded the model (once; later calls wait for it)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.engine_core.start())
        await asyncio.shield(self._started)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core processes; open requests end with EngineDeadError."""
        if self._started is not None:
            await self.engine_core.stop(timeout)

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine_core.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine_core.model_config

    @property
    def is_running(self) -> bool:
        return self.engine_core.is_running

    @property
    def errored(self) -> bool:
        return self.engine_core.error is not None

    async def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    async def check_health(self) -> None:
        """Raises EngineDeadError when a core has died or stopped answering."""
        problem = self.engine_core.health_problem()
        if problem is not None:
            raise EngineDeadError(problem)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the loop early (or cancelling) aborts it. Raises at
        once for bad input (RequestError, ValueError) or a full queue (QueueFullError). ``lora_request``: the
        LoRA adapter it runs under (``enable_lora``)."""
        await self.start()
        params = sampling_params or SamplingParams()
        parsed = parse_prompt(prompt)
        text = parsed if isinstance(parsed, str) else None
        if isinstance(parsed, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer; pass the prompt as token ids")
            token_ids = await asyncio.to_thread(self.tokenizer.encode, parsed)  # long prompts: off the loop
        else:
            token_ids = parsed
        stream = self.engine_core.add_request(request_id or uuid.uuid4().hex, token_ids, params,
                                              time.perf_counter(), kind=params.output_kind, lora=lora_request)
        self._streams[stream.request_id] = stream
        try:
            async for out in stream:
                out.prompt = text
                yield out
        finally:
            del self._streams[stream.request_id]
            stream.close()

    async def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache (vLLM's method); requests sent afterwards find nothing cached."""
        self.engine_core.reset_prefix_cache()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are (their generate() loops end); unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.close()
            else:
                self.engine_core.abort(rid)
