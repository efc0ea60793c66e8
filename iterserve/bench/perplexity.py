"""Perplexity of a model on a fixed text: how much a weight format (float, ``gguf`` blocks, ``int8``) or a KV cache
dtype (``fp8``, ``int8``: a prompt attends to its K/V as stored) costs in quality, measured through the engine
itself (prompt logprobs), with the prefill tokens/s beside it.

The text is cut into windows of ``window`` tokens, each scored on its own (its first token has no context and
is not scored), so every format is scored on exactly the same tokens. The shipped text
(:data:`SHIPPED_TEXT`) is the opening of Shakespeare's *Coriolanus* (public domain), as it starts the
tinyshakespeare corpus of karpathy/char-rnn.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iterserve.inputs import TokensPrompt
from iterserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.llm import LLM

SHIPPED_TEXT = Path(__file__).resolve().parent.parent / "data" / "coriolanus_act1.txt"


@dataclass(frozen=True)
class Perplexity:
    """The text's perplexity, from ``scored`` tokens in ``windows`` windows, and the prefill speed."""

    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored: int
    windows: int
    tokens_per_s: float


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of ``window`` tokens (the last may be shorter; one of a single token is dropped)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids) - i >= 2]


def perplexity(llm: LLM, text: str, window: int = 512) -> Perplexity:
    """Score ``text`` with ``llm`` (every window at once, so the engine batches them)."""
    if llm.tokenizer is None:
        raise ValueError("perplexity of a text needs the model's tokenizer, and this model has none")
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    chunks = windows_of(ids, window)
    if not chunks:
        raise ValueError("the text is shorter than two tokens")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    prompts: list[TokensPrompt] = [{"prompt_token_ids": c} for c in chunks]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    nll, scored = 0.0, 0
    for chunk, out in zip(chunks, outputs):
        assert out.prompt_logprobs is not None
        for token, logprobs in zip(chunk[1:], out.prompt_logprobs[1:]):
            assert logprobs is not None
            nll -= logprobs[token].logprob
            scored += 1
    return Perplexity(math.exp(nll / scored), nll / scored, scored, len(chunks), sum(map(len, chunks)) / elapsed)


def compare(model: str, dtype: str, device: str | None, seed: int, formats: list[str], kv_cache_dtypes: list[str],
            text: str, window: int) -> tuple[int, list[str], list[list[Any]]]:
    """Score ``text`` under every weight format and KV cache dtype: the tokens scored, and a table's headers and
    rows (perplexity and its change against the first row)."""
    from iterserve.bench.progress import load_model_with_status
    from iterserve.config.kv_cache import canonical_kv_cache_dtype
    from iterserve.llm import LLM
    from iterserve.quantization.model import check_quantization, weight_formats

    for kv in kv_cache_dtypes:
        canonical_kv_cache_dtype(kv)  # refused before any model loads
    rows: list[list[Any]] = []
    first: Perplexity | None = None
    for name in formats:
        quantization = check_quantization(name)
        loaded = load_model_with_status(model, dtype, device, seed, quantization=quantization)
        weight_mb = round(sum(f.bytes for f in weight_formats(loaded.model)) / 1e6, 1)
        for kv in kv_cache_dtypes:
            llm = LLM(model, loaded=loaded, dtype=dtype, device=device, kv_cache_dtype=kv)
            result = perplexity(llm, text, window)
            first = first or result
            rows.append([name, kv, weight_mb, f"{result.perplexity:.3f}",
                         f"{100 * (result.perplexity / first.perplexity - 1):+.2f}%", f"{result.tokens_per_s:.0f}"])
    headers = ["format", "KV cache", "weights MB", "perplexity", f"vs {rows[0][0]}/{rows[0][1]}" if rows else "vs",
               "prefill tokens/s"]
    return first.scored if first else 0, headers, rows
