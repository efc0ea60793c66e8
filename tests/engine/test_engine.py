"""The engine on SmolLM2-135M: greedy outputs equal transformers' whatever the batching, chunking,
caching or preemption; seeded sampling is batch-independent; nothing leaks."""

from __future__ import annotations

import json
import random

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.models.loader import load_model
from tests.conftest import NUM_REFERENCE_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_REFERENCE_TOKENS)


def engine(loaded, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineConfig(**kw), loaded)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=1, num_kv_blocks=4096),
        dict(block_size=16),
        dict(block_size=32, num_kv_blocks=128),
        dict(max_num_batched_tokens=16),  # forces chunked prefill, mixed with decodes
        dict(batching="static", max_num_seqs=2),
        dict(batching="dynamic", max_num_seqs=4, max_batch_wait=0.2),  # the last batch of 2 waits to fill
        dict(enable_prefix_caching=False, max_num_seqs=1),
        dict(kv_allocation="reserved"),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_greedy_matches_transformers(smollm, chat_prompt_ids, hf_greedy, options):
    llm = LLM(loaded=smollm, **options)
    out = llm.generate(chat_prompt_ids, GREEDY)
    assert tokens(out) == hf_greedy
    llm.engine.block_manager.check_no_leaks()


def test_preemption_keeps_greedy_outputs(smollm, chat_prompt_ids, hf_greedy):
    # 12 blocks of 16 tokens: all six requests cannot hold their KV at once.
    llm = LLM(loaded=smollm, num_kv_blocks=12, block_size=16, max_model_len=192)
    out = llm.generate(chat_prompt_ids, GREEDY)
    assert tokens(out) == hf_greedy
    assert llm.engine.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in out) == llm.engine.num_preemptions
    llm.engine.block_manager.check_no_leaks()


def test_prefix_cache_hits_and_keeps_outputs(smollm, hf_smollm):
    hf, tok = hf_smollm
    system = {"role": "system", "content": "You are a meticulous assistant who answers briefly. " * 6}
    convs = [[system, {"role": "user", "content": q}] for q in ("What is 2+2?", "Name a fruit.", "Say hello.")]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in convs]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12)
    for caching in (True, False):
        llm = LLM(loaded=smollm, enable_prefix_caching=caching, num_kv_blocks=64)
        first = llm.generate(prompts[:1], params)
        rest = llm.generate(prompts[1:], params)
        assert tokens(first + rest) == ref
        cached = [o.num_cached_tokens for o in rest]
        if caching:
            common = next(i for i, (a, b, c) in enumerate(zip(*prompts)) if not a == b == c)
            assert common >= 48 and cached == [common // 16 * 16] * 2  # every full shared block hit
            assert llm.engine.prefix_hit_tokens == sum(cached)
        else:
            assert cached == [0, 0] and llm.engine.prefix_hit_tokens == 0


def test_requests_added_while_others_decode(smollm, chat_prompt_ids, hf_greedy):
    eng = engine(smollm, max_num_batched_tokens=32, step_history=1000)
    final = {}
    pending = list(enumerate(chat_prompt_ids))
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            eng.add_request(p, GREEDY, request_id=str(i))
        for out in eng.step():
            if out.finished:
                final[int(out.request_id)] = out.outputs[0].token_ids
        steps += 1
    assert [final[i] for i in range(len(chat_prompt_ids))] == hf_greedy
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in eng.step_history)  # mixed steps happened


def test_seeded_sampling_is_reproducible_and_batch_independent(smollm, chat_prompt_ids):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    llm = LLM(loaded=smollm)
    alone = tokens(llm.generate([chat_prompt_ids[0]], params))[0]
    again = tokens(llm.generate([chat_prompt_ids[0]], params))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    crowded = tokens(llm.generate([chat_prompt_ids[3], chat_prompt_ids[0], chat_prompt_ids[1], chat_prompt_ids[2]],
                                  [others[0], params, others[1], others[2]]))[1]
    assert alone == again == crowded
    other_seed = tokens(llm.generate([chat_prompt_ids[0]], SamplingParams(**{**params.__dict__, "seed": 99})))[0]
    assert other_seed != alone


def test_stop_strings_truncate_and_are_never_streamed(smollm, chat_prompt_ids, hf_greedy):
    tok = smollm.tokenizer
    full = tok.decode(hf_greedy[0])  # "The capital of France is Paris."
    assert "Paris" in full
    eng = engine(smollm)
    eng.add_request(chat_prompt_ids[0], SamplingParams(temperature=0, max_tokens=24, stop=["Paris", "zzz"]))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            final = out.outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "Paris"
    assert final.text == full[: full.index("Paris")]
    assert "".join(deltas) == final.text and not any("P" in d for d in deltas)


def test_stop_token_ids_min_tokens_ignore_eos_and_length(smollm, chat_prompt_ids, hf_greedy):
    llm = LLM(loaded=smollm)
    ref = hf_greedy[0]
    stop_tok = ref[3]
    out = llm.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]))[0]
    c = out.outputs[0]
    assert c.token_ids == ref[:4] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.text == smollm.tokenizer.decode(ref[:3])
    eos_at = len(ref)  # the reference ends with EOS
    assert ref[-1] in smollm.tokenizer.eos_token_ids
    out = llm.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=40, min_tokens=eos_at + 3))[0]
    assert len(out.outputs[0].token_ids) >= eos_at + 3 and out.outputs[0].token_ids[: eos_at - 1] == ref[:-1]
    out = llm.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 30 and out.outputs[0].finish_reason == "length"


def test_logprobs_are_top_n_of_the_model_distribution(smollm, chat_prompt_ids, hf_greedy):
    llm = LLM(loaded=smollm)
    out = llm.generate([chat_prompt_ids[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy pick is the top-1, so it is among the three
        assert lp[tok].logprob == max(v.logprob for v in lp.values()) and all(v.logprob <= 0 for v in lp.values())
        assert lp[tok].rank == 1


def test_metrics_and_step_trace(smollm, chat_prompt_ids, tmp_path):
    trace = tmp_path / "trace.jsonl"
    llm = LLM(loaded=smollm, step_trace=str(trace))
    outs = llm.generate(chat_prompt_ids[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.engine.close()
    for o in outs:
        m = o.metrics
        assert m.num_output_tokens == 8 and m.num_prompt_tokens == len(o.prompt_token_ids)
        assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency
        assert len(m.itl) == 7 and m.tpot == pytest.approx(sum(m.itl) / 7)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    reqs = [r for r in records if r["type"] == "request"]
    assert len(steps) == llm.engine.num_steps and len(reqs) == 3
    assert steps[0]["num_prefill_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert all(s["num_decode_tokens"] == 3 for s in steps[1:])


def test_bad_requests_are_rejected_without_disturbing_others(smollm, chat_prompt_ids, hf_greedy):
    eng = engine(smollm, max_model_len=128)
    eng.add_request(chat_prompt_ids[0], GREEDY, request_id="good")
    eng.step()
    for bad, match in [
        (list(range(200)), "max_model_len"),
        ([], "empty"),
        ([5, 10**9], "token ids"),
        ("", "empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(bad, GREEDY)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        eng.add_request(chat_prompt_ids[0], SamplingParams(max_tokens=500))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(chat_prompt_ids[1], GREEDY, request_id="good")
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out
    assert final.request_id == "good" and final.outputs[0].token_ids == hf_greedy[0]
    eng.block_manager.check_no_leaks()


def test_pool_smaller_than_max_model_len_is_refused(smollm):
    with pytest.raises(ValueError, match="needs more KV cache than the pool holds"):
        engine(smollm, num_kv_blocks=4, block_size=16, max_model_len=128)


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("random:smollm2-135m?num_layers=2", dtype="float32", device="cpu", seed=0)


def test_aborts_mid_prefill_and_mid_decode_free_everything(tiny_loaded):
    eng = engine(tiny_loaded, num_kv_blocks=32, max_num_batched_tokens=8)
    eng.add_request(list(range(50, 55)), SamplingParams(max_tokens=20), request_id="decoding")
    eng.step()
    eng.add_request(list(range(1, 40)), SamplingParams(max_tokens=20), request_id="prefilling")
    eng.step()
    assert eng.requests["prefilling"].is_prefill and eng.requests["decoding"].output_token_ids
    assert eng.abort_request("prefilling") and eng.abort_request("decoding")
    assert not eng.abort_request("decoding") and not eng.has_unfinished_requests()
    eng.block_manager.check_no_leaks()


def test_random_requests_and_aborts_never_leak_blocks(tiny_loaded):
    rng = random.Random(7)
    eng = engine(tiny_loaded, num_kv_blocks=24, block_size=8, max_model_len=96, max_num_batched_tokens=48,
                 max_num_seqs=6)
    shared = [rng.randrange(1, 49152) for _ in range(24)]
    live: set[str] = set()
    for i in range(60):
        if rng.random() < 0.5:
            n = rng.randrange(1, 60)
            prompt = (shared[: rng.randrange(0, 24)] + [rng.randrange(1, 49152) for _ in range(n)])[:80]
            p = SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randrange(1, 96 - len(prompt)),
                               ignore_eos=True)
            live.add(eng.add_request(prompt, p, request_id=f"r{i}"))
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            eng.abort_request(victim)
            live.discard(victim)
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
    while eng.has_unfinished_requests():
        eng.step()
    eng.block_manager.check_no_leaks()
    assert eng.num_preemptions > 0 and eng.prefix_hit_tokens > 0  # the fuzz exercised both paths


def test_reserved_allocation_runs_fewer_sequences_at_once(tiny_loaded):
    """Reserving prompt + max_tokens up front (pre-PagedAttention servers) fits fewer sequences."""
    prompts = [[1000 * i + j for j in range(1, 41)] for i in range(1, 9)]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    peaks = {}
    for mode in ("paged", "reserved"):
        llm = LLM(loaded=tiny_loaded, num_kv_blocks=40, block_size=16, max_model_len=160, kv_allocation=mode)
        llm.generate(prompts, params)
        peaks[mode] = llm.engine.peak_running
        llm.engine.block_manager.check_no_leaks()
    assert peaks["reserved"] == 4  # 40 blocks // ceil(140 / 16) blocks each
    assert peaks["paged"] > peaks["reserved"]
