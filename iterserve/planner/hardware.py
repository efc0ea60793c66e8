"""Accelerators for the capacity planner: peak FLOP/s per dtype, memory bandwidth and memory size.

The datasheet table is package data, ``data/accelerators.json``: each entry names the document its
numbers come from, and the file's ``about`` states the conventions (dense peaks, decimal GB/s,
binary memory sizes). :func:`iterserve.bench.microbench.measure_local` measures the machine it runs on
and returns an :class:`Accelerator` of the same shape, so plans take datasheet and measured hardware
alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from iterserve.config.dtypes import canonical_dtype

GiB = 2**30
TFLOPS = 1e12
GB_S = 1e9


@dataclass(frozen=True)
class Accelerator:
    """Peak numbers of one device: FLOP/s per dtype, memory bandwidth (B/s), memory (bytes)."""

    name: str
    flops: dict[str, float]
    bandwidth: float
    memory_bytes: int
    source: str
    vendor: str = ""
    aliases: tuple[str, ...] = ()
    notes: str = ""
    interconnect: str = ""  # the link a tensor-parallel group of this part uses by default
    measured: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a clear error when the part does not list it."""
        key = canonical_dtype(dtype)
        if key not in self.flops:
            raise ValueError(f"{self.name} lists no {key} throughput; choose one of {', '.join(self.flops)}")
        return self.flops[key]

    def ops_per_byte(self, dtype: str) -> float:
        """The ridge point of the roofline: FLOPs the part can do per byte it can move."""
        return self.peak_flops(dtype) / self.bandwidth

    def with_overrides(
        self,
        *,
        flops: float | None = None,
        dtype: str | None = None,
        bandwidth: float | None = None,
        memory_bytes: int | None = None,
    ) -> Accelerator:
        """A copy with some numbers replaced (``flops`` applies to ``dtype``)."""
        if flops is None and bandwidth is None and memory_bytes is None:
            return self
        new_flops = dict(self.flops)
        changed = []
        if flops is not None:
            if dtype is None:
                raise ValueError("an explicit FLOP/s figure needs the dtype it applies to")
            new_flops[canonical_dtype(dtype)] = float(flops)
            changed.append("flops")
        if bandwidth is not None:
            changed.append("bandwidth")
        if memory_bytes is not None:
            changed.append("memory")
        return Accelerator(
            name=f"{self.name} (custom {', '.join(changed)})",
            flops=new_flops,
            bandwidth=float(bandwidth) if bandwidth is not None else self.bandwidth,
            memory_bytes=int(memory_bytes) if memory_bytes is not None else self.memory_bytes,
            source=f"{self.source}; {', '.join(changed)} given on the command line",
            vendor=self.vendor,
            notes=self.notes,
            interconnect=self.interconnect,
            measured=self.measured,
            details=dict(self.details),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["memory_gib"] = self.memory_bytes / GiB
        return d


def custom_accelerator(
    *, flops: float | None, bandwidth: float | None, memory_bytes: int | None, dtype: str, name: str = "custom"
) -> Accelerator:
    """An accelerator from explicit numbers (FLOP/s for ``dtype``, B/s, bytes)."""
    for label, value in (("FLOP/s", flops), ("bandwidth", bandwidth), ("memory", memory_bytes)):
        if value is None or value <= 0:
            raise ValueError(f"{label} must be a positive number, got {value!r}")
    assert flops is not None and bandwidth is not None and memory_bytes is not None  # checked above
    return Accelerator(
        name=name,
        flops={canonical_dtype(dtype): float(flops)},
        bandwidth=float(bandwidth),
        memory_bytes=int(memory_bytes),
        source="given on the command line",
    )


def _load_table() -> dict[str, Accelerator]:
    data = _table_data()
    table = {}
    for e in data["accelerators"]:
        table[e["name"]] = Accelerator(
            name=e["name"],
            vendor=e.get("vendor", ""),
            flops={canonical_dtype(k): v * TFLOPS for k, v in e["tflops"].items()},
            bandwidth=e["bandwidth_gb_s"] * GB_S,
            memory_bytes=int(e["memory_gib"] * GiB),
            source=e["source"],
            aliases=tuple(e.get("aliases", ())),
            notes=e.get("notes", ""),
            interconnect=e.get("interconnect", ""),
        )
    return table


def _table_data() -> dict[str, Any]:
    return json.loads(resources.files("iterserve.planner").joinpath("data/accelerators.json").read_text("utf-8"))


@dataclass(frozen=True)
class Interconnect:
    """The link between the devices of a tensor-parallel group, as a ring collective sees it."""

    name: str
    bandwidth: float  # B/s one device sends per direction
    base_latency_s: float  # once per collective
    hop_latency_s: float  # per ring step
    source: str
    aliases: tuple[str, ...] = ()

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks`` devices: 2(n-1) steps, each sending nbytes/n."""
        if ranks == 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.base_latency_s + steps * (self.hop_latency_s + nbytes / ranks / self.bandwidth)

    def gather_s(self, nbytes: float, ranks: int) -> float:
        """Gathering ``nbytes`` (all shards together) on one device: n-1 shards arrive over its link."""
        if ranks == 1:
            return 0.0
        return self.base_latency_s + (ranks - 1) * (self.hop_latency_s + nbytes / ranks / self.bandwidth)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        return d


def _load_links() -> dict[str, Interconnect]:
    return {
        e["name"]: Interconnect(name=e["name"], bandwidth=e["bandwidth_gb_s"] * GB_S,
                                base_latency_s=e["base_latency_us"] * 1e-6, hop_latency_s=e["hop_latency_us"] * 1e-6,
                                source=e["source"], aliases=tuple(e.get("aliases", ())))
        for e in _table_data()["interconnects"]
    }


ACCELERATORS: dict[str, Accelerator] = _load_table()
INTERCONNECTS: dict[str, Interconnect] = _load_links()


def get_interconnect(name: str) -> Interconnect:
    """An interconnect by name or alias (case, spaces and dashes do not matter)."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for link in INTERCONNECTS.values():
        if key in {re.sub(r"[^a-z0-9]", "", n.lower()) for n in (link.name, *link.aliases)}:
            return link
    raise ValueError(f"unknown interconnect {name!r}; known: {', '.join(INTERCONNECTS)}")


def _norm(name: str) -> str:
    key = name.lower()
    for word in ("nvidia", "tesla", "geforce", "amd", "instinct"):
        key = key.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", key)


def _index() -> dict[str, str]:
    idx: dict[str, str] = {}
    for acc in ACCELERATORS.values():
        for spelling in (acc.name, *acc.aliases):
            idx[_norm(spelling)] = acc.name
    return idx


def get_accelerator(name: str) -> Accelerator:
    """Look up a table entry; case, spaces, dashes and vendor prefixes do not matter."""
    key = _norm(name)
    idx = _index()
    if key in idx:
        return ACCELERATORS[idx[key]]
    # a partial name ("A100", "H100") is never guessed: L40 is not an L40S
    candidates = sorted({full for spelling, full in idx.items() if key and spelling.startswith(key)})
    if candidates:
        raise ValueError(f"GPU name {name!r} is ambiguous; did you mean {', '.join(candidates)}?")
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(ACCELERATORS)}")


def match_device_name(device_name: str) -> Accelerator | None:
    """The table entry for a device name as the driver reports it, if there is one."""
    try:
        return get_accelerator(device_name)
    except ValueError:
        return None
