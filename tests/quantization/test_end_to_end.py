"""The embedded SmolLM2-135M (a Q4_1/Q8_0 GGUF) served from its blocks through ``LLM``: checked against the
same engine with every quantized layer computed as dequantize-then-``F.linear`` (the reference, which is the
float32 model to the bit), and greedy tokens independent of how requests are batched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve import LLM, SamplingParams, kernels
from iterserve.bench.perplexity import SHIPPED_TEXT
from iterserve.models.loader import load_model
from iterserve.quantization import model as quantized_model
from iterserve.quantization import packed as P
from iterserve.quantization.model import weight_formats
from tests.models.test_llama import run_ours

needs_build = pytest.mark.skipif(kernels.ops is None, reason="the C++ kernels are not built")
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def gguf_smollm():
    return load_model("smollm2-135m", dtype="float32", device="cpu", quantization="gguf")


def dequantize_then_linear(x: torch.Tensor, w: P.PackedWeight, isa: int = 0, float_out: bool = False) -> torch.Tensor:
    """``P.linear``'s signature, with no kernel: what every kernel path approximates."""
    return F.linear(x, P.dequantize(w, x.dtype))


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_gguf_weights_take_under_0_3_of_float32(gguf_smollm, smollm):
    quantized = sum(f.bytes for f in weight_formats(gguf_smollm.model))
    dense = sum(f.bytes for f in weight_formats(smollm.model))
    assert quantized < 0.3 * dense
    assert {f.fmt for f in weight_formats(gguf_smollm.model)} == {"Q4_1", "Q8_0", "float32"}  # norms stay float


@pytest.mark.slow  # the reference dequantizes every weight at every step (the LM head: 28M values)
def test_dequantized_reference_is_the_float_model(gguf_smollm, smollm, chat_prompt_ids, monkeypatch):
    """The blocks hold exactly the float model's numbers: multiplied as dequantize-then-F.linear, greedy
    decoding through the engine gives the float32 model's tokens."""
    monkeypatch.setattr(quantized_model, "linear", dequantize_then_linear)
    dense = greedy_tokens(LLM(loaded=smollm, num_kv_blocks=128), chat_prompt_ids)
    assert greedy_tokens(LLM(loaded=gguf_smollm, num_kv_blocks=128), chat_prompt_ids) == dense


@needs_build
def test_kernel_logits_follow_the_dequantized_reference(gguf_smollm, monkeypatch):
    """The kernel quantizes activations to int8 per block of 32 (as llama.cpp does for these types): over 30
    layers the logits stay within 6% of the reference and pick the same next token almost everywhere."""
    ids = torch.tensor(gguf_smollm.tokenizer.encode(SHIPPED_TEXT.read_text()[:1000]))[:200]
    with torch.no_grad():
        fast = run_ours(gguf_smollm.model, ids, [len(ids)], block_size=16)
        monkeypatch.setattr(quantized_model, "linear", dequantize_then_linear)
        ref = run_ours(gguf_smollm.model, ids, [len(ids)], block_size=16)
    assert ((fast - ref).norm() / ref.norm()).item() < 0.06
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


@needs_build
def test_greedy_tokens_do_not_depend_on_batching(gguf_smollm, chat_prompt_ids):
    """Each row's activations are quantized and accumulated on their own, so a prompt decodes to the same
    tokens alone, in one batch of six, or joining and leaving a batch of two as others finish.

    (Chunked prefill is left out: float attention over a chunk and over the whole prompt differ by ~1e-4,
    and an activation that then rounds to the other int8 level moves the logits by up to ~3.)"""
    together = greedy_tokens(LLM(loaded=gguf_smollm, num_kv_blocks=128), chat_prompt_ids)
    alone = [greedy_tokens(LLM(loaded=gguf_smollm, num_kv_blocks=128), [p])[0] for p in chat_prompt_ids]
    pairs = greedy_tokens(LLM(loaded=gguf_smollm, num_kv_blocks=128, max_num_seqs=2), chat_prompt_ids)
    assert together == alone == pairs
    assert all(len(t) > 0 for t in together)


def test_llm_builds_the_quantized_model_from_its_name(chat_prompt_ids, gguf_smollm):
    llm = LLM("smollm2-135m", quantization="gguf", dtype="float32", num_kv_blocks=64)
    formats = {f.fmt for f in weight_formats(llm.llm_engine.core.executor.worker.loaded.model)}
    assert "Q4_1" in formats
    assert greedy_tokens(llm, chat_prompt_ids[:1]) == greedy_tokens(LLM(loaded=gguf_smollm, num_kv_blocks=64),
                                                                    chat_prompt_ids[:1])
    with pytest.raises(ValueError, match="quantization must be one of 'gguf', 'int8', got 'awq'"):
        LLM("smollm2-135m", quantization="awq")
