"""One request's outputs as the API process reads them: filled by :class:`EngineCoreClient` as the core's
deltas arrive, read by a route's handler on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from iterserve.outputs import RequestOutput


class RequestStream:
    """One request's outputs, consumed on the event loop.

    A consumer that falls behind never makes the buffer grow by a step: unread deltas are merged into
    one pending output (``merge``), and a cumulative output replaces the unread one, so what a stream holds
    is bounded by what the request generates.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None], merge: bool = True) -> None:
        self.request_id = request_id
        self._merge = merge
        self.finished = False
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._abort = abort

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            if self.finished:  # closed while its consumer waited
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        if self._pending is not None:
            out, self._pending = self._pending, None
            self.finished = out.finished
            return out
        self.finished = True
        raise self._error  # type: ignore[misc]

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._pending = None
            self._abort(self.request_id)
            self._ready.set()

    def _put(self, output: RequestOutput) -> None:
        if self._pending is None or not self._merge:
            self._pending = output
        else:
            self._pending.add(output)
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()
