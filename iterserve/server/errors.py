"""Errors as OpenAI-style HTTP answers: :class:`APIError` and its ``{"error": {...}}`` body, and the app's
exception handlers, which map every other error (the engine's, FastAPI's validation, an unknown route, a
bug) to one with the right status. Only genuine faults give a 5xx."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.errors import EngineDeadError, RequestError, RequestFailedError

logger = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error that becomes an OpenAI-style ``{"error": {...}}`` body with this status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def request_error(error: RequestError, prompt_param: str = "prompt", logprobs_param: str = "logprobs") -> APIError:
    """A request the engine refused, as a 400 naming the field (the prompt and logprobs under the names the
    client used)."""
    param = {"prompt": prompt_param, "logprobs": logprobs_param}.get(error.param or "", error.param)
    return bad_request(str(error), param, error.code)


def engine_error(error: EngineDeadError | RequestFailedError) -> APIError:
    """503 while the engine is gone or stopping; 500 for a failed step (its traceback is only logged); 400
    for a request that failed by its own doing."""
    if isinstance(error, RequestFailedError) and error.by_request:
        return bad_request(str(error))
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), type="server_error", code="engine_error")
    return APIError(503, str(error), type="server_error", code="engine_unavailable")


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _on_engine_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, (EngineDeadError, RequestFailedError))
    return error_response(engine_error(exc))


def _printable(text: str) -> str:
    """``text`` with any lone surrogate escaped, so that an error message can always be sent as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's 422 becomes OpenAI's 400, naming the offending parameter."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if not errors:
        return error_response(bad_request("invalid request body"))
    # A union field reports one error per member type; one raised by our own validators says what is wrong.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error")
        return error_response(bad_request(f"the body is not valid JSON: {reason}" if reason else
                                           "the body is not valid JSON"))
    # pydantic tags a union member's errors with the member's type, e.g. "list[int]": not a field name
    loc = [_printable(str(part)) for part in first.get("loc", ()) if part != "body" and "[" not in str(part)]
    if not loc and first.get("type") in ("missing", "model_attributes_type"):
        return error_response(bad_request("the request body must be a JSON object"))
    where = ".".join(loc)
    reason = (first.get("ctx") or {}).get("error") if first.get("type") == "value_error" else None
    message = _printable(str(reason or first.get("msg")))
    return error_response(bad_request(f"{where}: {message}" if where else message, loc[0] if loc else None))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = f"no route for {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    headers = dict(exc.headers) if exc.headers is not None else None
    return error_response(APIError(exc.status_code, message, type=kind, headers=headers))


async def _on_internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error the routes raise with an OpenAI-style body."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(EngineDeadError, _on_engine_error)
    app.add_exception_handler(RequestFailedError, _on_engine_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_internal_error)
