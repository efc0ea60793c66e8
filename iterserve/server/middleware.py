"""The app's ASGI middlewares, plain ASGI so that streaming responses pass untouched: the API key, JSON-only
POST bodies, a request body size limit and a time limit on receiving the body."""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve.server.auth import bearer_matches
from iterserve.server.dashboard import checks_own_key
from iterserve.server.errors import APIError, error_response

# what a load balancer or monitor reaches without the API key
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/favicon.ico"})


class APIKeyMiddleware:
    """Bearer-key check on everything but the probes and the dashboard's page, feed and scripts (which
    take the key or a session cookie themselves); plain ASGI, so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in PUBLIC_PATHS and not checks_own_key(path):
            if not bearer_matches(Headers(scope=scope).get("authorization", ""), self._key):
                error = APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                                 type="authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HTTP2PrefaceMiddleware:
    """505 to HTTP/2's prior-knowledge preface (``PRI * HTTP/2.0``), which the HTTP/1.1 server hands on as a
    request: sglang-router sends it to every worker it registers, to find out whether the worker speaks gRPC,
    and a 404 there read as a missing route in the worker's log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "PRI":
            error = APIError(505, "this server speaks HTTP/1.1 only (no HTTP/2 or gRPC)",
                             code="http_version_not_supported")
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# routes that read no body (clients POST them bare, as to vLLM and SGLang); none of them generates anything
NO_BODY_POSTS = frozenset({"/ping", "/reset_prefix_cache", "/flush_cache"})


class JSONBodyMiddleware:
    """POST bodies must be declared ``application/json`` (415 otherwise).

    A web page can make a visitor's browser send a cross-origin POST without asking first only with
    no Content-Type or a form or text/plain one; refusing those keeps other sites from running
    generations on a server the visitor can reach (a JSON POST needs a CORS preflight, which this
    server does not grant).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] not in NO_BODY_POSTS:
            content_type = Headers(scope=scope).get("content-type")
            if content_type is None or content_type.partition(";")[0].strip().lower() != "application/json":
                got = "no Content-Type" if content_type is None else f"Content-Type {content_type!r}"
                error = APIError(415, f"the body must be JSON sent with 'Content-Type: application/json'; got {got}",
                                 code="unsupported_media_type")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    """Raised into the app when the body it is reading goes over the limit; the 413 is already sent."""


class BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with a 413, without reading the rest.

    A declared Content-Length over the limit is refused before the app runs. Otherwise the bytes
    are counted as the app receives them; at the limit the 413 is sent and the app's read fails,
    and whatever the app answers then is dropped. The server discards the unread remainder, so
    the connection stays usable.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> JSONResponse:
        return error_response(APIError(413, f"the request body is larger than the limit of {self.max_bytes} bytes",
                                        code="request_too_large"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        # ASCII digits only ("²³".isdigit() is true), and a number too long for int() is over any limit
        if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_bytes):
            await self._error()(scope, receive, send)
            return
        received = 0
        response_started = refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if not response_started:
                        await self._error()(scope, receive, send)
                        refused = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if refused:
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _BodyTooLarge:
            if not refused:
                raise


class _BodyTimedOut(Exception):
    """Raised into the app when its body did not arrive in time; the 408 is already sent."""


class BodyReadTimeoutMiddleware:
    """Answer 408 and close the connection when a request's body is not complete ``timeout`` seconds
    after the request began.

    A client that sends part of a body and then nothing (or a byte now and then) would otherwise hold
    its connection and a task for ever. Only the body's arrival is timed: once it is complete, the
    app's later reads (which wait for the client to disconnect) are left alone.
    """

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = response_started = timed_out = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                if not response_started:
                    error = APIError(408, f"the request body did not arrive within {self.timeout:g} s",
                                     code="request_timeout", headers={"Connection": "close"})
                    await error_response(error)(scope, receive, send)
                    timed_out = True
                raise _BodyTimedOut from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if timed_out:
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except _BodyTimedOut:
            if not timed_out:
                raise
