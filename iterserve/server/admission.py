"""How a request of many prompts shares the waiting queue with everyone else.

Each prompt of a ``/v1/completions`` list is an engine request of its own. Sent all at once, one
request of 256 prompts filled the waiting queue (``max_waiting``, 256 by default), and every other
client got 429 until it ended. A request is admitted when the queue has room for its first prompt;
then at most ``share`` of its prompts are in the engine at a time (a quarter of ``max_waiting``), each
of the others sent as one of them finishes. What the client receives is unchanged: every prompt's
stream, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from iterserve.engine.request_stream import RequestStream
from iterserve.outputs import RequestOutput

SHARE_OF_QUEUE = 4  # a request of many prompts holds at most max_waiting / 4 places in the engine at once


class Outputs(Protocol):
    """A prompt's outputs as the routes read them: a RequestStream, or a PacedStream that makes one."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def close(self) -> None: ...


def share_of(max_waiting: int) -> int:
    return max(1, max_waiting // SHARE_OF_QUEUE)


class PacedStream:
    """One prompt of a many-prompt request: sent (by ``submit``) once its request has a free place among
    ``places``, which it holds until its output is finished, fails or the stream is closed."""

    def __init__(self, submit: Callable[[], RequestStream], places: asyncio.Semaphore,
                 sent: RequestStream | None = None) -> None:
        """``sent``: the stream of a prompt sent already, holding a place taken from ``places``."""
        self._submit = submit
        self._places = places
        self._stream = sent
        self._holding = sent is not None
        self._closed = False

    def __aiter__(self) -> PacedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._stream is None:
            if self._closed:
                raise StopAsyncIteration
            await self._places.acquire()
            self._holding = True
            if self._closed:  # closed while it waited for a place
                self._release()
                raise StopAsyncIteration
            try:
                self._stream = self._submit()
            except BaseException:
                self._release()
                raise
        try:
            out = await self._stream.__anext__()
        except BaseException:
            self._release()
            raise
        if out.finished:
            self._release()
        return out

    def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        self._release()

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._places.release()
