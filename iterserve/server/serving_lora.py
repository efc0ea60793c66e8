"""LoRA adapters as served models: ``--lora-modules`` checked at start, and vLLM's runtime
``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter`` behind its opt-in
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, or ``ITERSERVE_ALLOW_RUNTIME_LORA_UPDATING``).

An adapter is checked against the model's shapes here, before any request can name it, so a bad folder is a
load error or a 400 naming its problem and never reaches the engine; ``lora_int_id`` is never reused, so an
adapter loaded again under a used name gets prefix-cache blocks of its own.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from iterserve.engine.core_client import EngineCoreClient
from iterserve.lora.check import check_adapter
from iterserve.lora.request import LoRARequest
from iterserve.server.errors import APIError, bad_request
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import RequestBody
from iterserve.server.request_body import validated
from iterserve.server.serving import OpenAIServing

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "ITERSERVE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    """vLLM's opt-in: ``1`` or ``true`` (any case) in either variable."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV)


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name alone says which adapter


class LoRAServing(OpenAIServing):
    """The served adapters (``self.loras``, the dict every route shares) and the routes that change them."""

    _last_id = 0  # the last lora_int_id given

    @classmethod
    def serving(cls, engine: EngineCoreClient, metrics: ServerMetrics, model_name: str, paths: dict[str, str],
                routes: list[OpenAIServing]) -> LoRAServing:
        """The adapters of ``paths`` (``--lora-modules``), checked, shared with every route's ``loras``: one
        dict, so that an adapter loaded at runtime is served by all of them; vLLM's gauge where LoRA is on."""
        lora = cls(engine, metrics, model_name)
        for route in routes:
            route.loras = lora.loras
        lora.add_modules(paths)
        if engine.config.enable_lora:
            metrics.record_lora_info(engine.config.max_loras)
        return lora

    def add_modules(self, paths: dict[str, str]) -> None:
        """Check and serve ``--lora-modules``; a ValueError naming the first bad adapter stops the server."""
        for name, path in paths.items():
            if name == self.model_name:
                raise ValueError(f"the LoRA adapter name {name!r} is the served model's name")
            lora = LoRARequest(name, self._next_id(), path)
            check_adapter(lora, self.engine.model_config, self.engine.config.max_lora_rank)
            self.loras[name] = lora

    def _next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    async def load_lora_adapter(
        self, body: Annotated[LoadLoRAAdapterRequest, validated(LoadLoRAAdapterRequest)],
    ) -> PlainTextResponse:
        """vLLM's runtime loading: the adapter is checked against the model, then served under its name."""
        if not self.engine.config.enable_lora:
            raise bad_request("LoRA adapters need the server started with --enable-lora")
        if not body.lora_name or body.lora_name == self.model_name:
            raise bad_request(f"{body.lora_name!r} cannot name a LoRA adapter: it is empty or the served model's",
                              "lora_name")
        if body.lora_name in self.loras:
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        lora = LoRARequest(body.lora_name, self._next_id(), body.lora_path)
        try:  # reads the folder: off the event loop
            await asyncio.to_thread(check_adapter, lora, self.engine.model_config, self.engine.config.max_lora_rank)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from e
        if body.lora_name in self.loras:  # loaded by a concurrent request meanwhile
            raise bad_request(f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        self.loras[body.lora_name] = lora
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(
        self, body: Annotated[UnloadLoRAAdapterRequest, validated(UnloadLoRAAdapterRequest)],
    ) -> PlainTextResponse:
        """The adapter is no longer served; its running requests finish under it."""
        if self.loras.pop(body.lora_name, None) is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_lora_routes(app: FastAPI, serving: LoRAServing) -> None:
    """The runtime routes, where the opt-in allows them (elsewhere a 404, as in vLLM)."""
    if runtime_updating_allowed():
        app.post("/v1/load_lora_adapter", response_model=None)(serving.load_lora_adapter)
        app.post("/v1/unload_lora_adapter", response_model=None)(serving.unload_lora_adapter)
