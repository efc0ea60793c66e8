"""The shared steps of the routes (iterserve/server/serving.py), driven without an HTTP server."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

from iterserve.outputs import RequestOutput
from iterserve.server.serving import OpenAIServing


class EndlessStream:
    """A request that never finishes until it is closed (as an abort closes it)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        await self.closed.wait()
        raise RuntimeError("the request was aborted")
        yield  # pragma: no cover  (makes this an async generator)

    def close(self) -> None:
        self.closed.set()


class LeavingClient:
    """An ASGI request whose client disconnects after its body."""

    def __init__(self) -> None:
        self.calls = 0

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}


def test_a_client_leaving_a_non_streamed_request_leaves_no_unretrieved_exception() -> None:
    """An abort of a non-streamed request ends its gathering future quietly: asyncio's handler would
    log "exception was never retrieved" as an ERROR for each one otherwise."""
    errors: list[dict[str, Any]] = []

    async def run() -> list[RequestOutput] | None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        serving = OpenAIServing.__new__(OpenAIServing)
        streams = [EndlessStream(), EndlessStream()]
        out = await serving._final_outputs(streams, LeavingClient())  # type: ignore[arg-type]
        assert all(s.closed.is_set() for s in streams)  # both engine requests aborted
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        return out

    assert asyncio.run(run()) is None
    gc.collect()
    assert errors == []
