"""Engine cores as Ray actors (``iterserve serve --data-parallel-backend ray``): each data-parallel replica's
core runs in an actor that reserves one CPU, the actors spread over the Ray cluster's nodes. The API process
stays where it was started; it binds its sockets on its node's address and each actor connects to them, so
requests and outputs travel as with local core processes. :class:`RayCore` is the actor's handle, shaped as
the :class:`multiprocessing.Process` the core client watches. Ray is not a dependency of iterserve: install
``ray`` to use this backend.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from iterserve.config import EngineConfig
from iterserve.engine.core_proc import run_engine_core

logger = logging.getLogger(__name__)


class EngineCoreActor:
    """The actor: runs one engine core's busy loop until the API process sends Shutdown."""

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, log_level: str,
            num_threads: int | None) -> None:
        run_engine_core(config, input_addr, output_addr, log_level, num_threads)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


def node_address() -> str:
    """This process's address on the Ray cluster (the one the actors reach it by), joining one if needed."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    return str(ray.util.get_node_ip_address())


class RayCore:
    """One replica's actor. ``sentinel`` turns readable when its core ends (as a process's does), then
    ``exitcode`` says how: 0 after Shutdown, 1 when the core failed or the actor died."""

    def __init__(self, index: int, config: EngineConfig, input_addr: str, output_addr: str, log_level: str,
                 num_threads: int | None) -> None:
        import ray

        # two threads: the core's loop occupies one, so node_id() can still answer
        actor_class: Any = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=2)(EngineCoreActor)
        self.actor = actor_class.options(name=f"iterserve-engine-core-{index}-{os.getpid()}",
                                         scheduling_strategy="SPREAD").remote()
        self._run = self.actor.run.remote(config, input_addr, output_addr, log_level, num_threads)
        self.pid: int | None = None  # the actor's, once its core says it is ready
        self.exitcode: int | None = None
        self.sentinel, self._signal = os.pipe()
        self._thread = threading.Thread(target=self._wait, name=f"ray-core-{index}", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        import ray

        try:
            ray.get(self._run)
            code = 0
        except Exception as e:  # noqa: BLE001 - the core client reads the exit code, and logs its own line
            logger.warning("engine core actor ended: %s", e)
            code = 1
        self.exitcode = code
        ray.kill(self.actor)  # its CPU goes back to the cluster
        os.write(self._signal, b"x")

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive() and self._signal >= 0:  # ended: the pipe is spent (the reader is gone)
            os.close(self._signal)
            os.close(self.sentinel)
            self._signal = -1

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)

    def node_id(self) -> str:
        """The Ray node the core runs on."""
        import ray

        return str(ray.get(self.actor.node_id.remote()))
