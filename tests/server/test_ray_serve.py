"""The Ray Serve deployment: its arguments, and (marked ``ray``: ``bash scripts/test_ray.sh``) two replicas on a
two-node local Ray cluster, one of them killed while the other streams."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from iterserve.server.ray_serve import REPLICA_HEADER, build, split_args

TINY = {"model": "random:smollm2-135m?num_layers=2", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}


def test_serve_run_arguments_split_into_engine_server_and_deployment_options():
    engine, server, deployment = split_args({"model": "smollm2-135m", "max-num-seqs": "64", "enable_prefix_caching":
                                             "false", "port": "9000", "num_replicas": "2", "num_cpus": "1.5"})
    assert engine == {"model": "smollm2-135m", "max_num_seqs": 64, "enable_prefix_caching": False}
    assert server == {"port": 9000} and deployment == {"num_replicas": 2, "num_cpus": 1.5}
    with pytest.raises(ValueError, match="unknown argument 'max_seqs'"):
        split_args({"max_seqs": "4"})


def test_bad_settings_fail_before_any_actor_starts():
    with pytest.raises(ValueError, match="max_num_seqs"):
        build({**TINY, "max_num_seqs": 0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replicas() -> dict[int, str]:
    """pid -> actor name of each live replica actor."""
    from ray.util.state import list_actors

    return {a.pid: a.name for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True)
            if "ServeReplica" in a.class_name}


@pytest.mark.ray
def test_two_replicas_on_two_nodes_survive_a_killed_replica():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)  # one CPU a node: each replica lands on its own node
    ray.init(address=cluster.address)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({**TINY, "served_model_name": "tiny", "num_replicas": 2, "num_cpus": 1}),
                  name="iterserve", route_prefix="/")
        before = _replicas()
        assert len(before) == 2
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                streaming = int(r.headers[REPLICA_HEADER])
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                other = next(pid for pid in before if pid != streaming)
                ray.kill(ray.get_actor(before[other], namespace="serve"), no_restart=False)
                rest = [line for line in lines if line.startswith("data: ")]
            assert "error" not in first and rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
            deadline = time.monotonic() + 240
            while (len(now := _replicas()) < 2 or other in now) and time.monotonic() < deadline:
                time.sleep(1)
            assert len(now) == 2 and other not in now and streaming in now  # a new replica replaced the killed one
            for _ in range(4):
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": [4, 5], "max_tokens": 4})
                assert r.status_code == 200, r.text
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
