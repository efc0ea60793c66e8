"""Scheduling decisions on simulated steps (no model): budgets, chunking, preemption, policies, and
update_from_output's bookkeeping: progress, stops, freeing."""

from __future__ import annotations

import pytest

from iterserve.config import SchedulerConfig
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.sampler import SampleResult, Verdict
from iterserve.engine.scheduler import Scheduler, SchedulerOutput, sampling_seqs
from iterserve.engine.sequence import Sequence, SequenceStatus
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


def seq(rid: str, prompt_len: int, max_tokens: int = 8, base: int = 0, stop_ids: frozenset[int] = frozenset(),
        arrival: float = 0.0, **params) -> Sequence:
    return Sequence(rid, None, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens, **params),
                    max_tokens, RequestMetrics(arrival), stop_ids=stop_ids)


def make(num_blocks=64, block_size=4, prefix=False, clock=None, **cfg) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(**cfg), bm) if clock is None else Scheduler(SchedulerConfig(**cfg), bm, clock)


def simulate(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    """What the engine does after the forward pass: every sampling sequence (forks too) samples ``token``."""
    n = len(sampling_seqs(out.scheduled))
    return sched.update_from_output(out, SampleResult([token] * n, [None] * n)).finished


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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_dynamic_batch_waits_for_its_size_or_its_timeout_then_runs_to_completion():
    clock = Clock()
    sched = make(max_num_seqs=3, batching="dynamic", max_batch_wait=0.5, clock=clock)
    sched.add(seq("a", 3, max_tokens=1, arrival=0.0))
    clock.now = 0.2
    sched.add(seq("b", 3, max_tokens=3, arrival=0.2))
    assert sched.schedule().is_empty and sched.hold_s() == pytest.approx(0.3)  # a has waited 0.2 s of 0.5
    clock.now = 0.49
    assert sched.schedule().is_empty
    clock.now = 0.5  # a's wait is over: the batch starts with the two that came
    assert sched.hold_s() == 0
    out = sched.schedule()
    assert [r for r, _ in summary(out)] == ["a", "b"]
    simulate(sched, out)  # a finishes, b runs on
    sched.add(seq("c", 3, arrival=0.6))
    clock.now = 5.0  # c has waited long, but a batch is running: it waits for the batch as under static
    assert sched.hold_s() == 0
    for _ in range(2):
        out = sched.schedule()
        assert [r for r, _ in summary(out)] == ["b"]
        simulate(sched, out)
    assert [r for r, _ in summary(sched.schedule())] == ["c"]


def test_dynamic_batch_starts_at_once_when_it_is_full():
    clock = Clock()
    sched = make(max_num_seqs=2, batching="dynamic", max_batch_wait=10.0, clock=clock)
    sched.add(seq("a", 3, arrival=0.0))
    assert sched.schedule().is_empty and sched.hold_s() == pytest.approx(10.0)
    sched.add(seq("b", 3, arrival=0.0))
    sched.add(seq("c", 3, arrival=0.0))
    assert sched.hold_s() == 0
    assert [r for r, _ in summary(sched.schedule())] == ["a", "b"]  # a batch of max_num_seqs; c waits for the next


def test_max_batch_wait_must_be_a_number_of_seconds():
    with pytest.raises(ValueError, match="max_batch_wait"):
        SchedulerConfig(max_batch_wait=-1)
    assert make(batching="static").hold_s() == 0 and make().hold_s() == 0


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


def group(rid: str, prompt_len: int, n: int, max_tokens: int) -> Sequence:
    """An n > 1 request as the core queues it: the parent, its children waiting to fork off it."""
    members = [seq(rid, prompt_len, max_tokens=max_tokens, n=n) for _ in range(n)]
    for index, member in enumerate(members):
        member.index = index
    members[0].forks, members[0].group = members[1:], members
    return members[0]


@pytest.mark.parametrize("prompt_len", [6, 8])  # the last prompt block partly filled, or full
def test_reserved_allocation_admits_a_group_only_if_every_choice_fits_and_never_preempts(prompt_len):
    # 4-token blocks, 8 output tokens: the parent needs ceil((prompt + 8) / 4) blocks, and each child
    # the same less the prompt's full blocks it shares
    own = -(-(prompt_len + 8) // 4)
    need = own + 2 * (own - prompt_len // 4)
    sched = make(num_blocks=need + 2, block_size=4, kv_allocation="reserved")
    a = group("a", prompt_len, n=3, max_tokens=8)
    sched.add(a)
    sched.add(seq("b", 4, max_tokens=8, base=100))  # 3 blocks: only 2 are left beside the group
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.preempted
        if any(m.status == SequenceStatus.RUNNING for m in a.group):
            assert "b" not in {s.seq.request_id for s in out.scheduled}
        simulate(sched, out)
        steps += 1
    assert [len(m.output_token_ids) for m in a.group] == [8, 8, 8]
    assert steps == 8 + 8  # the group's prefill and seven decodes, then b's
    sched.block_manager.check_no_leaks()


def test_prefix_hit_skips_cached_tokens():
    sched = make(prefix=True, max_num_batched_tokens=64)
    a = seq("a", 10)
    sched.add(a)
    simulate(sched, sched.schedule())
    sched.add(seq("b", 10))
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 2)] and out.prefix_hit_tokens == 8


# -- update_from_output -------------------------------------------------------------------------------


def test_update_advances_progress_commits_blocks_and_appends_only_for_finished_prompts():
    sched = make(prefix=True, max_num_batched_tokens=6)
    a = seq("a", 10)
    sched.add(a)
    out = sched.schedule()
    assert summary(out) == [("a", 6)] and not out.scheduled[0].samples  # a chunk: no token yet
    assert simulate(sched, out) == [] and a.num_computed_tokens == 6 and a.output_token_ids == []
    assert a.num_hashed_blocks == 1  # the first full block (4 tokens) is in the prefix cache
    out = sched.schedule()
    assert summary(out) == [("a", 4)] and out.scheduled[0].samples and out.scheduled[0].is_prefill
    simulate(sched, out, token=99)
    assert (a.num_computed_tokens, a.output_token_ids, a.num_hashed_blocks) == (10, [99], 2)
    out = sched.schedule()
    assert summary(out) == [("a", 1)] and not out.scheduled[0].is_prefill


def test_update_refuses_a_sample_count_that_does_not_match():
    sched = make()
    sched.add(seq("a", 3))
    with pytest.raises(ValueError, match="samples"):
        sched.update_from_output(sched.schedule(), SampleResult([1, 2], [None, None]))


def test_stop_token_respects_min_tokens_and_reports_stop_token_ids():
    sched = make()
    eos, own = 7, 8
    a = seq("a", 3, max_tokens=10, stop_ids=frozenset({eos, own}), min_tokens=2, stop_token_ids=[own])
    b = seq("b", 3, max_tokens=10, base=50, stop_ids=frozenset({eos, own}), stop_token_ids=[own])
    sched.add(a)
    sched.add(b)
    assert simulate(sched, sched.schedule(), token=eos) == [b]  # a's EOS came before min_tokens
    assert (b.finish_reason, b.stop_reason, b.status) == ("stop", None, SequenceStatus.FINISHED)
    assert a.output_token_ids == [eos] and a.finish_reason is None
    assert simulate(sched, sched.schedule(), token=own) == [a]
    assert (a.finish_reason, a.stop_reason) == ("stop", own)
    assert not sched.has_unfinished()
    sched.block_manager.check_no_leaks()


def test_length_stops_at_max_tokens_or_max_model_len():
    sched = make(max_model_len=6)
    a, b = seq("a", 3, max_tokens=2), seq("b", 4, max_tokens=50, base=20)
    sched.add(a)
    sched.add(b)
    assert simulate(sched, sched.schedule()) == []
    finished = simulate(sched, sched.schedule())
    assert [f.request_id for f in finished] == ["a", "b"] and a.finish_reason == b.finish_reason == "length"
    assert len(a.output_token_ids) == 2 and b.num_tokens == 6
    sched.block_manager.check_no_leaks()


def test_finish_frees_blocks_wherever_the_sequence_is():
    sched = make(max_num_seqs=1)
    a, b = seq("a", 5), seq("b", 5, base=10)
    sched.add(a)
    sched.add(b)
    simulate(sched, sched.schedule())
    sched.finish(b)  # still waiting
    sched.finish(a, "error")  # running
    assert (a.finish_reason, b.finish_reason) == ("error", "abort") and not sched.has_unfinished()
    sched.block_manager.check_no_leaks()


def verify(sched: Scheduler, out: SchedulerOutput, accepted: dict[str, int], token: int = 9):
    """The engine after a verification pass: each sequence accepts its first ``accepted[id]`` drafts."""
    verdicts, n = {}, 0
    for s in out.scheduled:
        if s.samples:
            if s.spec_token_ids:
                keep = s.spec_token_ids[:accepted[s.seq.request_id]]
                verdicts[n] = Verdict(keep, [None] * len(keep))
            n += 1
    return sched.update_from_output(out, SampleResult([token] * n, [None] * n, verdicts=verdicts))


def test_drafts_are_verified_inside_the_budget_after_plain_decodes():
    sched = make(max_num_batched_tokens=9)
    for rid in "abc":
        sched.add(seq(rid, 3, max_tokens=20))
    simulate(sched, sched.schedule())
    sched.running[0].spec_token_ids = [1, 2, 3]
    sched.running[2].spec_token_ids = [4, 5, 6, 7, 8]
    out = sched.schedule()
    # a verifies 1 + 3 tokens; b decodes; c's drafts are cut to the 3 tokens of budget left after its own
    assert summary(out) == [("b", 1), ("a", 4), ("c", 4)]
    assert out.scheduled[2].spec_token_ids == [4, 5, 6]
    assert all(not s.is_prefill for s in out.scheduled) and out.num_tokens == 9
    assert all(not s.seq.spec_token_ids for s in out.scheduled)  # drafts are used once


def test_only_accepted_tokens_count_and_blocks_past_them_return():
    sched = make(block_size=4, prefix=True, max_num_batched_tokens=64)
    sched.add(s := seq("a", 6, max_tokens=20))
    simulate(sched, sched.schedule())  # 6 computed, 7 tokens
    s.spec_token_ids = [20, 21, 22, 23, 24]
    out = sched.schedule()
    assert summary(out) == [("a", 6)] and len(s.block_table) == 3  # slots for tokens 6..11
    update = verify(sched, out, {"a": 1})
    assert s.output_token_ids == [7, 20, 9] and s.num_computed_tokens == 8
    assert update.new_tokens[id(s)] == 2 and update.spec.num_accepted_tokens == 1
    assert len(s.block_table) == 2  # the block held only rejected drafts' slots is free again
    assert s.num_hashed_blocks == 2  # tokens 0..7 are real: both full blocks are published
    assert sched.block_manager.num_used_blocks == 2


def test_a_stop_inside_the_accepted_run_ends_the_sequence_there():
    sched = make(max_num_batched_tokens=64)
    sched.add(s := seq("a", 4, max_tokens=20, stop_ids=frozenset({31})))
    simulate(sched, sched.schedule())
    s.spec_token_ids = [30, 31, 32]
    update = verify(sched, sched.schedule(), {"a": 3})
    assert s.output_token_ids == [7, 30, 31] and s.finish_reason == "stop"
    assert update.finished == [s] and update.new_tokens[id(s)] == 2
    sched.block_manager.check_no_leaks()
    sched.add(t := seq("b", 4, max_tokens=3))
    simulate(sched, sched.schedule())
    t.spec_token_ids = [1, 2]  # more than max_tokens allows: the run is cut at the length limit
    verify(sched, sched.schedule(), {"b": 2})
    assert t.output_token_ids == [7, 1, 2] and t.finish_reason == "length"


def test_drafts_never_preempt():
    sched = make(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    sched.add(a := seq("a", 4, max_tokens=20))
    sched.add(seq("b", 3, max_tokens=20))
    simulate(sched, sched.schedule())  # a holds 2 blocks (5 tokens), b 1 (4 tokens): the pool is full
    a.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert summary(out) == [("a", 1), ("b", 1)] and not out.preempted  # a decodes plainly instead
    assert out.scheduled[0].spec_token_ids == []
