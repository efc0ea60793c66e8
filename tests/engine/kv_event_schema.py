"""A copy of vLLM's KV-event schema (vllm/distributed/kv_events.py since vllm-project/vllm#42892: the batch an
array, each event a map tagged with ``"type"``), so that the tests read iterserve's frames as a vLLM consumer
would, independently of iterserve's own classes."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
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


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def subscriber(ctx: zmq.Context, topic: bytes = b"") -> tuple[zmq.Socket, str]:
    """A SUB socket bound on a free loopback port, and the endpoint a publisher connects to."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    return sub, f"tcp://127.0.0.1:{port}"


def receive(sub: zmq.Socket, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch] | None:
    """The next [topic, seq, payload] message, decoded; None when none comes within ``timeout_ms``."""
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), DECODER.decode(payload)


def wait_subscribed(publisher: Any, sub: zmq.Socket, timeout_s: float = 10.0) -> None:
    """Publish empty batches until ``sub`` gets one (a connecting PUB drops what it sends before the
    subscription reaches it), then drain them."""
    deadline = time.monotonic() + timeout_s
    while receive(sub, 100) is None:
        assert time.monotonic() < deadline, "the subscriber never got a batch"
        publisher.publish([])
    while receive(sub, 300) is not None:
        pass


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
