"""The OpenAI server as a Ray Serve deployment: each replica a Ray actor holding the app and its engine core.

    serve run iterserve.server.ray_serve:build model=smollm2-135m num_replicas=2 num_cpus=1 max_num_seqs=64

Arguments are ``EngineConfig`` and ``ServerConfig`` fields (values read as JSON where they parse, else as
text), plus ``num_replicas`` and ``num_cpus``: the CPUs each replica's actor reserves, which its engine core
process (a child of the actor) computes on. Serve's proxy routes HTTP to the replicas; each builds the app
(:func:`~iterserve.server.api_server.build_app`) inside its actor, so nothing of the engine is pickled.
Serve restarts a replica whose actor dies, or whose health check fails because its engine core died.
Ray is not a dependency of iterserve: install ``ray[serve]`` to use this module.
"""

from __future__ import annotations

import json
import os
from typing import Any

from iterserve.config import EngineConfig, ServerConfig
from iterserve.errors import EngineDeadError

REPLICA_HEADER = "x-iterserve-replica"  # each response names the actor process (its pid) that answered
_DEPLOYMENT_OPTIONS = ("num_replicas", "num_cpus")


def _value(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``serve run`` arguments -> (engine options, server options, deployment options); raises ValueError
    naming any argument that is none of them."""
    engine_fields = set(EngineConfig.__dataclass_fields__)
    server_fields = set(ServerConfig.__dataclass_fields__)
    engine, server, deployment = {}, {}, {}
    for key, raw in args.items():
        name, value = key.replace("-", "_"), _value(raw)
        if name in _DEPLOYMENT_OPTIONS:
            deployment[name] = value
        elif name in engine_fields:
            engine[name] = value
        elif name in server_fields:
            server[name] = value
        else:
            raise ValueError(f"unknown argument {key!r}: give EngineConfig or ServerConfig fields, "
                             f"or {', '.join(_DEPLOYMENT_OPTIONS)}")
    return engine, server, deployment


def build(args: dict[str, Any]) -> Any:
    """The Serve application (``serve run iterserve.server.ray_serve:build key=value ...``)."""
    engine, server, deployment = split_args(args)
    EngineConfig(**engine), ServerConfig(**server)  # bad settings fail here, before any actor starts
    from ray import serve
    num_cpus = float(deployment.get("num_cpus", 1))
    options = {"num_replicas": int(deployment.get("num_replicas", 1)), "ray_actor_options": {"num_cpus": num_cpus},
               "health_check_period_s": 5, "health_check_timeout_s": 30}
    return serve.deployment(**options)(serve.ingress()(OpenAIServer)).bind(engine, server)


class OpenAIServer:
    """One replica: the app and its engine core, built in the actor."""

    def __init__(self, engine: dict[str, Any], server: dict[str, Any]) -> None:
        self.config = EngineConfig(**engine)
        self.server = ServerConfig(**server)
        self.openai_app: Any = None  # not `app`: Serve's ingress wrapper owns that name

    def __serve_build_asgi_app__(self) -> Any:  # Serve calls it once the actor is constructed
        from iterserve.server.api_server import build_app

        app = build_app(self.config, self.server)
        pid = str(os.getpid())

        @app.middleware("http")
        async def name_replica(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = pid
            return response

        self.openai_app = app
        return app

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: its engine core died or stopped stepping."""
        engine = self.openai_app.state.engine if self.openai_app is not None else None
        if engine is None:
            return
        if engine.error is not None:
            raise EngineDeadError(str(engine.error))
        problem = engine.health_problem() if engine.is_running else None
        if problem is not None:
            raise EngineDeadError(problem)
