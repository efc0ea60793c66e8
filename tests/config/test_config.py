"""dtype names, and ``auto`` choosing bf16 only where it runs at full speed."""

from __future__ import annotations

import pytest
import torch

from iterserve import config
from iterserve.config import dtypes, parse_dtype
from iterserve.platforms import ops as platform_ops
from iterserve.platforms.cpu import cpu_description, cpu_has_native_bf16

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


def test_bf16_instructions_are_read_from_cpu_flags():
    assert not cpu_has_native_bf16(AVX2_EPYC)
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS)
    assert cpu_has_native_bf16(GRAVITON3)
    assert not cpu_has_native_bf16("model name\t: bf16 in a name is not a flag\n")


def test_a_figure_names_the_cpu_and_the_flags_that_set_its_speed():
    assert cpu_description("model name\t: AMD EPYC 7763\n" + AVX2_EPYC) == "AMD EPYC 7763 (avx2)"
    assert cpu_description("model name\t: Xeon\n" + SAPPHIRE_RAPIDS) == "Xeon (avx2 avx512f avx512_bf16 amx_bf16)"
    assert cpu_description(GRAVITON3).endswith("(asimd sve bf16)")


@pytest.mark.parametrize("native,kernels,expected", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                     (False, False, torch.float32)])
def test_auto_is_bf16_where_bf16_instructions_or_the_kernels_run_it(monkeypatch, native, kernels, expected):
    """The C++ kernels widen bf16 weights to float32 as they load them; only the reference path would emulate it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(platform_ops, "cpu_kernels", lambda: object() if kernels else None)
    assert parse_dtype("auto") == expected
    assert parse_dtype("AUTO") == expected
    # what the dashboard and the start-up log show: the dtype in use, never "auto"
    assert config.EngineConfig(dtype="auto").resolved_dtype == str(expected).removeprefix("torch.")
    assert config.EngineConfig(dtype="fp16").resolved_dtype == "float16"


def test_named_dtypes_and_errors():
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("float32") == torch.float32
    assert parse_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="choose one of auto"):
        parse_dtype("int4")


# -- engine, scheduler and server settings ------------------------------------------------------------


def test_settings_are_frozen_and_validated_when_built():
    from dataclasses import FrozenInstanceError

    from iterserve.config import EngineConfig, SchedulerConfig, ServerConfig

    c = EngineConfig(dtype="fp32", max_num_seqs=4)
    with pytest.raises(FrozenInstanceError):
        c.max_num_seqs = 8  # type: ignore[misc]
    assert c.dtype == "float32" and EngineConfig(dtype="half").dtype == "float16"  # aliases kept under one name
    assert c.scheduler_config(128) == SchedulerConfig(max_num_seqs=4, max_model_len=128)
    bad = [
        (EngineConfig, {"batching": "adaptive"}, "batching must be one of 'continuous', 'static', 'dynamic'"),
        (EngineConfig, {"max_batch_wait": "soon"}, "max_batch_wait must be a number of seconds"),
        (EngineConfig, {"kv_allocation": "lazy"}, "kv_allocation must be one of 'paged', 'reserved'"),
        (EngineConfig, {"dtype": "int8"}, "unknown dtype 'int8'"),
        (EngineConfig, {"block_size": 0}, "block_size must be an integer >= 1"),
        (EngineConfig, {"max_num_batched_tokens": -1}, "max_num_batched_tokens must be an integer >= 1"),
        (EngineConfig, {"num_kv_blocks": 0}, "num_kv_blocks must be an integer >= 1"),
        (EngineConfig, {"max_model_len": 1.5}, "max_model_len must be an integer >= 1"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
        (ServerConfig, {"port": 70000}, "port must be in"),
        (ServerConfig, {"max_waiting": 0}, "max_waiting must be an integer >= 1"),
        (ServerConfig, {"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
        (ServerConfig, {"log_level": "LOUD"}, "log_level must be one of"),
        (ServerConfig, {"shutdown_timeout": -1.0}, "shutdown_timeout must be >= 0"),
    ]
    for cls, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)
    assert ServerConfig(log_level="debug").log_level == "DEBUG"
    assert ServerConfig().model_name(c) == c.model and ServerConfig(served_model_name="x").model_name(c) == "x"


def test_config_imports_nothing_that_imports_it_and_the_server_nothing_from_the_cli():
    """config/ sits under models/ and the engine (no circle through them): nothing it imports from the rest of
    the package imports config in turn, however indirectly. The server takes its settings as objects, not from
    the CLI."""
    import ast
    from pathlib import Path

    root = Path(config.__file__).parent.parent

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return found | {f"{n.module}.{a.name}" for n in ast.walk(tree)  # from iterserve import kernels: a module
                        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("iterserve")
                        for a in n.names}

    def source(module: str) -> Path:
        path = root.joinpath(*module.split(".")[1:])
        return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    for path in (root / "config").glob("*.py"):
        todo = [m for m in imports(path) if m.startswith("iterserve.") and not m.startswith("iterserve.config")]
        seen: set[str] = set()
        while todo:
            module = todo.pop()
            if module in seen or not source(module).exists():
                continue
            seen.add(module)
            assert not module.startswith("iterserve.config"), f"{path} imports a module that imports config"
            todo += [m for m in imports(source(module)) if m.startswith("iterserve.")]
        assert path.name != "dtypes.py" or {"iterserve.platforms.cpu", "iterserve.kernels"} <= seen  # it walks
    assert not {m for m in imports(root / "server" / "api_server.py") if m.startswith("iterserve.cli")}
    assert "argparse" not in imports(root / "server" / "api_server.py")
