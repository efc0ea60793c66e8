"""The engine on a thread of its own, with an asyncio stream per request.

The engine is not thread-safe and its forward pass is CPU-bound, so one thread owns it: at the top
of each iteration it applies the adds and aborts that handlers queued, then runs ``step()`` and
hands every output to its request's asyncio.Queue through ``loop.call_soon_threadsafe``. Requests
from any connection therefore join the running batch at the next step, and the event loop never
runs model code. When there is nothing to do, the thread sleeps on a condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """Admission control refused the request: too many are already waiting."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a failed step, or shutdown); nothing more will be generated."""


class RequestStream:
    """One request's view of the engine, used on the event loop only.

    ``admitted`` resolves once the engine thread has run ``add_request`` (to its ValueError if
    the engine refused the request); iterating yields each step's RequestOutput until the final one.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.admitted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._abort = abort

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    def _admit(self, error: BaseException | None) -> None:
        if self.admitted.done():
            return
        if error is None:
            self.admitted.set_result(None)
        else:
            self.admitted.set_exception(error)

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


@dataclass
class _Add:
    stream: RequestStream
    prompt: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    """Owns the engine thread; every public method is called from the event loop."""

    def __init__(self, engine: LLMEngine, max_waiting: int, metrics: ServerMetrics) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cond
        self._num_queued_adds = 0  # guarded by _cond: adds not yet applied by the engine thread
        self._num_waiting = 0  # guarded by _cond: the engine's waiting count after the last update
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- event-loop side ----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="iterserve-engine", daemon=True)
        self._thread.start()

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; unfinished requests are aborted."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Requests not yet in the running batch: queued to the engine thread or waiting in it."""
        with self._cond:
            return self._num_queued_adds + self._num_waiting

    def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float
    ) -> RequestStream:
        """Queue a request for the engine thread; raises QueueFullError or EngineDeadError at once."""
        if self._loop is None or not self.is_running:
            raise EngineDeadError(self._dead_message())
        stream = RequestStream(request_id, self._loop, self.abort)
        with self._cond:
            waiting = self._num_queued_adds + self._num_waiting
            if waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_waiting})")
            self._num_queued_adds += 1
            self._commands.append(_Add(stream, prompt, params, arrival_time))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"the engine loop has stopped after an error: {self.error!r}"
        return "the engine loop is not running"

    # -- engine-thread side -------------------------------------------------------------------

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is left to read
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                self._apply(commands)
                outputs = engine.step() if engine.has_unfinished_requests() else []
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001 - any failure ends the loop; handlers must hear of it
            self.error = e
            logger.exception("engine loop failed; failing all requests")
        finally:
            self._shutdown()

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        admitted: list[tuple[RequestStream, BaseException | None]] = []
        for cmd in commands:
            if isinstance(cmd, _Add):
                rid = cmd.stream.request_id
                try:
                    self.engine.add_request(cmd.prompt, cmd.params, rid, cmd.arrival_time)
                except Exception as e:  # noqa: BLE001 - a refused request is that request's error only
                    admitted.append((cmd.stream, e))
                    continue
                self._streams[rid] = cmd.stream
                admitted.append((cmd.stream, None))
            else:
                self._streams.pop(cmd.request_id, None)
                if self.engine.abort_request(cmd.request_id):
                    self.metrics.record_finish_reason("abort")
        num_adds = sum(isinstance(c, _Add) for c in commands)
        with self._cond:
            self._num_queued_adds -= num_adds
            self._num_waiting = self.engine.num_waiting
        if admitted:
            self._post(_admit_all, admitted)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.metrics.record_finished(out)
            if stream is not None:
                batch.append((stream, out))
        with self._cond:
            self._num_waiting = self.engine.num_waiting
            pending = self._num_queued_adds
        self.metrics.record_step(self.engine, pending)
        if batch:
            self._post(_put_all, batch)

    def _shutdown(self) -> None:
        """Abort what is left so the engine is clean, and tell every open stream it is over."""
        error = EngineDeadError(self._dead_message() if self.error else "the server is shutting down")
        with self._cond:
            self._stopping = True
            commands, self._commands = self._commands, []
            self._num_queued_adds = 0
        refused = [(c.stream, error) for c in commands if isinstance(c, _Add)]
        try:
            for rid in list(self.engine.requests):
                if self.engine.abort_request(rid):
                    self.metrics.record_finish_reason("abort")
            self.metrics.record_step(self.engine, 0)
        except Exception:  # noqa: BLE001 - the engine may be broken; the streams must still hear
            logger.exception("could not abort the remaining requests")
        streams = list(self._streams.values())
        self._streams.clear()
        self._post(_admit_all, refused)
        self._post(_put_all, [(s, error) for s in streams])


def _admit_all(items: list[tuple[RequestStream, BaseException | None]]) -> None:
    for stream, error in items:
        stream._admit(error)


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)

