"""Offline inference with vLLM's interface: ``LLM(model=...).generate(prompts, params)``.

Prompts come in vLLM's shapes: a string, a list of token ids, ``{"prompt": str}`` (TextPrompt),
``{"prompt_token_ids": [...]}`` (TokensPrompt), or a list of any of them. vLLM's constructor
options that mean something here are mapped onto :class:`EngineConfig`; those that do not are
accepted with a one-line warning, so a vLLM script runs unchanged apart from its import.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, cast

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from iterserve.beam_search import BeamSearchOutput, run_beam_search
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.inputs import PromptType, parse_prompt
from iterserve.lora.request import LoRARequest
from iterserve.models.loader import DEFAULT_MODEL, LoadedModel, load_model
from iterserve.outputs import RequestOutput
from iterserve.platforms.memory import available_memory_bytes
from iterserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from iterserve.tokenizer import Tokenizer
from iterserve.tokenizer.hf import to_transformers

logger = logging.getLogger(__name__)

# vLLM options with no effect on this engine: accepted, with a warning that says so.
IGNORED_VLLM_OPTIONS = frozenset({
    "enforce_eager", "trust_remote_code", "tokenizer_mode", "skip_tokenizer_init", "revision", "tokenizer_revision",
    "swap_space", "cpu_offload_gb", "max_seq_len_to_capture", "disable_custom_all_reduce", "disable_log_stats",
    "disable_async_output_proc", "enable_chunked_prefill", "distributed_executor_backend", "load_format",
    "download_dir", "hf_token", "compilation_config", "task", "worker_cls", "tokenizer",
})
# vLLM options accepted only at the value this engine implements; any other value is an error.
FIXED_VLLM_OPTIONS: dict[str, Any] = {
    "pipeline_parallel_size": 1,
}


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Split vLLM's keyword arguments into EngineConfig fields; warn about or refuse the rest."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in fields:
            engine[name] = value
        elif name in FIXED_VLLM_OPTIONS:
            if value != FIXED_VLLM_OPTIONS[name]:
                raise ValueError(f"{name}={value!r} is not supported: this engine runs "
                                 f"{name}={FIXED_VLLM_OPTIONS[name]!r} only")
            logger.warning("LLM option %s=%r has no effect here (it is the only mode)", name, value)
        elif name in IGNORED_VLLM_OPTIONS:
            logger.warning("LLM option %s=%r has no effect here; ignored", name, value)
        elif name != "gpu_memory_utilization":
            raise TypeError(f"unknown LLM option: {name}")
    return engine


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)
    )


class LLM:
    """Runs every prompt through one engine with continuous (or static) batching.

    Keyword arguments are :class:`EngineConfig` fields (``dtype``, ``block_size``,
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``,
    ``kv_cache_memory`` or ``num_kv_blocks``, ``batching``, ``kv_allocation``, ``seed``, ``quantization``
    (``"gguf"``: a GGUF's Q4/Q8 blocks multiplied as stored; ``"int8"``: quantized at load), ...), or
    vLLM's options: ``gpu_memory_utilization`` sizes the KV cache as that fraction of the memory
    free once the weights are loaded (device memory on a GPU, available RAM on a CPU).
    Pass ``loaded=`` to share already-loaded weights between engines.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, loaded: LoadedModel | None = None, **kwargs: Any) -> None:
        engine_kwargs = _engine_kwargs(kwargs)
        fraction = kwargs.get("gpu_memory_utilization")
        if fraction is not None:
            if "kv_cache_memory" in kwargs or "num_kv_blocks" in kwargs:
                raise ValueError("give gpu_memory_utilization or kv_cache_memory/num_kv_blocks, not both")
            if not 0 < fraction <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
            if engine_kwargs.get("tensor_parallel_size", 1) > 1:
                raise ValueError("gpu_memory_utilization is measured on one process's loaded model; with "
                                 "tensor_parallel_size > 1 give kv_cache_memory (per rank) instead")
            config = EngineConfig(model=model, **engine_kwargs)
            loaded = loaded or load_model(config.model, config.dtype, config.device, config.seed,
                                          quantization=config.quantization, progress=config.load_progress)
            engine_kwargs["kv_cache_memory"] = int(fraction * _free_memory(loaded.model.device))
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), loaded)
        self._hf_tokenizer: PreTrainedTokenizerFast | None = None

    @property
    def engine(self) -> LLMEngine:
        return self.llm_engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.tokenizer

    def get_tokenizer(self) -> PreTrainedTokenizerFast:
        """The model's tokenizer as a transformers ``PreTrainedTokenizerFast`` (what vLLM returns, so scripts
        calling its methods run unchanged); built once. ``llm.tokenizer`` is iterserve's own."""
        if self._hf_tokenizer is None:
            self._hf_tokenizer = to_transformers(self._own_tokenizer())
        return self._hf_tokenizer

    def _own_tokenizer(self) -> Tokenizer:
        if self.llm_engine.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompts as token ids")
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, so the next prompts are computed in full (vLLM's method). True: unlike vLLM's,
        it succeeds with requests in flight, which keep the blocks they hold."""
        self.llm_engine.reset_prefix_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters a request without any gets (vLLM's method; this engine reads no model-specific
        generation defaults, so they are SamplingParams' own)."""
        return SamplingParams()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. ``lora_request`` names the LoRA adapter
        of every prompt, or (a list) of each prompt, None for the base model (``enable_lora=True``)."""
        batch = [prompts] if _is_single(prompts) else list(cast(Seq[PromptType], prompts))
        parsed = [parse_prompt(cast(PromptType, p)) for p in batch]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(parsed)
        else:
            params = list(sampling_params)
            if len(params) != len(parsed):
                raise ValueError(f"got {len(params)} SamplingParams for {len(parsed)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(parsed)
        else:
            loras = list(lora_request)
            if len(loras) != len(parsed):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(parsed)} prompts")
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        ids = []
        try:
            for prompt, p, lora in zip(parsed, params, loras):
                ids.append(self.llm_engine.add_request(prompt, p, output_kind=RequestOutputKind.FINAL_ONLY,
                                                       lora_request=lora))
        except ValueError:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to each conversation, then generate;
        each output's ``prompt`` is the rendered text, as vLLM gives it."""
        tokenizer = self._own_tokenizer()
        conversations = cast(list[list[dict[str, Any]]],
                             [messages] if messages and isinstance(messages[0], dict) else list(messages))
        rendered = [
            tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tools=tools,
                                          chat_template=chat_template,
                                          continue_final_message=continue_final_message,
                                          **(chat_template_kwargs or {}))
            for c in conversations
        ]
        outputs = self.generate([tokenizer.encode(p, add_special_tokens=False) for p in rendered], sampling_params,
                                use_tqdm)
        for output, prompt in zip(outputs, rendered):
            output.prompt = prompt
        return outputs

    def beam_search(
        self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search over the engine (:mod:`iterserve.beam_search`): one output per prompt, its
        ``beam_width`` best sequences best first. A text prompt is encoded with special tokens, as vLLM does;
        a sequence's ``tokens`` and ``text`` include the prompt's, as in vLLM."""
        tokenizer = self._own_tokenizer()
        batch = [prompts] if _is_single(prompts) else list(cast(Seq[PromptType], prompts))
        parsed = [parse_prompt(cast(PromptType, p)) for p in batch]
        ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in parsed]

        def generate(beams: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self.generate(beams, step, use_tqdm=False)

        return run_beam_search(generate, ids, params, tokenizer.eos_token_id,
                               lambda tokens: tokenizer.decode(tokens, skip_special_tokens=False),
                               self.llm_engine.max_model_len, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req") as bar:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():  # final outputs only
                    final[out.request_id] = out
                    bar.update(1)
        return [final[i] for i in ids]


def _free_memory(device: torch.device) -> int:
    """Bytes free for the KV cache on ``device`` now."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()
