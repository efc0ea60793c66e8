"""The server's own endpoints: the model list, health (and vLLM's /ping), version, Prometheus metrics, and
the clear refusal of endpoints that need a kind of model this engine does not serve."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, Response

from iterserve import __version__
from iterserve.lora.request import LoRARequest
from iterserve.server.errors import APIError, error_response
from iterserve.server.response_bodies import ModelCard, ModelList
from iterserve.server.serving import OpenAIServing


class InfoServing(OpenAIServing):
    """The models, health, version and metrics routes."""

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, root=self.engine.config.model, max_model_len=self.engine.max_model_len)

    def _adapter_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.model_name,
                         max_model_len=self.engine.max_model_len)

    async def models(self) -> ModelList:
        return ModelList(data=[self._model_card(), *map(self._adapter_card, self.loras.values())])

    async def model(self, model_id: str) -> ModelCard:
        lora = self._check_model(model_id)
        return self._model_card() if lora is None else self._adapter_card(lora)

    async def health(self) -> Response:
        if (problem := self.engine.health_problem()) is not None:
            return error_response(APIError(503, problem, type="server_error"))
        return JSONResponse({"status": "ok"})

    async def embeddings(self, body: dict[str, Any] | None = None) -> Response:
        """vLLM answers /v1/embeddings only with a pooling model loaded; this engine serves generative
        models only, so the request is refused saying why (not a bare 404 a client would retry)."""
        return error_response(APIError(
            400, f"the model {self.model_name!r} is a generative model: /v1/embeddings needs a pooling (embedding) "
                 "model, which this server does not load", param="model", code="model_not_supported"))

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
