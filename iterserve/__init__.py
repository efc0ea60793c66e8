"""iterserve: an LLM serving engine built on iteration-level batching over a paged KV cache."""

from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.inputs import TextPrompt, TokensPrompt
from iterserve.llm import LLM
from iterserve.outputs import CompletionOutput, Logprob, RequestOutput
from iterserve.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt", "__version__"]
