"""The server's engine: the EngineCore in a process of its own, and the client the API process uses.

The core process (spawned, so it shares no torch state with the API process) loads the model and
runs the busy loop on its main thread: drain the input socket, step, push one batch of deltas and
the scheduler's counters. The API process (HTTP, tokenization, detokenization, stop strings)
holds the model's config and tokenizer only. Two ZeroMQ sockets over IPC carry msgspec messages:

    API process --PUSH--> [EngineCoreRequest | AbortRequests | Shutdown] --PULL--> core
    API process <--PULL-- [EngineReady | EngineCoreOutputs | EngineFailed] <--PUSH-- core

Requests from any connection join the batch at the core's next step. If the core process dies,
every open stream gets :class:`EngineDeadError` and ``on_dead`` is called (the server exits).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from iterserve.config import ModelConfig
from iterserve.engine.core import Capacity, EngineConfig, EngineCore, check_prompt
from iterserve.engine.messages import (
    AbortRequests,
    EngineCoreEvent,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineReady,
    KVSnapshot,
    SchedulerStats,
    Shutdown,
    StepStats,
    WatchKV,
)
from iterserve.engine.output_processor import OutputProcessor, RequestOutputKind
from iterserve.models.loader import load_model_info
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ORPHAN_CHECK_S = 1.0  # how often an idle core checks that the API process is still there (a busy one: every step)


class QueueFullError(Exception):
    """Admission control refused the request: too many are already waiting."""


class EngineDeadError(RuntimeError):
    """The engine process has stopped (it died, or the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """A step that ran this request failed in the core; the traceback is in the core's log."""


# -- the core process ---------------------------------------------------------------------------


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str) -> None:
    """The core process's entry point: load the model, then run the busy loop on this main thread.

    Signals are ignored here: the API process decides when the core stops (it sends Shutdown), and
    an orphaned core notices its parent is gone and exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    parent = os.getppid()
    try:
        core = EngineCore(config)
    except Exception as e:  # noqa: BLE001 - the API process must hear why the core did not start
        logger.exception("the engine core could not start")
        outputs.send(encoder.encode(EngineFailed(f"{type(e).__name__}: {e}")))
        outputs.close(linger=2000)
        raise SystemExit(1) from None
    core.emit_steps = True  # every step's record goes to the API process (its dashboard)
    outputs.send(encoder.encode(EngineReady(os.getpid())))
    try:
        _busy_loop(core, inputs, outputs, encoder, parent)
    except Exception:  # noqa: BLE001 - a broken loop is fatal; say so before exiting
        logger.exception("the engine core loop failed")
        outputs.send(encoder.encode(EngineFailed("the engine core loop failed")))
        raise SystemExit(1) from None
    finally:
        core.close()
        outputs.close(linger=2000)
        inputs.close(linger=0)
        ctx.term()


def _busy_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder,
               parent: int) -> None:
    decoder = msgspec.msgpack.Decoder(EngineCoreInput)
    while True:
        if not core.has_unfinished_requests():
            while not inputs.poll(int(ORPHAN_CHECK_S * 1000)) and os.getppid() == parent:
                pass
        if os.getppid() != parent:  # nobody reads the outputs any more: a send would block for ever
            logger.warning("the API process is gone; the engine core exits")
            return
        errors: list[EngineCoreOutput] = []
        while True:
            try:
                msg = decoder.decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                for request_id in msg.request_ids:
                    core.abort_request(request_id)
                continue
            if isinstance(msg, WatchKV):
                core.watch_kv = msg.on
                continue
            try:
                core.add_request(msg)
            except ValueError as e:  # the API side validates first; this is a second line of defence
                logger.warning("refused request %s: %s", msg.request_id, e)
                errors.append(EngineCoreOutput(msg.request_id, [], time.perf_counter(), finish_reason="error"))
        step = core.step() if core.has_unfinished_requests() else EngineCoreOutputs([], core.stats())
        step.outputs[:0] = errors
        step.kv = core.kv_snapshot(force=not core.has_unfinished_requests())  # an idle pool's last state
        outputs.send(encoder.encode(step))


# -- the API process's side ------------------------------------------------------------------------


class EngineObserver(Protocol):
    """Where the client reports what it sees (the server's Prometheus metrics)."""

    def record_stats(self, stats: SchedulerStats, num_waiting: int) -> None: ...

    def record_admitted(self, max_tokens: int) -> None: ...

    def record_finished(self, output: RequestOutput) -> None: ...

    def record_finish_reason(self, reason: str) -> None: ...


class StepObserver(Protocol):
    """Where the client reports each step's record, KV snapshots and finished requests (the dashboard)."""

    def record_step(self, step: StepStats | None, kv: KVSnapshot | None, stats: SchedulerStats) -> None: ...

    def record_finished(self, output: RequestOutput) -> None: ...


class RequestStream:
    """One request's outputs, consumed on the event loop.

    A consumer that falls behind never makes the buffer grow by a step: unread deltas are merged into
    one pending output, so what a stream holds is bounded by what the request generates.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
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

    def _put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            self._pending.add(output)
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()


class EngineCoreClient:
    """Owns the core process and the output side; every public method is called on the event loop."""

    def __init__(self, config: EngineConfig, *, max_waiting: int, observer: EngineObserver | None = None,
                 log_level: str = "INFO") -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.config = config
        self.max_waiting = max_waiting
        self.observer = observer
        self.step_observer: StepObserver | None = None
        self.log_level = log_level
        self.model_config: ModelConfig
        self.tokenizer: Tokenizer | None
        self.model_config, self.tokenizer = load_model_info(config.model)
        self.capacity = Capacity.of(config, self.model_config)
        self.max_model_len = self.capacity.max_model_len
        self.on_dead: Callable[[], None] | None = None
        self.error: EngineDeadError | None = None
        self.pid: int | None = None
        self._output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._idle = asyncio.Event()
        self._stats: SchedulerStats | None = None
        self._num_sent = 0
        self._accepting = False
        self._stopping = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._task: asyncio.Task[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._tmp = ""
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._input: zmq.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core process and wait until it has loaded the model; raises if it cannot start."""
        self._tmp = tempfile.mkdtemp(prefix="iterserve-")
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._input.bind(in_addr)
        self._actx = zmq.asyncio.Context()
        self._output = self._actx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(target=run_engine_core, args=(self.config, in_addr, out_addr, self.log_level),
                                   name="iterserve-engine-core", daemon=True)
        self._proc.start()
        decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        while not await self._output.poll(100):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._proc.exitcode} while starting")
        msg = decoder.decode(await self._output.recv())
        if isinstance(msg, EngineFailed):
            await asyncio.to_thread(self._proc.join, 10)
            raise RuntimeError(f"the engine core could not start: {msg.message}")
        assert isinstance(msg, EngineReady)
        self.pid = msg.pid
        logger.info("engine core process %d ready", msg.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_process_exit)
        self._task = asyncio.create_task(self._output_loop(decoder))
        self._accepting = True
        self._idle.set()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give running ones ``timeout`` seconds, then end the rest with an error."""
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("ending %d requests still running after %.1f s", len(self._streams), timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    async def stop(self, timeout: float = 10.0) -> None:
        """Shut the core process down (killing it if it does not stop in time) and end open streams."""
        self._accepting = False
        self._stopping = True
        proc = self._proc
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                self._send(Shutdown())
                await asyncio.to_thread(proc.join, timeout)
            if proc.is_alive():
                logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._task is not None:
            self._task.cancel()
        for sock in (self._input, self._output):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        return self._accepting and self.error is None and self._proc is not None and self._proc.is_alive()

    # -- requests -------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests the core has queued or will queue: its waiting count, plus the requests sent but not
        yet seen by it that the free batch slots cannot take."""
        s = self._stats
        waiting, running, received = (s.num_waiting, s.num_running, s.num_requests_received) if s else (0, 0, 0)
        free = 0 if waiting else max(0, self.config.max_num_seqs - running)
        return waiting + max(0, self._num_sent - received - free)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float,
                    stream: bool = True) -> RequestStream:
        """Send a request to the core; raises EngineDeadError, RequestError, QueueFullError or ValueError at once."""
        if not self.is_running:
            raise EngineDeadError(str(self.error) if self.error else "the engine is not running")
        max_tokens = check_prompt(prompt, params, self.model_config.vocab_size, self.max_model_len,
                                  self.config.max_num_seqs)  # bad input first
        waiting = self.num_waiting
        if waiting >= self.max_waiting:
            raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_waiting})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.observer is not None:
            self.observer.record_admitted(max_tokens)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        self._output_processor.add_request(request_id, None, prompt, params, arrival_time, kind)
        handle = RequestStream(request_id, self.abort)
        self._streams[request_id] = handle
        self._idle.clear()
        self._send(EngineCoreRequest(request_id, prompt, params, arrival_time))
        self._num_sent += 1
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (its consumer went away); frees its blocks in the core at the next step."""
        self._forget(request_id)
        if self._output_processor.abort(request_id):
            self._send(AbortRequests([request_id]))
            if self.observer is not None:
                self.observer.record_finish_reason("abort")

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def watch_kv(self, on: bool) -> None:
        """Ask the core for KV block snapshots (a dashboard opened), or to stop taking them."""
        self._send(WatchKV(on))

    def _send(self, msg: EngineCoreInput) -> None:
        if self._input is not None and self.error is None:
            self._input.send(self._encoder.encode(msg), zmq.NOBLOCK)

    # -- outputs --------------------------------------------------------------------------------

    async def _output_loop(self, decoder: msgspec.msgpack.Decoder) -> None:
        assert self._output is not None
        try:
            while True:
                msg = decoder.decode(await self._output.recv())
                if isinstance(msg, EngineFailed):
                    self._die(f"the engine core failed: {msg.message}")
                    return
                if isinstance(msg, EngineCoreOutputs):
                    self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - without this loop nothing is delivered: fail loudly
            logger.exception("the engine output loop failed")
            self._die("the engine output loop failed")

    def _handle(self, msg: EngineCoreOutputs) -> None:
        self._stats = msg.stats
        processed = self._output_processor.process_outputs(msg.outputs)
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            reason = out.outputs[0].finish_reason
            if out.finished:
                self._forget(out.request_id)
                if self.observer is not None:
                    if reason == "error":
                        self.observer.record_finish_reason("error")
                    else:
                        self.observer.record_finished(out)
                if self.step_observer is not None and reason != "error":
                    self.step_observer.record_finished(out)
            if stream is None:
                continue
            if reason == "error":
                stream._fail(RequestFailedError("the engine failed while generating this request"))
            else:
                stream._put(out)
        if processed.to_abort:
            self._send(AbortRequests(processed.to_abort))
        if self.observer is not None:
            self.observer.record_stats(msg.stats, self.num_waiting)
        if self.step_observer is not None:
            self.step_observer.record_step(msg.step, msg.kv, msg.stats)

    # -- death ----------------------------------------------------------------------------------

    def _on_process_exit(self) -> None:
        assert self._proc is not None
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if not self._stopping:
            self._proc.join(1)
            self._die(f"the engine process exited unexpectedly (exit code {self._proc.exitcode})")

    def _die(self, message: str) -> None:
        if self.error is not None:
            return
        logger.error("%s; failing %d open requests", message, len(self._streams))
        self.error = EngineDeadError(message)
        self._accepting = False
        self._fail_all(self.error)
        if self.on_dead is not None:
            self.on_dead()

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._output_processor.abort(request_id)
            stream._fail(error)
        self._idle.set()
