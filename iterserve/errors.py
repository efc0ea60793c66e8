"""Errors the engine raises, typed so that each layer reports them without parsing messages."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses before queuing it.

    ``param`` names the offending request field (``"prompt"``, ``"max_tokens"``, ``"top_p"``, ...)
    and ``code`` is the OpenAI error code where one applies (``"context_length_exceeded"``), so the
    server answers 400 with both and offline callers can tell what to fix.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class SamplingParamsError(RequestError):
    """An invalid SamplingParams field; ``param`` names it, so a server can point the client at it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks are out of step, so the engine stops
    (every later step raises the same error) instead of carrying on or hanging."""


class QueueFullError(Exception):
    """Admission control refused the request: too many are already waiting."""


class EngineDeadError(RuntimeError):
    """The engine process has stopped (it died, or the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """A step that ran this request failed in the core, the traceback in the core's log; or, ``by_request``,
    the request ended itself by what it asked (its grammar overran its time budget), as the message says."""

    def __init__(self, message: str, by_request: bool = False) -> None:
        super().__init__(message)
        self.by_request = by_request
