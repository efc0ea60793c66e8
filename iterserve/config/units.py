"""The one parser of quantities with units: memory sizes, for every option that takes one
(``--kv-cache-memory``, ``plan --memory``), bandwidths and FLOP rates (``plan --bandwidth``, ``--flops``).

Units, case-insensitive: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/``GiB``/``TiB`` are binary
(powers of 1024: ``2G`` is ``2GiB``); ``KB``/``MB``/``GB``/``TB`` are decimal (powers of 1000), as
datasheets quote them; ``B`` is bytes. A bare number is GiB, so ``--kv-cache-memory 80`` and
``plan --memory 80`` both mean 80 GiB. A Python int (the engine's ``kv_cache_memory=`` argument) is bytes.
A bandwidth without a unit is GB/s, a FLOP rate TFLOP/s.
"""

from __future__ import annotations

import re

GiB = 2**30

# a number and its unit ("85.9GB", "3.35TB/s", "312 TFLOPS")
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*", re.IGNORECASE)
_UNITS = {
    "": GiB,
    "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}


def parse_size(value: str | int, what: str = "memory size") -> int:
    """``"2GiB"``, ``"2G"``, ``"512MiB"``, ``"85.9GB"``, ``"80"`` (GiB) or an int of bytes -> bytes (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size such as '2GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = _QUANTITY.fullmatch(str(value))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ValueError(
                f"cannot read {what} {value!r}; give a number of GiB or one with a unit: "
                "B, K/KiB, M/MiB, G/GiB, T/TiB (binary), KB, MB, GB, TB (decimal)"
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return size


_BW_UNITS = {"": 1e9, "gb/s": 1e9, "gbps": 1e9, "gbs": 1e9, "tb/s": 1e12, "tbps": 1e12, "tbs": 1e12,
             "mb/s": 1e6, "b/s": 1}
_FLOPS_UNITS = {"": 1e12, "tflops": 1e12, "tflop/s": 1e12, "t": 1e12, "gflops": 1e9, "gflop/s": 1e9,
                "g": 1e9, "pflops": 1e15, "pflop/s": 1e15, "p": 1e15, "flops": 1, "flop/s": 1}


def _parse_rate(text: str, units: dict[str, float], what: str, default_unit: str) -> float:
    m = _QUANTITY.fullmatch(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in units:
        raise ValueError(
            f"cannot read {what} {text!r}; give a number in {default_unit} or with a unit "
            f"({', '.join(u for u in units if u)})"
        )
    value = float(m.group(1)) * units[unit]
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def parse_bandwidth(text: str) -> float:
    """``"2039"`` (GB/s), ``"3.35TB/s"`` -> bytes per second."""
    return _parse_rate(text, _BW_UNITS, "bandwidth", "GB/s")


def parse_flops(text: str) -> float:
    """``"312"`` (TFLOP/s), ``"312T"``, ``"800GFLOPS"`` -> FLOP/s."""
    return _parse_rate(text, _FLOPS_UNITS, "FLOP/s", "TFLOP/s")
