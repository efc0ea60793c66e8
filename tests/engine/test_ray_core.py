"""``--data-parallel-backend ray``: the setting's checks, and (marked ``ray``: ``bash scripts/test_ray.sh``) two
engine cores placed as Ray actors on the two nodes of a local cluster, one of them killed and replaced."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.engine.async_llm import AsyncLLM
from iterserve.engine.core_client import EngineCoreClient
from iterserve.sampling_params import SamplingParams

TINY = EngineConfig(model="random:smollm2-135m?num_layers=2", dtype="float32", num_kv_blocks=64, max_model_len=128)


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="data_parallel_backend must be 'mp' or 'ray', got 'k8s'"):
        ServerConfig(data_parallel_backend="k8s")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_parallel_backend must be 'mp' or 'ray'"):
        EngineCoreClient(TINY, max_waiting=8, data_parallel_backend="k8s")  # type: ignore[arg-type]


def test_the_ray_backend_without_ray_installed_says_how_to_get_it():
    if importlib.util.find_spec("ray") is not None:
        pytest.skip("ray is installed here")
    with pytest.raises(ValueError, match="needs Ray, which is not installed: pip install ray"):
        EngineCoreClient(TINY, max_waiting=8, data_parallel_size=2, data_parallel_backend="ray")


async def _complete(llm: AsyncLLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    final = None
    async for out in llm.generate({"prompt_token_ids": prompt}, params):
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


async def _two_nodes_and_a_restart() -> tuple[set[str], list[list[int]], list[list[int]], str, str]:
    import ray

    llm = AsyncLLM(TINY, data_parallel_size=2, data_parallel_backend="ray", max_restarts=2)
    async with llm:
        cores = llm.engine_core._cores
        nodes = {await asyncio.to_thread(core.proc.node_id) for core in cores}  # type: ignore[union-attr]
        before = await asyncio.gather(*(_complete(llm, [i + 1, i + 2, i + 3]) for i in range(4)))
        killed = cores[1].proc
        ray.kill(killed.actor)  # type: ignore[union-attr]
        deadline = time.monotonic() + 240  # a new actor, once the killed one's CPU is free, loads the model
        while llm.engine_core.num_restarts == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert cores[1].proc is not killed and llm.engine_core.health_problem() is None
        after = await asyncio.gather(*(_complete(llm, [i + 1, i + 2, i + 3]) for i in range(4)))
        stats = cores[1].stats
        assert stats is not None and stats.num_requests_received > 0  # the new core took requests
        restarted_node = await asyncio.to_thread(cores[1].proc.node_id)  # type: ignore[union-attr]
        return nodes, before, after, restarted_node, str(llm.engine_core.num_restarts)


@pytest.mark.ray
def test_replicas_run_as_actors_on_two_nodes_and_a_killed_one_is_replaced():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)  # one CPU a node: each core's actor lands on its own node
    ray.init(address=cluster.address)
    try:
        nodes, before, after, restarted_node, restarts = asyncio.run(_two_nodes_and_a_restart())
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert len(nodes) == 2  # one core on each node
    assert before == after and all(len(tokens) == 4 for tokens in before)  # greedy: the same on any replica
    assert restarted_node in nodes and restarts == "1"
