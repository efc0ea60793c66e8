"""The optional C++ CPU kernels (``csrc/*.cpp``, one extension): build once at set-up, load at import.

``scripts/setup.sh`` runs ``iterserve build-kernels``, which compiles the extension with
``torch.utils.cpp_extension`` into ``iterserve/_build/`` (git-ignored). Importing this module only
loads that build, never compiles: the build's name carries a hash of the source, the compiler flags
and the torch version, so an edited source or another torch finds no build and falls back instead
of loading a stale one. Without a build, or with ``ITERSERVE_CPU_KERNELS=0``, ``ops`` is None and the
CPU runs the PyTorch reference. Only :mod:`iterserve.platforms.ops` reads ``ops``: it makes the one choice of op
set, which every other module looks its kernels up on.

The extension registers every op in one library, ``torch.ops.iterserve`` (``TORCH_LIBRARY``; the decode
stack as the class ``torch.classes.iterserve.DecoderStack``); ``ops`` holds them as attributes, so a call
site reads ``ops.rms_norm(x, w, eps)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "ITERSERVE_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
BUILD_DIR = Path(__file__).with_name("_build")
_PREFIX = "iterserve_cpu_ops_"


def _cflags() -> list[str]:
    """-O3 for this machine, and ATen's Vectorized compiled for the capability torch detected at run time
    (without the CPU_CAPABILITY defines the header falls back to its scalar loops)."""
    flags = ["-O3", "-march=native", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


def module_name() -> str:
    """Name of the build that matches this source, these flags and this torch."""
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    key = b"".join(f.read_bytes() for f in files) + " ".join(_cflags()).encode() + torch.__version__.encode()
    return _PREFIX + hashlib.sha256(key).hexdigest()[:12]


class KernelOps(ModuleType):
    """The loaded extension's ops: attribute ``name`` is ``torch.ops.iterserve.name``'s one overload (called
    without the packet's overload lookup), ``DecoderStack`` the class; each looked up once, then kept."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any
        if name == "DecoderStack":
            value = torch.classes.iterserve.DecoderStack
        else:
            try:
                value = getattr(torch.ops.iterserve, name).default
            except (AttributeError, RuntimeError) as exc:
                raise AttributeError(f"the CPU kernels have no op {name!r}") from exc
        setattr(self, name, value)
        return value


def build(verbose: bool = False) -> KernelOps:
    """Compile the extension into ``BUILD_DIR`` (takes a minute), load it and drop builds of older sources."""
    from torch.utils import cpp_extension

    name = module_name()
    directory = BUILD_DIR / name
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name, sources=[str(s) for s in SOURCES], extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
        build_directory=str(directory), verbose=verbose, is_python_module=False,
    )
    for old in BUILD_DIR.glob(_PREFIX + "*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    ops = load_build()
    if ops is None:
        raise RuntimeError(f"the build in {directory} does not load")
    return ops


def load_build() -> KernelOps | None:
    """The built extension for this source, or None (with one log line saying the reference path runs)."""
    name = module_name()
    path = BUILD_DIR / name / f"{name}.so"
    if not path.exists():
        logger.warning("iterserve CPU kernels are not built for this source (run scripts/setup.sh); "
                       "the PyTorch reference path runs")
        return None
    try:
        torch.ops.load_library(str(path))  # loading the same file again is a no-op
    except (OSError, RuntimeError) as exc:
        logger.warning("iterserve CPU kernels failed to load (%s); the PyTorch reference path runs", exc)
        return None
    ops = KernelOps(f"{__name__}.ops")
    ops.__file__ = str(path)
    return ops


def _load() -> KernelOps | None:
    if os.environ.get(ENV_VAR, "1") == "0":
        logger.info("%s=0: CPU kernels disabled, the PyTorch reference path runs", ENV_VAR)
        return None
    return load_build()


ops: KernelOps | None = _load()


_pool_threads: int | None = None


def run_on_pool(threads: int | None = None) -> int:
    """Give this process's intra-op threads to the kernels' own pool and leave torch one thread; returns the
    pool's thread count (``threads``, by default the torch thread count before the first call).

    torch's OpenMP team ends every parallel region at a barrier that waits for each of its threads. With
    another process on one of the cores, the thread the scheduler took off arrives a time slice later, at
    every one of the few hundred regions of a decode step. The pool's threads claim chunks of a loop as
    they run, so the caller never waits for one that has not started (``csrc/parallel.h``). torch's own ops
    in a step (the glue, prefill attention) then run on the calling thread, where no barrier can hold them.
    Without the kernels torch keeps the threads.
    """
    global _pool_threads
    n = threads or _pool_threads or torch.get_num_threads()
    if ops is None:
        torch.set_num_threads(n)
        return n
    ops.set_threads(n)
    torch.set_num_threads(1)
    _pool_threads = n
    return n


def pool_solos_line() -> str:
    """The benchmark scripts' last line: how often the pool's caller, stalled by a descheduled worker, went on
    alone for a while (``csrc/parallel.h``); empty without the kernels."""
    if ops is None:
        return ""
    return (f"kernels' pool: its caller went on alone {ops.pool_solos()} times (stalled by a descheduled worker, "
            "csrc/parallel.h)")
