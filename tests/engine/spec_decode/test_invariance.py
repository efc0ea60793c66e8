"""Speculative decoding on SmolLM2-135M changes no output: greedy tokens equal transformers' (and the
engine's without speculation) under chunking, preemption, prefix caching and a mixed batch, for n-gram
lookup and a draft model both; seeded sampling gives the same tokens; stops land where they would."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from tests.conftest import NUM_REFERENCE_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_REFERENCE_TOKENS)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# The model drafting for itself accepts nearly every draft; a random draft rejects nearly every one:
# between them both branches of verification run on every step.
SELF_DRAFT = {"model": "smollm2-135m", "num_speculative_tokens": 3}
RANDOM_DRAFT = {"model": "random:smollm2-135m?num_layers=1", "num_speculative_tokens": 2}
# The target's own file in gguf blocks: a draft that reads a fifth of the bytes and agrees on most tokens.
GGUF_DRAFT = {"model": "smollm2-135m", "num_speculative_tokens": 3, "quantization": "gguf"}
SPECS = {"ngram": NGRAM, "self-draft": SELF_DRAFT, "random-draft": RANDOM_DRAFT, "gguf-draft": GGUF_DRAFT}
COPY_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lantern, "
             "a notebook and a flask of tea, and wrote down the ships he saw pass.")


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def spec_llm(loaded, spec, **options) -> LLM:
    options.setdefault("num_kv_blocks", 256)
    return LLM(loaded=loaded, speculative_config=spec, **options)


def check_exercised(llm: LLM, spec_name: str) -> None:
    """Drafts were verified; some were accepted and (but for the drafts that are the target) some rejected."""
    stats = llm.engine.core.spec_stats
    assert stats.num_drafts > 0
    if spec_name != "random-draft":
        assert stats.num_accepted_tokens > 0
    if spec_name not in ("self-draft", "gguf-draft"):  # the gguf draft is the target itself on the reference path
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    llm.engine.block_manager.check_no_leaks()


@pytest.fixture(scope="module")
def copy_prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    convs = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}],
             [{"role": "user", "content": f"Fix the spelling of this text: {COPY_TEXT.replace('the', 'teh')}"}]]
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in convs]


@pytest.mark.parametrize(
    "spec_name, options",
    [("ngram", {}), ("ngram", dict(max_num_batched_tokens=16)), ("ngram", dict(block_size=1, num_kv_blocks=4096)),
     ("ngram", dict(kv_allocation="reserved")), ("self-draft", {}), ("gguf-draft", {}),
     ("random-draft", dict(max_num_batched_tokens=16)),
     ("random-draft", dict(block_size=1, num_kv_blocks=4096))],
    ids=lambda o: (",".join(f"{k}={v}" for k, v in o.items()) or "default") if isinstance(o, dict) else o,
)
def test_greedy_matches_transformers(smollm, chat_prompt_ids, hf_greedy, spec_name, options):
    llm = spec_llm(smollm, SPECS[spec_name], **options)
    assert tokens(llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)) == hf_greedy
    check_exercised(llm, spec_name)


@pytest.mark.parametrize("spec_name", ["ngram", "random-draft"])
def test_preemption_keeps_greedy_outputs(smollm, chat_prompt_ids, hf_greedy, spec_name):
    llm = spec_llm(smollm, SPECS[spec_name], num_kv_blocks=12, block_size=16, max_model_len=192)
    assert tokens(llm.generate(chat_prompt_ids, GREEDY, use_tqdm=False)) == hf_greedy
    assert llm.engine.num_preemptions > 0
    check_exercised(llm, spec_name)


@pytest.mark.parametrize("spec_name", ["ngram", "self-draft"])
def test_copying_matches_decoding_without_speculation(smollm, copy_prompts, spec_name):
    params = SamplingParams(temperature=0, max_tokens=60)
    reference = tokens(LLM(loaded=smollm, num_kv_blocks=256).generate(copy_prompts, params, use_tqdm=False))
    llm = spec_llm(smollm, SPECS[spec_name])
    assert tokens(llm.generate(copy_prompts, params, use_tqdm=False)) == reference
    stats = llm.engine.core.spec_stats
    assert stats.mean_accepted_length is not None and stats.mean_accepted_length > 2  # copying is what it drafts well


@pytest.mark.parametrize("spec_name", ["ngram", "self-draft"])
def test_prefix_cache_holds_only_accepted_tokens(smollm, copy_prompts, spec_name):
    """A second turn whose prompt is the first turn plus its answer hits the blocks that verification
    steps filled, as many as decoding without speculation publishes; had a rejected draft's K/V been
    published, the second answer would differ."""
    params = SamplingParams(temperature=0, max_tokens=48)

    def two_turns(llm: LLM):
        first = llm.generate(copy_prompts[:1], params, use_tqdm=False)[0]
        follow_up = list(first.prompt_token_ids) + first.outputs[0].token_ids + copy_prompts[1]
        return follow_up, llm.generate([follow_up], params, use_tqdm=False)[0]

    follow_up, expected = two_turns(LLM(loaded=smollm, num_kv_blocks=64))
    llm = spec_llm(smollm, SPECS[spec_name], num_kv_blocks=64)
    again, second = two_turns(llm)
    assert again == follow_up and second.outputs[0].token_ids == expected.outputs[0].token_ids
    assert second.num_cached_tokens == expected.num_cached_tokens > len(copy_prompts[0]) + 16
    plain = LLM(loaded=smollm, num_kv_blocks=64, enable_prefix_caching=False)
    assert second.outputs[0].token_ids == tokens(plain.generate([follow_up], params, use_tqdm=False))[0]
    check_exercised(llm, spec_name)


@pytest.mark.parametrize("spec_name", ["ngram", "random-draft"])
def test_requests_added_while_others_verify(smollm, chat_prompt_ids, hf_greedy, spec_name):
    """Prefill chunks, plain decodes and verifications share steps; outputs stay transformers'."""
    eng = LLMEngine(EngineConfig(num_kv_blocks=256, max_num_batched_tokens=32, step_history=1000,
                                 speculative_config=SPECS[spec_name]), smollm)
    final, pending, steps = {}, list(enumerate(chat_prompt_ids)), 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            eng.add_request(p, GREEDY, request_id=str(i))
        for out in eng.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
    assert [final[i] for i in range(len(chat_prompt_ids))] == hf_greedy
    mixed = [s for s in eng.step_history if s.num_prefill_seqs and s.num_draft_tokens]
    assert mixed  # a step verified drafts beside a prompt chunk
    eng.block_manager.check_no_leaks()


def test_stops_inside_an_accepted_run_end_where_decoding_ends(smollm, chat_prompt_ids, hf_greedy):
    """With the model drafting for itself whole runs are accepted at once; a stop token, a stop
    string or max_tokens falling inside one still ends the output exactly there."""
    ref = hf_greedy[0]
    plain = LLM(loaded=smollm, num_kv_blocks=256)
    llm = spec_llm(smollm, SELF_DRAFT)
    cases = [
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[5]]),
        SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]),
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=len(ref) + 2),
        SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.5, frequency_penalty=0.5,
                       repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=8, logprobs=2),
    ]
    for params in cases:
        expected = plain.generate([chat_prompt_ids[0]], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([chat_prompt_ids[0]], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason), params
        if params.logprobs:
            assert [sorted(lp) for lp in got.logprobs] == [sorted(lp) for lp in expected.logprobs]
            for a, b in zip(got.logprobs, expected.logprobs):
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    assert llm.engine.core.spec_stats.num_accepted_tokens > 20
    llm.engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("spec_name", ["ngram", "self-draft"])
def test_seeded_sampling_gives_the_same_tokens(smollm, chat_prompt_ids, copy_prompts, spec_name):
    """Verification draws one random number per emitted token, as decoding does: a seeded request
    samples the same tokens with or without speculation, alone or in a crowd, n = 2 included."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=1234, ignore_eos=True)
    group = SamplingParams(temperature=0.8, max_tokens=16, seed=5, n=2, ignore_eos=True)
    prompts = [copy_prompts[0], chat_prompt_ids[0]]
    plain = LLM(loaded=smollm, num_kv_blocks=256)
    expected = [tokens(plain.generate(prompts, params, use_tqdm=False)),
                [c.token_ids for c in plain.generate([prompts[0]], group, use_tqdm=False)[0].outputs]]
    llm = spec_llm(smollm, SPECS[spec_name])
    crowd = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)] * 2
    got = tokens(llm.generate([chat_prompt_ids[3], *prompts, chat_prompt_ids[1]], [crowd[0], params, params, crowd[1]],
                              use_tqdm=False))[1:3]
    assert got == expected[0]
    assert [c.token_ids for c in llm.generate([prompts[0]], group, use_tqdm=False)[0].outputs] == expected[1]
    assert llm.engine.core.spec_stats.num_accepted_tokens > 0
    llm.engine.block_manager.check_no_leaks()
