"""Every setting in one place: the model's architecture (:mod:`.model`), the engine's, the scheduler's and
the server's settings (:mod:`.runtime`), the dtype table (:mod:`.dtypes`) and the size parser (:mod:`.units`).
"""

from iterserve.config.dtypes import RUNNABLE_DTYPES, parse_dtype
from iterserve.config.kv_events import KVEventsConfig
from iterserve.config.model import DEFAULT_MODEL, PRESETS, SUPPORTED_ARCHITECTURES, ModelConfig, find_preset, get_preset
from iterserve.config.runtime import (
    LOG_LEVELS,
    Batching,
    Dtype,
    EngineConfig,
    KVAllocation,
    LogLevel,
    SchedulerConfig,
    ServerConfig,
)
from iterserve.config.speculative import SpeculativeConfig

__all__ = ["DEFAULT_MODEL", "LOG_LEVELS", "PRESETS", "RUNNABLE_DTYPES", "SUPPORTED_ARCHITECTURES", "Batching", "Dtype",
           "EngineConfig", "KVAllocation", "KVEventsConfig", "LogLevel", "ModelConfig", "SchedulerConfig",
           "ServerConfig", "SpeculativeConfig", "find_preset", "get_preset", "parse_dtype"]
