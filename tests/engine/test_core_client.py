"""Where data-parallel replicas run: on CUDA each on its own device, each writing its own step trace."""

from __future__ import annotations

import pytest
import torch

from iterserve.config import EngineConfig
from iterserve.engine.core_process import replica_configs


def test_replicas_get_their_own_trace_and_share_a_cpu_device():
    one = EngineConfig(device="cpu", step_trace="/tmp/steps.jsonl")
    assert replica_configs(one, 1) == [one]
    two = replica_configs(one, 2)
    assert [c.device for c in two] == ["cpu", "cpu"]
    assert [c.step_trace for c in two] == ["/tmp/steps.0.jsonl", "/tmp/steps.1.jsonl"]
    assert two[1].model == one.model and two[1].seed == one.seed  # random weights stay identical


def test_replicas_are_placed_one_per_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [c.device for c in replica_configs(EngineConfig(device="cuda"), 2)] == ["cuda:0", "cuda:1"]
    assert [c.device for c in replica_configs(EngineConfig(), 2)] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="one CUDA device per replica; found 2"):
        replica_configs(EngineConfig(device="cuda"), 3)
    with pytest.raises(ValueError, match="give --device cuda"):
        replica_configs(EngineConfig(device="cuda:1"), 2)


def test_replicas_of_a_tensor_parallel_engine_are_refused_clearly():
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported yet"):
        replica_configs(EngineConfig(device="cpu", tensor_parallel_size=2), 2)
    assert replica_configs(EngineConfig(device="cpu", tensor_parallel_size=2), 1)[0].tensor_parallel_size == 2
