"""What this CPU computes natively, read from the operating system's CPU flags."""

from __future__ import annotations

# CPU flags (Linux /proc/cpuinfo) of bf16 matrix instructions. Without them torch emulates bf16: on a
# 2-core AVX2 EPYC a 64 x 576 by 576 x 1536 F.linear ran at 14.8 GFLOP/s in bf16 against 104 in
# float32, while AVX-512 bf16 machines run bf16 about twice as fast as float32.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 AVX-512 BF16 / AMX, or Arm's BF16)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    return any(word in _BF16_CPU_FLAGS for line in cpuinfo.splitlines()
               if line.lower().startswith(("flags", "features")) for word in line.split())
