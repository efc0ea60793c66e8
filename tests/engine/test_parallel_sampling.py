"""n > 1 and best_of on SmolLM2-135M: one prefill shared by the forked sequences (copy-on-write of
the last partial block), per-sequence seeds, best_of ranking, logit_bias and prompt logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.output_processor import RequestOutputKind

PROMPT = "The three most important inventions of the last century were"


def run(engine: LLMEngine, prompt, params: SamplingParams):
    engine.add_request(prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    final = []
    while engine.has_unfinished_requests():
        final += engine.step()
    (out,) = final
    return out


def test_n_prefills_the_prompt_once_and_shares_its_blocks(smollm):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, enable_prefix_caching=False), smollm)
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) % 16  # the last prompt block is partial, so the forks must copy it on write
    engine.add_request(ids, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True),
                       output_kind=RequestOutputKind.FINAL_ONLY)
    engine.step()  # the prefill; the parent samples, the two children fork off it
    prompt_blocks = engine.block_manager.blocks_needed(len(ids))
    assert engine.num_running == 3
    assert engine.block_manager.num_used_blocks == prompt_blocks  # three sequences, one copy of the prompt
    engine.step()  # each writes its second token: two copy the shared partial block, the last writes in place
    assert engine.block_manager.num_used_blocks == prompt_blocks + 2
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    assert engine.core.num_prompt_tokens == len(ids)  # prefilled once, not three times
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different draws
    engine.block_manager.check_no_leaks()


def test_forked_sequences_read_the_shared_prompt_correctly(smollm):
    """Each child's sampled-token logprobs equal those of a fresh run over prompt + its tokens:
    the shared blocks and the copied partial block hold the right K/V."""
    llm = LLM(loaded=smollm, dtype="float32", num_kv_blocks=64)
    ids = llm.get_tokenizer().encode(PROMPT)
    out = llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, logprobs=0,
                                             ignore_eos=True))[0]
    for c in out.outputs:
        check = llm.generate([ids + c.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        expected = [check.prompt_logprobs[len(ids) + k][t].logprob for k, t in enumerate(c.token_ids)]
        got = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        assert got == pytest.approx(expected, abs=1e-3)
        assert c.cumulative_logprob == pytest.approx(sum(got), abs=1e-4)


def test_greedy_n_gives_identical_sequences_and_seeds_are_reproducible(smollm):
    llm = LLM(loaded=smollm, num_kv_blocks=64)
    greedy = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=8))[0]
    single = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    assert [c.token_ids for c in greedy.outputs] == [single.outputs[0].token_ids] * 3
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPT, seeded)[0].outputs]
    # again, now batched with other requests
    again = llm.generate([PROMPT, "Hello", PROMPT], [seeded, SamplingParams(max_tokens=4), seeded])
    assert [c.token_ids for c in again[0].outputs] == first == [c.token_ids for c in again[2].outputs]
    # sequence 0 keeps the request's own seed: it is what n=1 with that seed gives
    assert first[0] == llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=11, max_tokens=8,
                                                           ignore_eos=True))[0].outputs[0].token_ids


def test_best_of_keeps_the_n_with_the_highest_cumulative_logprob(smollm):
    llm = LLM(loaded=smollm, num_kv_blocks=64)
    common = dict(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    everything = llm.generate(PROMPT, SamplingParams(n=4, logprobs=0, **common))[0].outputs
    ranked = sorted(everything, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({c.cumulative_logprob for c in everything}) == 4
    best = llm.generate(PROMPT, SamplingParams(n=2, best_of=4, **common))[0].outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert best[0].logprobs is None  # not asked for: only used for the ranking


def _early_stop_string(tokenizer, outputs) -> tuple[int, int, str]:
    """(choice, tokens it keeps, stop string): two tokens' text that one choice writes early and no
    other choice writes at all."""
    texts = [c.text for c in outputs]
    for c in outputs:
        for k in range(1, 4):
            stop = tokenizer.decode(c.token_ids[k:k + 2])
            before = tokenizer.decode(c.token_ids[:k + 1])
            if (len(stop.strip()) >= 3 and stop not in before and texts[c.index].find(stop) >= 0
                    and not any(stop in t for i, t in enumerate(texts) if i != c.index)):
                return c.index, k + 2, stop
    raise AssertionError(f"no choice has a stop string of its own early: {texts}")


def test_a_choice_that_hits_a_stop_string_stops_computing_while_the_others_go_on(smollm):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, enable_prefix_caching=False, step_history=64), smollm)
    common = dict(n=3, temperature=1.0, seed=0, max_tokens=12, ignore_eos=True)
    free = run(engine, PROMPT, SamplingParams(**common))
    stopper, kept, stop = _early_stop_string(engine.tokenizer, free.outputs)
    generated = engine.core.num_generation_tokens
    engine.core.step_history.clear()
    rid = engine.add_request(PROMPT, SamplingParams(stop=[stop], **common), output_kind=RequestOutputKind.FINAL_ONLY)
    group = engine.requests[rid].group
    outputs, freed_while_siblings_ran = [], False
    while engine.has_unfinished_requests():
        outputs += engine.step()
        running = [s for s in group if not s.is_finished]
        if group[stopper].is_finished and running:
            assert group[stopper].block_table == [] and engine.num_running == len(running)
            freed_while_siblings_ran = True
    assert freed_while_siblings_ran
    (out,) = outputs
    choices = {c.index: c for c in out.outputs}
    assert choices[stopper].finish_reason == "stop" and len(choices[stopper].token_ids) == kept < 12
    others = [c for i, c in choices.items() if i != stopper]
    assert [(c.finish_reason, len(c.token_ids)) for c in others] == [("length", 12)] * 2
    # the core computed the stopped choice's tokens only up to the stop string, not on to max_tokens
    assert engine.core.num_generation_tokens - generated == kept + 2 * 12
    decode_seqs = [s.num_decode_seqs for s in engine.core.step_history]
    assert decode_seqs[-1] == 2 and decode_seqs.count(3) == kept - 1
    engine.block_manager.check_no_leaks()


def test_a_forked_group_in_a_tiny_pool_is_preempted_and_frees_every_block(smollm):
    # 4 blocks of 16 tokens; each of the three sequences needs 3 of them by the end
    llm = LLM(loaded=smollm, num_kv_blocks=4, block_size=16, max_model_len=64)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert llm.engine.num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == [expected.outputs[0].token_ids] * 3
    llm.engine.block_manager.check_no_leaks()
    assert llm.engine.block_manager.num_free_blocks == 4


@pytest.mark.slow  # two engines on the model: about a minute on two busy cores
def test_reserved_allocation_gives_each_child_its_own_blocks_from_the_reservation(smollm):
    """Under reserved allocation the children's blocks come out of the group's reservation (the prompt's
    partial block copied into the first): in a pool that holds exactly the group it runs unpreempted and
    samples the same tokens as paged allocation does."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    paged = LLM(loaded=smollm, num_kv_blocks=64, block_size=16, max_model_len=64).generate(PROMPT, params)[0]
    llm = LLM(loaded=smollm, num_kv_blocks=6, block_size=16, max_model_len=64, kv_allocation="reserved")
    ids = llm.get_tokenizer().encode(PROMPT)
    assert 0 < len(ids) < 16 and len(ids) + 12 <= 32  # 2 blocks a choice, the first one partial when forked
    reserved = llm.generate(PROMPT, params)[0]
    assert llm.engine.num_preemptions == 0
    assert [c.token_ids for c in reserved.outputs] == [c.token_ids for c in paged.outputs]
    llm.engine.block_manager.check_no_leaks()
    assert llm.engine.block_manager.num_free_blocks == 6


@pytest.mark.slow  # constant preemption and recompute: minutes on two busy cores
def test_forked_groups_under_preemption_free_every_block(smollm, chat_prompt_ids, hf_greedy):
    # 10 blocks of 16 tokens for three requests of three sequences each: constant preemption
    llm = LLM(loaded=smollm, num_kv_blocks=10, block_size=16, max_model_len=160)
    params = SamplingParams(n=3, temperature=0, max_tokens=24)
    out = llm.generate(chat_prompt_ids[:3], params)
    assert llm.engine.num_preemptions > 0
    for o, expected in zip(out, hf_greedy[:3]):
        assert [c.token_ids for c in o.outputs] == [expected] * 3
    bm = llm.engine.block_manager
    bm.check_no_leaks()
    assert bm.num_free_blocks == 10 and not llm.engine.requests
    # sampled groups too, with an abort in the middle
    engine = llm.engine
    rid = engine.add_request(chat_prompt_ids[0], SamplingParams(n=4, seed=1, max_tokens=40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    bm.check_no_leaks()


def test_logit_bias_bans_and_forces_tokens(smollm):
    llm = LLM(loaded=smollm, num_kv_blocks=64)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logit_bias={greedy[0]: -100}))
    assert banned[0].outputs[0].token_ids[0] != greedy[0]
    assert greedy[0] not in banned[0].outputs[0].token_ids
    forced = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logit_bias={"42": 100}))
    assert forced[0].outputs[0].token_ids == [42, 42, 42]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**7: 1}))
    assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_equal_transformers_float32(smollm, hf_smollm):
    model, _ = hf_smollm
    llm = LLM(loaded=smollm, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)  # chunked prefill
    ids = llm.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second run would hit the prefix cache: prompt logprobs bypass it
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        for j in range(1, len(ids)):
            entry = out.prompt_logprobs[j]
            assert entry[ids[j]].logprob == pytest.approx(reference[j - 1, ids[j]].item(), abs=2e-3)
            by_rank = {e.rank: t for t, e in entry.items() if e.rank <= 3}
            assert [by_rank[r] for r in (1, 2, 3)] == torch.topk(reference[j - 1], 3).indices.tolist()
            expected_rank = int((reference[j - 1] > reference[j - 1, ids[j]]).sum()) + 1
            assert abs(entry[ids[j]].rank - expected_rank) <= 1  # ties within float noise may swap
            assert all(math.isfinite(e.logprob) and e.decoded_token is not None for e in entry.values())
    assert llm.engine.num_preemptions == 0
    llm.engine.block_manager.check_no_leaks()
