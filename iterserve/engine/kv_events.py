"""KV-cache events, published as vLLM publishes them (``vllm/distributed/kv_events.py``), so that a KV-aware
router (vllm-router's ``kv_aware`` policy, llm-d's indexer) can follow which prompt prefixes each engine holds.

The block manager records a :class:`BlockStored` for the full blocks a step will fill when the step is
scheduled (their chained hashes, the parent's hash, their tokens), a :class:`BlockRemoved` when cached blocks
are evicted or an announced block never gets computed, and :class:`AllBlocksCleared` when the prefix cache is
reset. The core hands the events to the publisher, as one :class:`KVEventBatch`, right after scheduling (before
the forward pass, so a router learns a prefix's home while its prefill runs) and again after the step. The wire format
is vLLM's since vllm-project/vllm#42892: msgpack of a batch array ``[ts, events, data_parallel_rank]`` whose
events are maps of their fields with the class name under ``"type"`` (vllm-router 0.1.17 rejects the older
array-shaped events), sent on a ZeroMQ PUB socket as ``[topic, sequence number (8 bytes, big-endian),
payload]``; an optional ROUTER socket resends buffered batches from a sequence number a subscriber asks for.

Publishing never blocks the engine: ``publish`` puts the batch on a bounded queue that a thread drains onto
the socket; when the queue is full the batch is dropped and its events counted (:attr:`dropped`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from iterserve.config.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool (the first tier), on whatever device it lives
HASH_MASK = (1 << 64) - 1  # Python's hash is signed; routers read block hashes as unsigned 64-bit integers
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame, as vLLM ends it
SHUTDOWN_TIMEOUT_S = 1.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the events; each encodes as a map, ``tag`` adds ``"type"``: the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # chained: each covers its block and every block before it
    parent_block_hash: int | None  # the block before the first one; None when the first starts the sequence
    token_ids: list[int]  # the blocks' tokens, block_size of them per block
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: int) -> int:
    """A block manager chain hash as the events carry it: the same 64 bits, read as unsigned."""
    return block_hash & HASH_MASK


class ZmqEventPublisher:
    """Batches onto a PUB socket from a thread, with a replay buffer (vLLM's ZmqEventPublisher, which
    blocks when its queue is full where this one drops and counts). ``start`` launches the thread; a
    publisher never started keeps its queue (tests fill it to see the drops)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.dropped = 0  # events dropped because the queue was full
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._running = True
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            _bind_or_connect(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _bind_or_connect(self._replay, config.replay_endpoint, bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("publishing KV-cache events on %s%s", self.config.endpoint,
                    f" (replay on {self.config.replay_endpoint})" if self.config.replay_endpoint else "")

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Queue one batch of ``events``; never waits (a full queue drops it and counts its events)."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.config.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += len(events)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:  # a replay is best effort; the live stream goes on
                    logger.exception("KV-event replay failed")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                break
            seq = next(self._seq)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:  # a PUB socket drops at its high-water mark; an error here is the socket's
                logger.exception("KV-event batch %d not sent", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """Resend buffered batches from the sequence number a client sent, then vLLM's end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignored a KV-event replay request of %d frames (expected 3)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (for up to a second), then close the sockets."""
        self._running = False
        if self._thread.is_alive():
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass  # the loop sees _running is off once the queue drains
            self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _bind_or_connect(socket: zmq.Socket, endpoint: str, bind: bool = False) -> None:
    """Bind a wildcard, ipc or inproc endpoint (or any, with ``bind``), connect to a named host (vLLM's rule);
    an address in use is a start-up error that names it."""
    host = endpoint.partition("://")[2].rpartition(":")[0]
    try:
        if bind or host in ("*", "[::]", "::", "0.0.0.0") or not endpoint.startswith("tcp://"):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"kv_events_config: cannot use endpoint {endpoint!r}: {e.strerror}") from None


def start_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for, started; None when events are off or go to the null publisher."""
    if config is None or not config.publishes:
        return None
    publisher = ZmqEventPublisher(config)
    publisher.start()
    return publisher
