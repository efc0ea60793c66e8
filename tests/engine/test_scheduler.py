"""Scheduling decisions on simulated steps (no model): budgets, chunking, preemption, policies."""

from __future__ import annotations

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from iterserve.engine.sequence import RequestMetrics, Sequence
from iterserve.sampling_params import SamplingParams


def seq(rid: str, prompt_len: int, max_tokens: int = 8, base: int = 0) -> Sequence:
    return Sequence(rid, None, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                    max_tokens, RequestMetrics(0.0))


def make(num_blocks=64, block_size=4, prefix=False, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, prefix))


def simulate(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: advance, sample a token, retire finished."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_tokens
        sched.block_manager.commit(s.seq)
    for s in out.scheduled:
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.output_token_ids.append(7)
            if len(s.seq.output_token_ids) >= s.seq.max_tokens:
                sched.finish(s.seq)


def summary(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_tokens) for s in out.scheduled]


def test_budget_chunks_prompts_and_decodes_come_first():
    sched = make(max_num_batched_tokens=10)
    sched.add(seq("a", 6))
    sched.add(seq("b", 9))
    out = sched.schedule()
    assert summary(out) == [("a", 6), ("b", 4)]  # b chunked to fit the budget
    simulate(sched, out)
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 5)]  # a decodes first; b's next chunk
    assert out.scheduled[0].is_prefill is False and out.scheduled[1].is_prefill
    simulate(sched, out)
    assert summary(sched.schedule()) == [("a", 1), ("b", 1)]


def test_new_request_joins_at_the_next_step():
    sched = make(max_num_batched_tokens=64)
    sched.add(seq("a", 5))
    simulate(sched, sched.schedule())
    sched.add(seq("b", 3))
    assert summary(sched.schedule()) == [("a", 1), ("b", 3)]


def test_max_num_seqs_caps_the_batch():
    sched = make(max_num_seqs=2)
    for r in "abc":
        sched.add(seq(r, 3))
    assert [r for r, _ in summary(sched.schedule())] == ["a", "b"]


def test_newest_sequence_is_preempted_when_blocks_run_out():
    sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.add(seq("a", 4, max_tokens=8))
    sched.add(seq("b", 4, max_tokens=8, base=100))
    simulate(sched, sched.schedule())  # a: 1 block, b: 1 block, each 4 tokens + 1 sampled
    preempted = []
    for _ in range(8):
        out = sched.schedule()
        preempted += [p.request_id for p in out.preempted]
        simulate(sched, out)
        if not sched.has_unfinished():
            break
    assert preempted and set(preempted) == {"b"}
    # b was recomputed later and finished; nothing is held
    for _ in range(20):
        if not sched.has_unfinished():
            break
        simulate(sched, sched.schedule())
    assert not sched.has_unfinished()
    sched.block_manager.check_no_leaks()


def test_a_lone_sequence_always_progresses():
    sched = make(num_blocks=3, block_size=4, max_num_batched_tokens=4)
    s = seq("a", 9, max_tokens=3)
    sched.add(s)
    for _ in range(10):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        simulate(sched, out)
    assert len(s.output_token_ids) == 3


def test_static_batching_admits_nothing_until_the_batch_is_done():
    sched = make(max_num_seqs=2, batching="static")
    sched.add(seq("a", 3, max_tokens=1))
    sched.add(seq("b", 3, max_tokens=4))
    simulate(sched, sched.schedule())  # a finishes at once, b keeps going
    sched.add(seq("c", 3))
    for _ in range(3):
        out = sched.schedule()
        assert [r for r, _ in summary(out)] == ["b"]  # c waits though a slot is free
        simulate(sched, out)
    assert [r for r, _ in summary(sched.schedule())] == ["c"]


def test_continuous_batching_fills_the_freed_slot():
    sched = make(max_num_seqs=2)
    sched.add(seq("a", 3, max_tokens=1))
    sched.add(seq("b", 3, max_tokens=4))
    simulate(sched, sched.schedule())
    sched.add(seq("c", 3))
    assert [r for r, _ in summary(sched.schedule())] == ["b", "c"]


def test_reserved_allocation_holds_blocks_for_the_whole_output():
    paged, reserved = make(num_blocks=8, block_size=4), make(num_blocks=8, block_size=4, kv_allocation="reserved")
    for sched in (paged, reserved):
        for r in "abcd":
            sched.add(seq(r, 4, max_tokens=12, base=ord(r) * 10))
    assert len(paged.schedule().scheduled) == 4  # 1 block each
    assert len(reserved.schedule().scheduled) == 2  # 4 blocks each (16 tokens)


def test_prefix_hit_skips_cached_tokens():
    sched = make(prefix=True, max_num_batched_tokens=64)
    a = seq("a", 10)
    sched.add(a)
    simulate(sched, sched.schedule())
    sched.add(seq("b", 10))
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 2)] and out.prefix_hit_tokens == 8
