"""What this CPU is and computes natively, read from the operating system's CPU flags."""

from __future__ import annotations

import platform

# CPU flags (Linux /proc/cpuinfo) of bf16 matrix instructions. Without them torch emulates bf16 matmuls, several
# times slower than float32 (docs/benchmarks.md); the C++ kernels widen bf16 weights to float32 instead.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


# the flags that decide how fast the engine's matmuls run, in the order a figure's caption names them
_SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def _cpuinfo(cpuinfo: str | None) -> str:
    if cpuinfo is not None:
        return cpuinfo
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's flags (x86 ``flags``, Arm ``Features``) of its first core; empty where unknown."""
    for line in _cpuinfo(cpuinfo).splitlines():
        if line.lower().startswith(("flags", "features")):
            return set(line.split(":", 1)[-1].split())
    return set()


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 matrix instructions (x86 AVX-512 BF16 / AMX, or Arm's BF16)."""
    return bool(cpu_flags(cpuinfo) & _BF16_CPU_FLAGS)


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else what Python knows."""
    for line in _cpuinfo(cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_description(cpuinfo: str | None = None) -> str:
    """Model name and the flags that set its matmul speed: what a timing figure must name."""
    flags = cpu_flags(cpuinfo)
    speed = [f for f in _SPEED_FLAGS if f in flags]
    return cpu_model_name(cpuinfo) + (f" ({' '.join(speed)})" if speed else "")
