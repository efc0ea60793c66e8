"""One engine core process as the API process sees it: its config, sockets, process and latest stats; how it
is spawned and how its start is awaited. :class:`~iterserve.engine.core_client.EngineCoreClient` holds one per
data-parallel replica and spawns a new one in place of a core that died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec
import torch
import zmq
import zmq.asyncio

from iterserve.config import EngineConfig
from iterserve.config.runtime import DataParallelBackend
from iterserve.engine.core_proc import run_engine_core
from iterserve.engine.messages import EngineCoreInput, EngineFailed, EngineReady, SchedulerStats


class CoreHandle(Protocol):
    """What the client watches of a core: a local process, or a Ray actor (:class:`~.ray_core.RayCore`)."""

    @property
    def sentinel(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


@dataclass
class CoreProcess:
    """One replica's core; ``generation`` counts the processes it has had (restarts add one)."""

    index: int
    config: EngineConfig
    label: str  # "" with one core, else "replica N: ", put before what the log and errors say about it
    backend: DataParallelBackend = "mp"
    pid: int | None = None
    stats: SchedulerStats | None = None
    num_sent: int = 0
    num_open: int = 0  # requests sent and not finished
    heard: float = 0.0  # (loop time) its last message, or when it was given work while idle
    dead: bool = False
    generation: int = 0
    restarts: list[float] = dataclasses.field(default_factory=list)  # (loop time) when each restart began
    proc: CoreHandle | None = None
    task: asyncio.Task[None] | None = None
    input: zmq.Socket | None = None
    output: zmq.asyncio.Socket | None = None

    @property
    def num_waiting(self) -> int:
        """Requests the core has queued or will queue: its waiting count, plus the requests sent but not
        yet seen by it that the free batch slots cannot take."""
        s = self.stats
        waiting, running, received = (s.num_waiting, s.num_running, s.num_requests_received) if s else (0, 0, 0)
        free = 0 if waiting else max(0, self.config.max_num_seqs - running)
        return waiting + max(0, self.num_sent - received - free)

    def send(self, encoder: msgspec.msgpack.Encoder, msg: EngineCoreInput) -> None:
        self.send_encoded(encoder.encode(msg))

    def send_encoded(self, message: bytes) -> None:
        if self.input is not None and not self.dead:
            self.input.send(message, zmq.NOBLOCK)

    def spawn(self, ctx: zmq.Context, actx: zmq.asyncio.Context, tmp: str, log_level: str,
              threads: int | None) -> None:
        """Start a new core process on fresh sockets (a restarted core's old ones are closed first)."""
        self.close_sockets()
        self.generation += 1
        self.stats, self.num_sent, self.num_open, self.pid = None, 0, 0, None
        self.input = ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self.output = actx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        if self.backend == "ray":  # the actor may run on another node: TCP on this node's cluster address
            from iterserve.engine.ray_core import RayCore, node_address

            host = node_address()
            in_addr, out_addr = (f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
                                 for sock in (self.input, self.output))
            self.proc = RayCore(self.index, self.config, in_addr, out_addr, log_level, threads)
            return
        in_addr, out_addr = (f"ipc://{tmp}/{kind}{self.index}.{self.generation}" for kind in ("in", "out"))
        self.input.bind(in_addr)
        self.output.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(target=run_engine_core, args=(self.config, in_addr, out_addr, log_level, threads),
                                name=f"iterserve-engine-core-{self.index}", daemon=True)
        process.start()
        self.proc = process

    async def handshake(self, decoder: msgspec.msgpack.Decoder) -> EngineReady:
        """Wait until the core has loaded the model; raises RuntimeError with its reason if it cannot."""
        assert self.proc is not None and self.output is not None
        while not await self.output.poll(100):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.label}the engine core process exited with code {self.proc.exitcode} "
                                   "while starting")
        msg = decoder.decode(await self.output.recv())
        if isinstance(msg, EngineFailed):
            await asyncio.to_thread(self.proc.join, 10)
            raise RuntimeError(f"{self.label}the engine core could not start: {msg.message}")
        assert isinstance(msg, EngineReady)
        self.pid = msg.pid
        return msg

    def close_sockets(self) -> None:
        for sock in (self.input, self.output):
            if sock is not None:
                sock.close(linger=0)
        self.input = self.output = None


def replica_configs(config: EngineConfig, num_replicas: int) -> list[EngineConfig]:
    """Each data-parallel replica's config: on CUDA its own device (replica i on cuda:i), its own step trace
    file (``steps.jsonl`` -> ``steps.0.jsonl``, ``steps.1.jsonl``, ...) and KV-event endpoints."""
    if num_replicas == 1:
        return [config]
    if config.tensor_parallel_size > 1:  # each replica's ranks would need their own devices and ports
        raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet; "
                         "run one tensor-parallel server per replica behind a load balancer (docs/scaling.md)")
    device = config.device
    devices: list[str | None] = [device] * num_replicas
    if device is not None and device.startswith("cuda:"):
        raise ValueError(f"device {device!r} names one GPU for {num_replicas} replicas; give --device cuda, "
                         "which places replica i on cuda:i")
    if device == "cuda" or (device is None and torch.cuda.is_available()):
        found = torch.cuda.device_count()
        if found < num_replicas:
            raise ValueError(f"data_parallel_size {num_replicas} needs one CUDA device per replica; found {found}")
        devices = [f"cuda:{i}" for i in range(num_replicas)]
    traces: list[str | None] = [None] * num_replicas
    if config.step_trace:
        path = Path(config.step_trace)
        traces = [str(path.with_name(f"{path.stem}.{i}{path.suffix}")) for i in range(num_replicas)]
    events = config.kv_events_config  # each replica publishes on its own port (the port + its index)
    return [dataclasses.replace(config, device=d, step_trace=t,
                                kv_events_config=events.for_rank(i) if events is not None else None)
            for i, (d, t) in enumerate(zip(devices, traces))]
