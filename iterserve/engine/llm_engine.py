"""The offline engine: input processing, the core and output processing wired in-process.

``add_request`` tokenizes and validates, then queues the request in the :class:`EngineCore`;
``step`` runs one core step on the calling thread and turns its deltas into RequestOutputs (text,
stop strings); ``abort_request`` frees a request's blocks at once. The server uses the same core
and output processor with the core in its own process (:mod:`iterserve.engine.core_client`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from iterserve.config import EngineConfig
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.capacity import Capacity
from iterserve.engine.core import EngineCore
from iterserve.engine.messages import EngineCoreRequest, StepStats
from iterserve.engine.output_processor import OutputProcessor
from iterserve.engine.scheduler import Scheduler
from iterserve.engine.sequence import Sequence
from iterserve.lora.request import LoRARequest
from iterserve.models.loader import LoadedModel
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import RequestOutputKind, SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, loaded)
        self.model_config = self.core.model_config
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError (and queues nothing) for bad input. Outputs
        come as ``output_kind`` says, else as ``params.output_kind`` does (vLLM's place for it); ``lora_request``
        names the LoRA adapter it runs under."""
        params = params or SamplingParams()
        output_kind = output_kind or params.output_kind
        request_id = request_id if request_id is not None else str(next(self._ids))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.core.model_name!r} has no tokenizer; pass the prompt as token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        arrival = arrival_time or time.perf_counter()
        compiling = self.core.add_request(EngineCoreRequest(request_id, token_ids, params, arrival, lora_request))
        if compiling is not None:  # offline, a grammar that cannot run is the caller's error, raised here
            try:
                compiling.result()
            except ValueError:
                self.core.abort_request(request_id)
                raise
        self.output_processor.add_request(request_id, text, token_ids, params, arrival, output_kind)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or done."""
        self.output_processor.abort(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache; running requests keep the blocks they hold."""
        self.core.reset_prefix_cache()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One core step on this thread; outputs of the requests that advanced (per their output kind).

        A dynamic batch still waiting to fill is waited for here: offline, no request can arrive meanwhile."""
        if (hold := self.core.scheduler.hold_s()) > 0:
            time.sleep(hold)
        processed = self.output_processor.process_outputs(self.core.step().outputs)
        for request_id in processed.to_abort:
            self.core.abort_request(request_id)
        for request_id, index in processed.seqs_to_abort:
            self.core.abort_sequence(request_id, index)
        return processed.outputs

    # -- the core's state, for tests and benchmarks ---------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self.core.capacity

    @property
    def requests(self) -> dict[str, Sequence]:
        return self.core.requests

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def step_history(self) -> deque[StepStats]:
        return self.core.step_history

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_preemptions(self) -> int:
        return self.core.num_preemptions

    @property
    def prefix_hit_tokens(self) -> int:
        return self.core.prefix_hit_tokens

    @property
    def peak_running(self) -> int:
        return self.core.peak_running

    def close(self) -> None:
        self.core.close()
