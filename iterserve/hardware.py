"""Accelerators for the capacity planner: a datasheet table and a local microbenchmark.

Every entry of :data:`ACCELERATORS` carries the vendor's *dense* (no structured sparsity)
peak throughput per dtype, the memory bandwidth and the memory size, and names the document
the numbers come from. Conventions:

* FLOP/s are tensor-core (matrix) peaks where the part has tensor cores, except ``fp32``,
  which is the plain CUDA-core/vector FP32 rate that PyTorch gets for float32 matmuls unless
  TF32 is switched on (``tf32`` is listed separately). ``fp8``/``int8`` are listed where the
  part supports them (int8 in OP/s).
* Datasheets quote sparse numbers with an asterisk; those are halved here.
* Bandwidth is decimal (1 GB/s = 1e9 B/s), as datasheets quote it.
* Memory size is the marketed capacity in binary units (an "80GB" A100 shows 81920 MiB in
  ``nvidia-smi``), so ``memory_bytes`` = GB x 2**30.

:func:`measure_local` times the machine it runs on (CPU, or CUDA when available) with short
microbenchmarks and returns an :class:`Accelerator` of the same shape, so the planner can use
datasheet and measured hardware interchangeably.
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

GiB = 2**30
T = 1e12
GBs = 1e9

# dtype names the planner understands, with their storage size in bytes
PLANNER_DTYPES: dict[str, int] = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}

_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tensorfloat32": "tf32",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
}


def canonical_dtype(name: str) -> str:
    """Normalise a dtype spelling ("bfloat16", "BF16", "torch.float16") to a planner key."""
    key = str(name).lower().removeprefix("torch.").replace("-", "_")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in PLANNER_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(PLANNER_DTYPES)}")
    return key


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
    measured: bool = False
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a clear error when the part does not list it."""
        key = canonical_dtype(dtype)
        if key not in self.flops:
            raise ValueError(
                f"{self.name} lists no {key} throughput; choose one of {', '.join(self.flops)}"
            )
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
    ) -> "Accelerator":
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
            measured=self.measured,
            details=dict(self.details),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aliases"] = list(self.aliases)
        d["memory_gib"] = self.memory_bytes / GiB
        return d


def custom_accelerator(
    *, flops: float, bandwidth: float, memory_bytes: int, dtype: str, name: str = "custom"
) -> Accelerator:
    """An accelerator from explicit numbers (FLOP/s for ``dtype``, B/s, bytes)."""
    for label, value in (("FLOP/s", flops), ("bandwidth", bandwidth), ("memory", memory_bytes)):
        if value is None or value <= 0:
            raise ValueError(f"{label} must be a positive number, got {value!r}")
    return Accelerator(
        name=name,
        flops={canonical_dtype(dtype): float(flops)},
        bandwidth=float(bandwidth),
        memory_bytes=int(memory_bytes),
        source="given on the command line",
    )


_NV_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_NV_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_A100_FLOPS = {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T}
_H100_SXM_FLOPS = {
    "fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
    "fp8": 1979 * T, "int8": 1979 * T,
}  # fmt: skip

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        Accelerator(
            name="T4",
            vendor="NVIDIA",
            flops={"fp32": 8.1 * T, "fp16": 65 * T, "int8": 130 * T},
            bandwidth=320 * GBs,
            memory_bytes=16 * GiB,
            source=(
                "NVIDIA T4 Tensor Core GPU datasheet (t4-tensor-core-datasheet-951643.pdf), "
                "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
                "t4-tensor-core-datasheet-951643.pdf"
            ),
            aliases=("Tesla T4",),
            notes="Turing: no bf16 or tf32 tensor cores; fp16 is mixed precision (FP16/FP32). "
            "Bandwidth quoted as 320+ GB/s (256-bit GDDR6 at 10 Gbps).",
        ),
        Accelerator(
            name="A10",
            vendor="NVIDIA",
            flops={"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T,
                   "int8": 250 * T},
            bandwidth=600 * GBs,
            memory_bytes=24 * GiB,
            source=(
                "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
                "Solutions/Data-Center/a10/pdf/datasheet-new/nvidia-a10-datasheet.pdf"
            ),
        ),
        Accelerator(
            name="L4",
            vendor="NVIDIA",
            flops={"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
                   "fp8": 242.5 * T, "int8": 242.5 * T},
            bandwidth=300 * GBs,
            memory_bytes=24 * GiB,
            source=(
                "NVIDIA L4 Tensor Core GPU datasheet, "
                "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
            ),
            notes="Datasheet tensor figures are with sparsity; halved here.",
        ),
        Accelerator(
            name="L40S",
            vendor="NVIDIA",
            flops={"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T,
                   "fp8": 733 * T, "int8": 733 * T},
            bandwidth=864 * GBs,
            memory_bytes=48 * GiB,
            source="NVIDIA L40S GPU datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413",
        ),
        Accelerator(
            name="A100-40GB",
            vendor="NVIDIA",
            flops=_A100_FLOPS,
            bandwidth=1555 * GBs,
            memory_bytes=40 * GiB,
            source=_NV_A100,
            aliases=("A100-SXM4-40GB", "A100-SXM-40GB", "A100 40GB SXM", "A100-40GB-SXM"),
            notes="SXM4, HBM2.",
        ),
        Accelerator(
            name="A100-80GB",
            vendor="NVIDIA",
            flops=_A100_FLOPS,
            bandwidth=2039 * GBs,
            memory_bytes=80 * GiB,
            source=_NV_A100,
            aliases=("A100-SXM4-80GB", "A100-SXM-80GB", "A100 80GB SXM", "A100-80GB-SXM"),
            notes="SXM4, HBM2e.",
        ),
        Accelerator(
            name="A100-80GB-PCIe",
            vendor="NVIDIA",
            flops=_A100_FLOPS,
            bandwidth=1935 * GBs,
            memory_bytes=80 * GiB,
            source=_NV_A100,
            aliases=("A100 80GB PCIe", "A100-PCIe-80GB", "A100-PCIE-80GB"),
            notes="PCIe, HBM2e.",
        ),
        Accelerator(
            name="H100-SXM",
            vendor="NVIDIA",
            flops=_H100_SXM_FLOPS,
            bandwidth=3350 * GBs,
            memory_bytes=80 * GiB,
            source=_NV_H100,
            aliases=("H100 80GB HBM3", "H100-SXM5", "H100-SXM5-80GB", "H100 SXM5 80GB"),
            notes="Datasheet tensor figures are with sparsity; halved here.",
        ),
        Accelerator(
            name="H100-PCIe",
            vendor="NVIDIA",
            flops={"fp32": 51 * T, "tf32": 378 * T, "bf16": 756.5 * T, "fp16": 756.5 * T,
                   "fp8": 1513 * T, "int8": 1513 * T},
            bandwidth=2000 * GBs,
            memory_bytes=80 * GiB,
            source=_NV_H100,
            aliases=("H100 PCIe", "H100-PCIE-80GB"),
            notes="Datasheet tensor figures are with sparsity; halved here.",
        ),
        Accelerator(
            name="H200",
            vendor="NVIDIA",
            flops=dict(_H100_SXM_FLOPS),
            bandwidth=4800 * GBs,
            memory_bytes=141 * GiB,
            source=(
                "NVIDIA H200 Tensor Core GPU datasheet, "
                "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"
            ),
            aliases=("H200-SXM", "H200 SXM", "H200-SXM-141GB"),
            notes="H200 SXM, HBM3e. Datasheet tensor figures are with sparsity; halved here.",
        ),
        Accelerator(
            name="RTX-4090",
            vendor="NVIDIA",
            flops={"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T,
                   "fp8": 330.3 * T, "int8": 660.6 * T},
            bandwidth=1008 * GBs,
            memory_bytes=24 * GiB,
            source=(
                "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090), "
                "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
            ),
            aliases=("GeForce RTX 4090", "RTX4090", "4090"),
            notes="fp16/bf16/fp8 with FP32 accumulate (what PyTorch matmuls use); "
            "fp16 with FP16 accumulate is 330.3 TFLOPS.",
        ),
        Accelerator(
            name="MI300X",
            vendor="AMD",
            flops={"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
                   "fp8": 2614.9 * T, "int8": 2614.9 * T},
            bandwidth=5300 * GBs,
            memory_bytes=192 * GiB,
            source=(
                "AMD Instinct MI300X Accelerator data sheet, https://www.amd.com/content/dam/amd/"
                "en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"
            ),
            aliases=("Instinct MI300X", "AMD Instinct MI300X"),
            notes="fp32 is the matrix rate; dense (non-sparse) figures.",
        ),
    ]
}


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


def accelerator_names() -> list[str]:
    return list(ACCELERATORS)


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


# -- microbenchmarks ------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _time_op(fn: Callable[[], Any], device: str, budget_s: float, min_iters: int = 3) -> float:
    """Best (minimum) seconds per call of ``fn`` within a time budget, after one warm-up."""
    fn()
    _sync(device)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    iters = 0
    while iters < min_iters or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        iters += 1
        if iters >= 1000:
            break
    return best


def _cpu_llc_bytes() -> int:
    try:
        sizes = []
        base = "/sys/devices/system/cpu/cpu0/cache"
        for entry in os.listdir(base):
            if entry.startswith("index"):
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip().upper()
                mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * mult)
        return max(sizes) if sizes else 32 * 2**20
    except OSError:
        return 32 * 2**20


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _physical_memory_bytes()


def measure_bandwidth(device: str = "cpu", budget_s: float = 0.6) -> dict[str, float]:
    """Achievable memory bandwidth in B/s from a large copy and a large sum (read-only).

    The buffer is sized well past the last-level cache (8x LLC on CPU, 1 GiB on CUDA) so the
    numbers reflect DRAM/HBM, not cache. Returns ``{"copy": ..., "read": ..., "buffer_bytes": ...}``
    (copy counts the bytes read plus the bytes written).
    """
    import torch

    if device.startswith("cuda"):
        nbytes = 1 * GiB
    else:
        nbytes = max(256 * 2**20, 8 * _cpu_llc_bytes())
        nbytes = min(nbytes, max(64 * 2**20, available_memory_bytes() // 8))
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t_copy = _time_op(lambda: dst.copy_(src), device, budget_s / 2)
    t_read = _time_op(lambda: src.sum(), device, budget_s / 2)
    del src, dst
    return {"copy": 2 * n * 4 / t_copy, "read": n * 4 / t_read, "buffer_bytes": float(n * 4)}


def _dtype_supported(torch_dtype: Any, device: str) -> bool:
    import torch

    try:
        a = torch.ones(8, 8, dtype=torch_dtype, device=device)
        (a @ a).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


def measure_matmul_flops(
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    device: str = "cpu",
    budget_s: float = 0.4,
    rounds: int = 2,
) -> dict[str, float]:
    """Achievable square-matmul FLOP/s per dtype (skipping dtypes the device cannot multiply).

    Each dtype takes about ``budget_s`` in all: on CPU the size (256 to 2048) comes from a
    quick probe, so a dtype without a fast kernel does not stall the run; CUDA uses 8192. The
    dtypes are timed in ``rounds`` interleaved rounds and the best round is kept, so a burst of
    load from other processes does not sink one dtype. ``tf32`` is measured on CUDA only.
    """
    import torch

    torch_dtypes = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                    "fp16": torch.float16}  # fmt: skip
    cuda = device.startswith("cuda")
    operands: dict[str, tuple[Any, Any, int]] = {}
    for name in dtypes:
        if name not in torch_dtypes or (name == "tf32" and not cuda):
            continue
        td = torch_dtypes[name]
        if not _dtype_supported(td, device):
            continue
        if cuda:
            n = 8192
        else:
            # probe at a small size, then pick n so one multiply takes ~budget/8
            p = 256
            a = torch.randn(p, p).to(td)
            rate = 2 * p**3 / _time_op(lambda: a @ a, device, 0.0, min_iters=2)
            n = int((rate * budget_s / 8 / 2) ** (1 / 3)) // 64 * 64
            n = min(max(n, 256), 2048)
        a = torch.randn(n, n, device=device).to(td)
        b = torch.randn(n, n, device=device).to(td)
        operands[name] = (a, b, n)
    out: dict[str, float] = {}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for _ in range(max(1, rounds)):
            for name, (a, b, n) in operands.items():
                if cuda:
                    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
                t = _time_op(lambda: a @ b, device, budget_s / max(1, rounds))
                out[name] = max(out.get(name, 0.0), 2 * n**3 / t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out


def measure_local(device: str | None = None, budget_s: float = 2.0) -> Accelerator:
    """Measure this machine (``"cpu"``, ``"cuda"``; default: CUDA when available, else CPU).

    Runs a bandwidth benchmark and a matmul benchmark per dtype, a few seconds in all, and
    returns an :class:`Accelerator` whose ``bandwidth`` is the better of copy and read
    bandwidth and whose ``memory_bytes`` is the device memory (physical RAM on CPU).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    bw = measure_bandwidth(device, budget_s=budget_s * 0.3)
    dtypes = ("fp32", "tf32", "bf16", "fp16") if device.startswith("cuda") else ("fp32", "bf16", "fp16")
    flops = measure_matmul_flops(dtypes, device=device, budget_s=budget_s * 0.7 / len(dtypes))
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        memory = int(props.total_memory)
        label = props.name
    else:
        memory = _physical_memory_bytes()
        label = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        label = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    threads = torch.get_num_threads()
    details: dict[str, Any] = {"copy_bandwidth": bw["copy"], "read_bandwidth": bw["read"],
                               "buffer_bytes": bw["buffer_bytes"], "device": device,
                               "device_name": label, "torch": torch.__version__}  # fmt: skip
    if not device.startswith("cuda"):
        details["threads"] = threads
    datasheet = match_device_name(label) if device.startswith("cuda") else None
    if datasheet is not None:
        details["datasheet_entry"] = datasheet.name
    return Accelerator(
        name=f"local {device} (measured)",
        flops=flops,
        bandwidth=max(bw["copy"], bw["read"]),
        memory_bytes=memory,
        source=f"measured on {label} with torch {torch.__version__}"
        + ("" if device.startswith("cuda") else f", {threads} threads"),
        measured=True,
        details=details,
    )
