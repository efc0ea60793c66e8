"""The one parser of memory sizes, for every option that takes one (``--kv-cache-memory``, ``plan --memory``).

Units, case-insensitive: ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/``GiB``/``TiB`` are binary
(powers of 1024: ``2G`` is ``2GiB``); ``KB``/``MB``/``GB``/``TB`` are decimal (powers of 1000), as
datasheets quote them; ``B`` is bytes. A bare number is GiB, so ``--kv-cache-memory 80`` and
``plan --memory 80`` both mean 80 GiB. A Python int (the engine's ``kv_cache_memory=`` argument) is bytes.
"""

from __future__ import annotations

import re

GiB = 2**30

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
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
        m = _SIZE.fullmatch(str(value))
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
