"""KV-cache events' settings, spelled as vLLM's ``--kv-events-config`` (its ``KVEventsConfig``).

``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}`` makes each engine core
publish the blocks its prefix cache stores and evicts (:mod:`iterserve.engine.kv_events`), which a KV-aware
router (vllm-router's ``kv_aware`` policy) subscribes to. The same dictionary comes from
``LLM(kv_events_config={...})``, from the command line's JSON, and back from a worker's JSON copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from iterserve.config.json_option import json_object

PUBLISHERS = ("null", "zmq")
DEFAULT_ENDPOINT = "tcp://*:5557"  # vLLM's default


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's fields and defaults; checked once, when built."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (as vLLM resolves it)
    endpoint: str = DEFAULT_ENDPOINT  # a "*" or "::" host, ipc:// or inproc:// binds; another host connects
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped and counted
    topic: str = ""
    data_parallel_rank: int = 0  # set per replica by the server: ports are offset by it, as vLLM offsets them

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: unknown publisher {self.publisher!r}; known: "
                             f"{', '.join(map(repr, PUBLISHERS))}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a string, got {getattr(self, name)!r}")
        if self.publishes and not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv_events_config: endpoint must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                             f"got {self.endpoint!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if self.publishes and value and value.startswith("tcp://") and not value.rpartition(":")[2].isdigit():
                raise ValueError(f"kv_events_config: {name} {value!r} has no port (tcp://HOST:PORT)")

    @property
    def publishes(self) -> bool:
        """Whether events leave the engine: enabled, over ZeroMQ (the null publisher drops them)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The config of data-parallel replica ``rank``: its endpoints' ports offset by the rank, as vLLM
        offsets them, so each replica's publisher has a socket of its own."""
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank) or self.endpoint,
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, rank),
                                   data_parallel_rank=rank)

    @classmethod
    def parse(cls, value: KVEventsConfig | Mapping[str, Any] | str | None) -> KVEventsConfig | None:
        """A config from vLLM's dictionary, its JSON text (the command line's), or None for no events."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        given = json_object(value, "kv_events_config", (f.name for f in dataclasses.fields(cls)))
        return None if given is None else cls(**given)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` with its TCP port raised by ``rank`` (inproc names get a ``_dp<rank>`` suffix), as vLLM's
    publisher offsets a data-parallel rank's endpoint."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"kv_events_config: an endpoint of replica {rank} must be tcp:// or inproc://, got {endpoint!r}")
