"""What routers ask a worker before and while they route to it, answered as vLLM and SGLang answer it.

sglang-router (sgl-model-gateway) registers a worker by reading ``/server_info`` (falling back to
``/get_server_info``) for its model, data-parallel size and limits, and ``/model_info`` (``/get_model_info``)
for the model's type; without them it lists the model as "unknown". vllm-router's cache-aware policy
renders each chat request to token ids with ``POST /v1/chat/completions/render`` (falling back to a second
round trip to ``/tokenize``; ``/v1/completions/render`` is the completions twin), and its ``kv_aware``
policy reads ``/get_server_info`` for the block size (``kv_block_size``) and each worker's KV-event publishers
at ``/kv_event_sources`` (an object keyed by data-parallel rank, as vllm-router parses it; 0.1.17 then takes
an HTTP worker's publishers from its ``--kv-event-source`` flags instead). SGLang's ``/health_generate`` is
the health check that proves a token can be made.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from iterserve import __version__
from iterserve.engine.core_client import EngineCoreClient
from iterserve.errors import EngineDeadError, RequestFailedError
from iterserve.sampling_params import SamplingParams
from iterserve.server.errors import APIError, error_response
from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from iterserve.server.request_body import validated
from iterserve.server.serving_chat import ChatServing
from iterserve.server.serving_completions import CompletionServing

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default health check timeout
_PLAIN = (int, float, str, bool, type(None))


class DiscoveryServing(ChatServing, CompletionServing):
    """The server-info, model-info, render, KV-event-source and generation health routes (the chat and
    completion routes' steps render)."""

    def _limits(self) -> dict[str, Any]:
        config, cap = self.engine.config, self.engine.capacity
        return {"max_model_len": cap.max_model_len, "context_length": cap.max_model_len,
                "max_total_num_tokens": cap.total_tokens, "max_total_tokens": cap.total_tokens,
                "max_prefill_tokens": config.max_num_batched_tokens, "max_running_requests": config.max_num_seqs,
                "max_batch_size": config.max_num_seqs, "max_num_reqs": config.max_num_seqs,
                "page_size": cap.block_size, "num_kv_blocks": cap.num_blocks,
                # vllm-router's kv_aware index reads the block size under these names (no block size: no index);
                # it also takes "block_size" as a name for kv_block_size, so sending both fails its parse
                "kv_block_size": cap.block_size, "effective_attention_block_size": cap.block_size}

    async def server_info(self) -> dict[str, Any]:
        """SGLang's server info: the fields sgl-model-gateway reads (model_id, model_path, served_model_name,
        dp_size, tp_size, version and the batch limits), with their values here."""
        config = self.engine.config
        return {"model_id": self.model_name, "model_path": config.model, "served_model_name": self.model_name,
                "tokenizer_path": config.model, "dp_size": self.engine.data_parallel_size,
                "tp_size": config.tensor_parallel_size, "version": __version__, **self._limits(),
                "enable_prefix_caching": config.enable_prefix_caching,
                "disable_radix_cache": not config.enable_prefix_caching,
                "kv_cache_dtype": config.resolved_dtype, "device": config.resolved_device,
                "kv_events": kv_event_sources(self.engine, None)}

    async def model_info(self) -> dict[str, Any]:
        """SGLang's model info: path, tokenizer, model type and architectures, context and vocabulary."""
        hf = self.engine.model_config.to_hf_config()
        max_len = self.engine.max_model_len
        return {"model_path": self.engine.config.model, "tokenizer_path": self.engine.config.model,
                "served_model_name": self.model_name, "is_generation": True, "model_type": hf["model_type"],
                "architectures": hf["architectures"], "max_context_length": max_len, "max_req_input_len": max_len - 1,
                "vocab_size": self.engine.model_config.vocab_size, "weight_version": "default",
                "preferred_sampling_params": None, "has_image_understanding": False,
                "has_audio_understanding": False}

    async def kv_event_sources(self, request: Request) -> JSONResponse:
        """The KV-event publishers, one per replica, keyed by its data-parallel rank as a string (the shape
        vllm-router deserializes; an empty object when events are off), each with its publisher settings; a
        wildcard bind address is given as the host the client reached us by."""
        config = self.engine.config.kv_events_config
        settings = {} if config is None else {"publisher": config.publisher, "hwm": config.hwm,
                                               "buffer_steps": config.buffer_steps,
                                               "enable_kv_cache_events": config.enable_kv_cache_events}
        sources = kv_event_sources(self.engine, request.url.hostname)
        return JSONResponse({str(s["data_parallel_rank"]): {**s, **settings} for s in sources})

    async def reset_prefix_cache(self) -> Response:
        """Empty every replica's prefix cache (vLLM's ``POST /reset_prefix_cache``, SGLang's ``/flush_cache``):
        running requests keep their blocks, later ones find nothing cached, and KV-event subscribers get
        AllBlocksCleared."""
        if (problem := self.engine.health_problem()) is not None:
            return error_response(APIError(503, problem, type="server_error"))
        self.engine.reset_prefix_cache()
        return Response(status_code=200)

    async def render_chat(self, body: Annotated[ChatCompletionRequest, validated(ChatCompletionRequest)],
                          ) -> JSONResponse:
        """The chat request as the engine would get it, without generating (vLLM's render route): its template
        applied and tokenized, and its sampling parameters; a 400 where the request itself would get one."""
        constraint = self._accept(body)
        _, params, prompt_ids = await self._prepare(body, constraint, body.structured_outputs_field)
        return JSONResponse(self._generate_request(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, params, body))

    async def render_completion(self, body: Annotated[CompletionRequest, validated(CompletionRequest)],
                                ) -> JSONResponse:
        """vLLM's completions render: one engine request per prompt (a list of them), each with its token ids."""
        constraint = self._accept(body)
        params = body.completion_params(constraint)
        await self._check_grammar(constraint, body.structured_outputs_field or "structured_outputs")
        prompts = await self._completion_prompts(body.prompt, echo=False)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return JSONResponse([self._generate_request(f"{request_id}-{i}", ids, params, body)
                             for i, (ids, _) in enumerate(prompts)])

    def _generate_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                          body: SamplingRequest) -> dict[str, Any]:
        """vLLM's GenerateRequest body: what the engine would get for one prompt."""
        options = None if body.stream_options is None else body.stream_options.model_dump()
        return {"request_id": request_id, "token_ids": token_ids, "features": None,
                "sampling_params": _plain_fields(params), "model": self.model_name, "stream": bool(body.stream),
                "stream_options": options, "cache_salt": None, "priority": 0, "kv_transfer_params": None}

    async def health_generate(self) -> Response:
        """200 once one token is generated (SGLang's deep health check); 503 saying why otherwise."""
        if (problem := self.engine.health_problem()) is not None:
            return error_response(APIError(503, problem, type="server_error"))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request_id = f"health-{uuid.uuid4().hex}"
        try:
            stream = await self._submit(request_id, [0], params, stream=False)
            try:
                async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
                    async for _ in stream:
                        pass
            finally:
                stream.close()
        except (EngineDeadError, RequestFailedError, APIError, TimeoutError) as e:
            return error_response(APIError(503, f"the engine did not generate a token: {e}", type="server_error"))
        return JSONResponse({"status": "ok", "time": time.time()})


def kv_event_sources(engine: EngineCoreClient, host: str | None) -> list[dict[str, Any]]:
    """vLLM's ``/kv_event_sources`` entries: each replica's publisher endpoint (its port offset by the replica's
    index), with a wildcard bind address replaced by ``host``, the name the client reached this server by."""
    config = engine.config.kv_events_config
    if config is None or not config.publishes:
        return []
    sources = []
    for rank in range(engine.data_parallel_size):
        own = config.for_rank(rank)
        sources.append({"data_parallel_rank": rank, "endpoint": _reachable(own.endpoint, host),
                        "replay_endpoint": _reachable(own.replay_endpoint, host), "topic": own.topic})
    return sources


def _reachable(endpoint: str | None, host: str | None) -> str | None:
    """A bound wildcard TCP endpoint as a client connects to it: the host it reached us by."""
    if endpoint is None or host is None or not endpoint.startswith("tcp://"):
        return endpoint
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if bound not in ("*", "0.0.0.0", "::", "[::]"):
        return endpoint
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def cache_config_info(engine: EngineCoreClient) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` (its CacheConfig fields, as strings), with this
    engine's values; a field this engine has no counterpart for has vLLM's value when unused."""
    config, cap = engine.config, engine.capacity
    return {"block_size": str(cap.block_size), "cache_dtype": config.resolved_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching), "num_gpu_blocks": str(cap.kv_blocks),
            "num_gpu_blocks_override": str(config.num_kv_blocks), "num_cpu_blocks": "None",
            "kv_cache_memory_bytes": str(cap.memory_bytes),
            "prefix_caching_hash_algo": "builtin", "sliding_window": str(engine.model_config.sliding_window),
            "is_attention_free": "False", "calculate_kv_scales": "False", "cpu_offload_gb": "0",
            "swap_space_bytes": "0"}


def _plain_fields(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters that JSON carries as they are (numbers, strings, lists of them)."""
    return {k: v for k, v in vars(params).items()
            if isinstance(v, _PLAIN) or (isinstance(v, list) and all(isinstance(x, _PLAIN) for x in v))}
