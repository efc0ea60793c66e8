"""Request bodies parsed and validated in a worker thread, not on the event loop.

FastAPI parses a JSON body and validates it on the event loop. A legal body can be costly: 1,000 chat
messages of 200 content parts each took pydantic 2 s on a loaded 2-core machine (every message and part
runs the Unicode check), during which /health and every stream waited. ``Annotated[Model,
validated(Model)]`` is the same model validated by a sync dependency, which FastAPI runs in its thread
pool; the validators call Python often enough that the event loop gets the GIL back within
milliseconds. Errors are the ``RequestValidationError`` FastAPI raises, so they get the same 400
(:mod:`.errors`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from iterserve.server.errors import ErrorResponse

M = TypeVar("M", bound=BaseModel)


async def _raw(request: Request) -> bytes:
    return await request.body()  # the middlewares have bounded its size and time


def _parse(model: type[M], raw: bytes) -> M:
    """``model`` from a JSON body, with FastAPI's errors (locations under ``body``)."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except UnicodeDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.start), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": "the body is not UTF-8"}}]) from None
    if not isinstance(data, dict):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "input": data,
                                       "msg": "Input should be a valid dictionary or object to extract fields from"}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)],
                                     body=data) from None


def validated(model: type[M]) -> Any:
    """A FastAPI dependency giving the request's body as ``model``, validated in a worker thread."""

    def parse(raw: Annotated[bytes, Depends(_raw)]) -> M:  # sync: FastAPI runs it in its thread pool
        return _parse(model, raw)

    parse.body_model = model  # type: ignore[attr-defined]  # read by document_bodies
    return Depends(parse)


def streamed_or_whole(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route's 200 for its ``responses``: ``model`` as JSON, or server-sent events when streamed."""
    event = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}  # one event of the stream
    return {200: {"model": model, "content": {"text/event-stream": {"schema": event}}}}


def _document_errors(doc: dict[str, Any]) -> None:
    """Every operation's 4xx and 5xx as what they are, OpenAI's error body (:mod:`.errors`), in place of
    FastAPI's 422, which this server never sends (validation errors are 400s)."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas["ErrorResponse"] = schema
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses["4XX"] = {"description": "the request was refused (an OpenAI error body)", **error}
            responses["5XX"] = {"description": "the server or its engine failed (an OpenAI error body)", **error}


def document_bodies(app: FastAPI) -> None:
    """Put the bodies that :func:`validated` parses into ``/openapi.json`` (FastAPI sees raw bytes there,
    and generated clients and fuzzers need each route's real schema), and the error answers every route
    may give."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generate()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for route in app.routes:
            if not isinstance(route, APIRoute):
                continue
            for dep in route.dependant.dependencies:
                model = getattr(dep.call, "body_model", None)
                if model is None:
                    continue
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                for method in route.methods or ():
                    doc["paths"][route.path_format][method.lower()]["requestBody"] = {
                        "required": True, "content": {"application/json": {"schema": ref}}}
        _document_errors(doc)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
