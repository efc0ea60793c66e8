"""The client the API process uses to run the EngineCore in a process of its own.

The core process (spawned, so it shares no torch state with the API process) loads the model and
runs the busy loop on its main thread (:func:`iterserve.engine.core_proc.run_engine_core`): drain the
input socket, step, push one batch of deltas and the scheduler's counters. The API process (HTTP,
tokenization, detokenization, stop strings) holds the model's config and tokenizer only. Two ZeroMQ
sockets over IPC carry msgspec messages:

    API process --PUSH--> [EngineCoreRequest | AbortRequests | Shutdown] --PULL--> core
    API process <--PULL-- [EngineReady | EngineCoreOutputs | EngineFailed] <--PUSH-- core

Requests from any connection join the batch at the core's next step. With ``data_parallel_size``
N there are N core processes (replicas), each with its own pair of sockets and its own KV pool;
:class:`iterserve.engine.router.Router` picks each request's replica. If a core process dies, every
open stream it held gets :class:`EngineDeadError`, the client takes no new requests, and
``on_dead`` is called (the server exits).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import shutil
import tempfile
from collections.abc import Callable
from typing import get_args

import msgspec
import torch
import zmq
import zmq.asyncio

from iterserve.config import EngineConfig, ModelConfig
from iterserve.config.runtime import DataParallelBackend
from iterserve.engine.capacity import Capacity
from iterserve.engine.core_process import CoreProcess, replica_configs
from iterserve.engine.messages import (
    AbortRequests,
    EngineCoreEvent,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    EngineObserver,
    EngineReady,
    LoadedWeights,
    ResetPrefixCache,
    Shutdown,
    StepObserver,
    WatchKV,
)
from iterserve.engine.output_processor import OutputProcessor
from iterserve.engine.request_stream import RequestStream
from iterserve.engine.router import Router
from iterserve.engine.validation import check_prompt
from iterserve.errors import EngineDeadError, QueueFullError, RequestFailedError
from iterserve.lora.request import LoRARequest
from iterserve.models.loader import load_model_config, load_model_info
from iterserve.sampling_params import RequestOutputKind, SamplingParams
from iterserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3  # a replica's core is restarted this many times ...
RESTART_WINDOW_S = 600.0  # ... within this long; once more and the server gives up (exits 1)

# -- the API process's side ------------------------------------------------------------------------


class EngineCoreClient:
    """Owns the core processes (``data_parallel_size`` replicas, each with its own KV pool) and the
    output side; the :class:`Router` picks each request's replica. Every public method is called on
    the event loop."""

    def __init__(self, config: EngineConfig, *, max_waiting: int, observer: EngineObserver | None = None,
                 log_level: str = "INFO", data_parallel_size: int = 1, stall_timeout: float = 60.0,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, data_parallel_backend: DataParallelBackend = "mp") -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if data_parallel_backend not in get_args(DataParallelBackend):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {data_parallel_backend!r}")
        self.config = config
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.observer = observer
        self.step_observer: StepObserver | None = None
        self.log_level = log_level
        self.model_config: ModelConfig
        self.tokenizer: Tokenizer | None
        self.model_config, self.tokenizer = load_model_info(config.model)
        spec = config.speculative_config
        draft = load_model_config(spec.model) if spec is not None and spec.model else None  # shares the blocks
        self.capacity = Capacity.of(config, self.model_config, draft=draft)  # each replica's
        self.max_model_len = self.capacity.max_model_len
        self.weights: list[LoadedWeights] = []  # what replica 0's core holds, by format, once it is ready
        self.on_dead: Callable[[], None] | None = None
        self.error: EngineDeadError | None = None
        n = data_parallel_size
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self._cores = [CoreProcess(i, c, f"replica {i}: " if n > 1 else "", data_parallel_backend)
                       for i, c in enumerate(replica_configs(config, n))]
        # replicas that share the CPU share its cores too, rather than each running one thread per core
        on_cpu = not (self._cores[0].config.device or "cpu").startswith("cuda")
        if data_parallel_backend == "ray" and not on_cpu:
            raise ValueError("data_parallel_backend 'ray' places CPU engine cores only; on GPUs use 'mp'")
        if data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("data_parallel_backend 'ray' needs Ray, which is not installed: pip install ray")
        # a Ray actor computes on the CPU it reserves (Ray sets its thread count)
        self._threads = max(1, torch.get_num_threads() // n) if n > 1 and on_cpu and data_parallel_backend == "mp" \
            else None
        self.router = Router(n, config.block_size, self.capacity.num_blocks, config.enable_prefix_caching)
        self._output_processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._idle = asyncio.Event()
        self._accepting = False
        self._stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self._restarting: set[asyncio.Task[None]] = set()
        self._tmp = ""
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core processes and wait until each has loaded the model; raises (having stopped
        them all) if one cannot start."""
        self._tmp = tempfile.mkdtemp(prefix="iterserve-")
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        for core in self._cores:  # all load at once; their handshakes are awaited in turn
            core.spawn(self._ctx, self._actx, self._tmp, self.log_level, self._threads)
        try:
            for core in self._cores:
                self._ready(core, await core.handshake(self._decoder))
        except BaseException:
            await self.stop(timeout=1)
            raise
        for core in self._cores:
            self._watch(core)
        self._accepting = True
        self._idle.set()

    def _ready(self, core: CoreProcess, msg: EngineReady) -> None:
        if core.index == 0:
            self.weights = msg.weights
        if self.observer is not None:
            self.observer.record_weights(core.index, msg.weights)
        logger.info("engine core process %d ready%s", msg.pid,
                    f" (replica {core.index} of {len(self._cores)})" if core.label else "")

    def _watch(self, core: CoreProcess) -> None:
        """Hear of the core's exit, and read its outputs."""
        assert core.proc is not None
        asyncio.get_running_loop().add_reader(core.proc.sentinel, self._on_process_exit, core)
        core.task = asyncio.create_task(self._output_loop(core))

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give running ones ``timeout`` seconds, then end the rest with an error."""
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("ending %d requests still running after %.1f s", self.num_requests, timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    async def stop(self, timeout: float = 10.0) -> None:
        """Shut the core processes down (killing those that do not stop in time) and end open streams."""
        self._accepting = False
        self._stopping = True
        for task in self._restarting:
            task.cancel()
        loop = asyncio.get_running_loop()
        procs = [core.proc for core in self._cores if core.proc is not None]
        for core in self._cores:
            if core.proc is not None:
                loop.remove_reader(core.proc.sentinel)
                if core.proc.is_alive():
                    core.send(self._encoder, Shutdown())
        await asyncio.gather(*(asyncio.to_thread(proc.join, timeout) for proc in procs))
        for proc in procs:
            if proc.is_alive():
                logger.warning("the engine core %s did not stop within %.0f s; killing it", proc.pid, timeout)
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self._fail_all(EngineDeadError("the server is shutting down"))
        for core in self._cores:
            if core.task is not None:
                core.task.cancel()
            core.close_sockets()
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        """Taking requests, with a replica alive to run them (others may be restarting)."""
        return self._accepting and self.error is None and bool(self._live())

    def _live(self) -> list[CoreProcess]:
        return [core for core in self._cores if not core.dead and core.proc is not None and core.proc.is_alive()]

    def health_problem(self) -> str | None:
        """Why the engine cannot serve, or None: not taking requests, a dead replica, or a replica that
        holds requests and has sent nothing for ``stall_timeout`` seconds (stopped, or stuck in a step)."""
        if not self.is_running:
            if self._accepting and self.error is None:
                return "the engine core is restarting"
            return str(self.error) if self.error else "the engine is not running"
        now = asyncio.get_running_loop().time()
        for core in self._cores:
            silent = now - core.heard
            if core.num_open and silent > self.stall_timeout:
                return (f"{core.label}the engine core has made no progress for {silent:.0f} s with {core.num_open} "
                        f"requests open (limit {self.stall_timeout:g} s)")
        return None

    @property
    def data_parallel_size(self) -> int:
        return len(self._cores)

    @property
    def pids(self) -> list[int | None]:
        """Each replica's core process id, in replica order."""
        return [core.pid for core in self._cores]

    # -- requests -------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests sent and not finished, over all replicas."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests the cores have queued or will queue, over all replicas."""
        return sum(core.num_waiting for core in self._cores)

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's max_tokens, once its prompt and params are proven to fit the model; RequestError if not."""
        return check_prompt(prompt, params, self.model_config.vocab_size, self.max_model_len,
                            self.config.max_num_seqs, self.config.max_logprobs)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival_time: float,
                    stream: bool = True, admitted: bool = False, kind: RequestOutputKind | None = None,
                    lora: LoRARequest | None = None) -> RequestStream:
        """Send a request to a core; raises EngineDeadError, RequestError, QueueFullError or ValueError at once.
        ``admitted``: a later prompt of a request the queue took already (its caller bounds their number),
        sent whatever the queue holds. Outputs come as ``kind`` says, else as deltas when ``stream`` and
        the final output alone when not."""
        if not self.is_running:
            raise EngineDeadError(self.health_problem() or "the engine is not running")
        max_tokens = self.check_request(prompt, params)  # bad input first
        waiting = self.num_waiting
        if waiting >= self.max_waiting and not admitted:
            raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_waiting})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:  # before anything is registered: a request that cannot be sent leaves nothing behind
            message = self._encoder.encode(EngineCoreRequest(request_id, prompt, params, arrival_time, lora))
        except (OverflowError, TypeError) as e:
            raise ValueError(f"the request cannot be sent to the engine: {e}") from e
        down = {core.index for core in self._cores if core.dead}
        core = self._cores[self.router.route(request_id, prompt, max_tokens * params.num_seqs, exclude=down)]
        if self.observer is not None:
            self.observer.record_admitted(core.index, max_tokens)
        kind = kind or (RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        self._output_processor.add_request(request_id, None, prompt, params, arrival_time, kind)
        handle = RequestStream(request_id, self.abort, merge=kind is RequestOutputKind.DELTA)
        self._streams[request_id] = handle
        self._idle.clear()
        core.send_encoded(message)
        core.num_sent += 1
        if not core.num_open:  # an idle core owes nothing until now
            core.heard = asyncio.get_running_loop().time()
        core.num_open += 1
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request (its consumer went away); frees its blocks in the core at the next step."""
        index = self._forget(request_id)
        if self._output_processor.abort(request_id) and index is not None:
            self._cores[index].send(self._encoder, AbortRequests([request_id]))
            if self.observer is not None:
                self.observer.record_finish_reason(index, "abort")

    def _forget(self, request_id: str) -> int | None:
        """Drop the request's stream and its router entry; returns its replica (None if it already left)."""
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()
        index = self.router.finish(request_id)
        if index is not None:
            self._cores[index].num_open -= 1
        return index

    def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache; a request sent after this call finds nothing cached (each core
        reads its messages in order)."""
        for core in self._live():
            core.send(self._encoder, ResetPrefixCache())

    def watch_kv(self, on: bool) -> None:
        """Ask the core the dashboard shows (replica 0) for KV block snapshots, or to stop taking them."""
        if self.error is None:
            self._cores[0].send(self._encoder, WatchKV(on))

    # -- outputs --------------------------------------------------------------------------------

    async def _output_loop(self, core: CoreProcess) -> None:
        assert core.output is not None
        try:
            while True:
                msg = self._decoder.decode(await core.output.recv())
                core.heard = asyncio.get_running_loop().time()
                if isinstance(msg, EngineFailed):
                    self._die(core, f"the engine core failed: {msg.message}")
                    return
                if isinstance(msg, EngineCoreOutputs):
                    self._handle(core, msg)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - without this loop nothing is delivered: fail loudly
            logger.exception("%sthe engine output loop failed", core.label)
            self._die(core, "the engine output loop failed")

    def _handle(self, core: CoreProcess, msg: EngineCoreOutputs) -> None:
        core.stats = msg.stats
        processed = self._output_processor.process_outputs(msg.outputs)
        for out in processed.outputs:
            stream = self._streams.get(out.request_id)
            reason = out.outputs[0].finish_reason
            if out.finished:
                self._forget(out.request_id)
                if self.observer is not None:
                    if reason == "error":
                        self.observer.record_finish_reason(core.index, "error")
                    else:
                        self.observer.record_finished(core.index, out)
                if self.step_observer is not None and reason != "error" and core.index == 0:
                    self.step_observer.record_finished(out)
            if stream is None:
                continue
            if reason == "error":
                error = processed.errors.get(out.request_id)
                stream._fail(RequestFailedError(error, by_request=True) if error else
                             RequestFailedError("the engine failed while generating this request"))
            else:
                stream._put(out)
        if processed.to_abort or processed.seqs_to_abort:
            core.send(self._encoder, AbortRequests(processed.to_abort, processed.seqs_to_abort))
        if self.observer is not None:
            self.observer.record_stats(core.index, msg.stats, core.num_waiting)
        if self.step_observer is not None and core.index == 0:  # the dashboard shows one engine: replica 0
            self.step_observer.record_step(msg.step, msg.kv, msg.stats)

    # -- death ----------------------------------------------------------------------------------

    def _on_process_exit(self, core: CoreProcess) -> None:
        assert core.proc is not None
        asyncio.get_running_loop().remove_reader(core.proc.sentinel)
        if not self._stopping:
            core.proc.join(1)
            self._die(core, f"the engine process exited unexpectedly (exit code {core.proc.exitcode})")

    def _die(self, core: CoreProcess, message: str) -> None:
        """A core is gone: fail the requests it held, then start a new one in its place, or, when it has
        restarted ``max_restarts`` times within ``RESTART_WINDOW_S``, stop taking requests and tell
        ``on_dead`` (once). The other replicas' requests carry on meanwhile."""
        if core.dead:
            return
        core.dead = True
        message = core.label + message
        failed = self.router.requests_on(core.index)
        logger.error("%s; failing %d open requests", message, len(failed))
        error = EngineDeadError(message)
        for request_id in failed:
            self._fail(request_id, error)
        if self._stopping:
            return
        now = asyncio.get_running_loop().time()
        core.restarts = [t for t in core.restarts if now - t < RESTART_WINDOW_S]
        if len(core.restarts) < self.max_restarts:
            core.restarts.append(now)
            task = asyncio.ensure_future(self._restart(core))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)
        else:
            if self.max_restarts:
                error = EngineDeadError(f"{message}; it restarted {len(core.restarts)} times in the last "
                                        f"{RESTART_WINDOW_S:g} s, so the server gives up")
            self._give_up(error)

    async def _restart(self, core: CoreProcess) -> None:
        """A new core process in place of a dead one, with its replica's prefix record forgotten."""
        assert self._ctx is not None and self._actx is not None
        if core.task is not None:
            core.task.cancel()
        if core.proc is not None:
            asyncio.get_running_loop().remove_reader(core.proc.sentinel)
            if core.proc.is_alive():  # a core whose outputs could not be read: it goes too
                core.proc.kill()
            await asyncio.to_thread(core.proc.join, 5)
        self.router.forget(core.index)
        logger.warning("%srestarting the engine core", core.label)
        try:
            core.spawn(self._ctx, self._actx, self._tmp, self.log_level, self._threads)
            self._ready(core, await core.handshake(self._decoder))
        except Exception as e:  # noqa: BLE001 - a core that cannot start again ends the server
            self._give_up(EngineDeadError(f"{core.label}the engine core could not restart: {e}"))
            return
        core.dead = False
        self._watch(core)
        self.num_restarts += 1
        if self.observer is not None:
            self.observer.record_restart(core.index)

    def _give_up(self, error: EngineDeadError) -> None:
        logger.error("%s", error)
        if self.error is None:
            self.error = error
            self._accepting = False
            if self.on_dead is not None:
                self.on_dead()

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)
        self._idle.set()

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        self._forget(request_id)
        self._output_processor.abort(request_id)
        if stream is not None:
            stream._fail(error)
