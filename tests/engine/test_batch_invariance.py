"""bf16 greedy outputs do not depend on what else runs: each prompt's tokens and their logprobs, bit for bit,
are the same alone as in one batch, under chunked prefill, static batching, prefix caching (the second run
hitting cached blocks) and n-gram speculation, on natural, copy-heavy and long prompts. Logprobs are compared
rather than tokens alone: a reduction in another order changes their bits long before it flips a greedy pick."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams, kernels

pytestmark = pytest.mark.skipif(kernels.ops is None,
                                reason="no C++ kernels: bf16 would run emulated; the float32 tests apply")

COPY_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern, "
             "a notebook and a flask of tea, and wrote down the ships he saw pass.")
NATURAL = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
           "Explain photosynthesis in one sentence.", "hi", "Tell me a joke about cats."]
# Copy-heavy prompts long enough that decoding runs past the contexts the attention kernel splits across
# threads, and one prompt longer than the decode kernel's share of prefill.
COPY = [f"Repeat this text exactly:\n\n{COPY_TEXT * 3}", f"Fix the spelling: {COPY_TEXT.replace('the', 'teh') * 3}",
        f"Copy this list twice: {', '.join(['apples', 'pears', 'plums', 'figs', 'dates', 'limes'] * 8)}",
        f"Summarize in one line:\n\n{COPY_TEXT * 16}"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MODES = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=32),
    "static": dict(batching="static", max_num_seqs=4),
    "prefix-cached": dict(enable_prefix_caching=True),
    "ngram": dict(speculative_config=NGRAM),
    "preempted": dict(num_kv_blocks=46),  # ten prompts, one of 36 blocks: running sequences give way and come back
}
FAST_MODES = ("batch", "chunked")  # the rest under -m slow: the default suite stays fast

Output = tuple[tuple[int, ...], tuple[float, ...]]


@pytest.fixture(scope="module")
def smollm_bf16():
    from iterserve.models.loader import load_model

    return load_model("smollm2-135m", dtype="bfloat16", device="cpu")


@pytest.fixture(scope="module")
def prompts(smollm_bf16) -> list[list[int]]:
    tok = smollm_bf16.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                       add_special_tokens=False) for p in NATURAL + COPY]


def outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[Output]:
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        out.append((tuple(c.token_ids), tuple(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))))
    return out


@pytest.fixture(scope="module")
def alone(smollm_bf16, prompts) -> list[Output]:
    assert smollm_bf16.model.dtype == torch.bfloat16
    llm = LLM(loaded=smollm_bf16, num_kv_blocks=256, enable_prefix_caching=False)
    return [outputs(llm, [p])[0] for p in prompts]


def differing(expected: list[Output], got: list[Output]) -> str:
    tokens = sum(a[0] != b[0] for a, b in zip(expected, got, strict=True))
    bits = sum(a != b for a, b in zip(expected, got, strict=True))
    return f"{tokens}/{len(got)} differ in tokens, {bits}/{len(got)} in logprobs"


@pytest.mark.parametrize("mode", [m if m in FAST_MODES else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_bf16_outputs_alone_equal_batched(smollm_bf16, prompts, alone, mode):
    assert max(map(len, prompts)) > 512 and len(prompts[len(NATURAL)]) + PARAMS.max_tokens > 128
    llm = LLM(loaded=smollm_bf16, **{"num_kv_blocks": 256, "enable_prefix_caching": False, **MODES[mode]})
    got = outputs(llm, prompts)
    if mode == "prefix-cached":
        got += outputs(llm, prompts)  # every full block of every prompt now hits the cache
        assert llm.engine.prefix_hit_tokens > 0
    if mode == "preempted":
        assert llm.engine.num_preemptions > 0
    expected = alone * (len(got) // len(alone))
    assert got == expected, differing(expected, got)
    llm.engine.block_manager.check_no_leaks()


def test_ngram_halves_the_passes_of_copying_with_the_same_tokens(smollm_bf16, prompts):
    """Copy-heavy prompts, each alone, at k=4: verification gives decoding's bf16 tokens and logprobs bit for
    bit in at most half the forward passes."""
    copying = prompts[len(NATURAL):len(NATURAL) + 2]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=0, ignore_eos=True)
    runs = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        llm = LLM(loaded=smollm_bf16, num_kv_blocks=256, enable_prefix_caching=False, speculative_config=spec)
        got, steps = [], []
        for p in copying:
            before = llm.engine.num_steps
            got += outputs(llm, [p], params)
            steps.append(llm.engine.num_steps - before)
        runs[name] = got, steps
    assert runs["ngram"][0] == runs["plain"][0]
    for plain, ngram in zip(runs["plain"][1], runs["ngram"][1], strict=True):
        assert plain >= 2.0 * ngram, (runs["plain"][1], runs["ngram"][1])


def test_seeded_sampling_alone_equals_batched(smollm_bf16, prompts):
    """Each request's own generator: its sampled bf16 tokens do not depend on the requests beside it."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=100 + i) for i in range(len(prompts))]
    llm = LLM(loaded=smollm_bf16, num_kv_blocks=256, enable_prefix_caching=False)
    alone = [llm.generate([p], [q], use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1
