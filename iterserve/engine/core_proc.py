"""The server's engine core process: load the model, then the busy loop that feeds :class:`EngineCore` what the
API process sends and sends back each step's outputs (ZeroMQ, msgpack). Spawned by
:mod:`iterserve.engine.core_client`."""

from __future__ import annotations

import logging
import math
import os
import signal
import threading

import msgspec
import torch
import zmq

from iterserve.config import EngineConfig
from iterserve.engine.core import EngineCore
from iterserve.engine.executor import Executor
from iterserve.engine.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    LoadedWeights,
    ResetPrefixCache,
    Shutdown,
    WatchKV,
)
from iterserve.platforms.malloc import release_free_heap
from iterserve.quantization.model import weight_formats
from iterserve.sampling_params import grammar_checks_deferred

logger = logging.getLogger(__name__)

ORPHAN_CHECK_S = 1.0  # how often an idle core checks that the API process is still there (a busy one: every step)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str,
                    num_threads: int | None = None) -> None:
    """The core process's entry point: load the model, then run the busy loop on this main thread
    (with ``num_threads`` torch threads where replicas share the CPU).

    Signals are ignored here: the API process decides when the core stops (it sends Shutdown), and
    an orphaned core notices its parent is gone and exits.
    """
    if threading.current_thread() is threading.main_thread():  # a Ray actor may run it on another thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
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
    outputs.send(encoder.encode(EngineReady(os.getpid(), loaded_weights(core.executor))))
    try:
        _busy_loop(core, inputs, outputs, encoder, parent)
    except Exception as e:  # noqa: BLE001 - a broken loop is fatal; say so before exiting
        logger.exception("the engine core loop failed")
        outputs.send(encoder.encode(EngineFailed(f"the engine core loop failed: {type(e).__name__}: {e}")))
        raise SystemExit(1) from None
    finally:
        core.close()
        outputs.close(linger=2000)
        inputs.close(linger=0)
        ctx.term()


def loaded_weights(executor: Executor) -> list[LoadedWeights]:
    """The weights this process's worker holds, by format; none where no model runs in this process."""
    worker = getattr(executor, "worker", None)
    if worker is None:
        return []
    return [LoadedWeights(f.fmt, f.tensors, f.parameters, f.bytes) for f in weight_formats(worker.loaded.model)]


def _busy_loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder,
               parent: int) -> None:
    decoder = msgspec.msgpack.Decoder(EngineCoreInput)
    stepped = False
    while True:
        if not core.has_unfinished_requests():
            if stepped:  # the burst's requests, buffers and outputs are freed: their pages go back, once
                release_free_heap()
                stepped = False
            while not inputs.poll(int(ORPHAN_CHECK_S * 1000)) and os.getppid() == parent:
                pass
        elif (hold := core.scheduler.hold_s()) > 0:  # a dynamic batch waits to fill: until a request or its time
            inputs.poll(math.ceil(min(hold, ORPHAN_CHECK_S) * 1000))
        if os.getppid() != parent:  # nobody reads the outputs any more: a send would block for ever
            logger.warning("the API process is gone; the engine core exits")
            return
        errors: list[EngineCoreOutput] = []
        while True:
            try:  # the API process proved each grammar runs; the grammar pool compiles it, off this loop
                with grammar_checks_deferred():
                    msg = decoder.decode(inputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                for request_id in msg.request_ids:
                    core.abort_request(request_id)
                for request_id, index in msg.sequences:
                    core.abort_sequence(request_id, index)
                continue
            if isinstance(msg, WatchKV):
                core.watch_kv = msg.on
                continue
            if isinstance(msg, ResetPrefixCache):
                core.reset_prefix_cache()
                continue
            try:
                core.add_request(msg)
            except ValueError as e:  # the API side validates first; this is a second line of defence
                logger.warning("refused request %s: %s", msg.request_id, e)
                errors.append(EngineCoreOutput(msg.request_id, [], core.clock(), finish_reason="error", error=str(e)))
        stepped = stepped or core.has_unfinished_requests()
        step = core.step() if core.has_unfinished_requests() else EngineCoreOutputs([], core.stats())
        step.outputs[:0] = errors
        step.kv = core.kv_snapshot(force=not core.has_unfinished_requests())  # an idle pool's last state
        outputs.send(encoder.encode(step))
