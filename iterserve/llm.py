"""Offline inference with vLLM's interface: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm.auto import tqdm

from iterserve.engine.llm_engine import EngineConfig, LLMEngine
from iterserve.engine.output_processor import RequestOutputKind
from iterserve.models.loader import DEFAULT_MODEL, LoadedModel
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs every prompt through one engine with continuous (or static) batching.

    Keyword arguments are :class:`EngineConfig` fields (``dtype``, ``block_size``,
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``kv_cache_memory`` or ``num_kv_blocks``, ``batching``, ``kv_allocation``, ``seed``, ...).
    Pass ``loaded=`` to share already-loaded weights between engines.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, loaded: LoadedModel | None = None, **kwargs: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # a single prompt, as text or token ids
        prompts = list(cast(Seq[Prompt], prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, output_kind=RequestOutputKind.FINAL_ONLY))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [cast(list[dict[str, Any]], conversations)]
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():  # final outputs only
                    final[out.request_id] = out
                    bar.update(1)
        return [final[i] for i in ids]
