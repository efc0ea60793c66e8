"""KV-cache events in vLLM's wire format: the block manager's stores and evictions, the publisher's frames,
replay and drops, and an engine core's events checked against its prefix cache."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from iterserve.config import EngineConfig, KVEventsConfig
from iterserve.engine.block_manager import BlockManager, chain_hash
from iterserve.engine.core import FAULT_TOKEN_ENV, EngineCore
from iterserve.engine.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    external_hash,
    start_publisher,
)
from iterserve.engine.messages import EngineCoreRequest
from iterserve.llm import LLM
from iterserve.models.loader import load_model
from iterserve.sampling_params import SamplingParams
from tests.engine import kv_event_schema as vllm
from tests.engine.test_block_manager import admit, seq

BS = 4
FAULT_TOKEN = 4242


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_stores_are_chained_blocks_with_their_tokens_and_parent():
    bm = BlockManager(4, BS)
    bm.record_events()
    a = seq(range(10))  # two full blocks and a partial one
    admit(bm, a)
    (stored,) = bm.take_events()
    h0 = chain_hash(None, (0, 1, 2, 3))
    h1 = chain_hash(h0, (4, 5, 6, 7))
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_hash(h0), external_hash(h1)] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == BS and stored.medium == "GPU"
    assert bm.take_events() == []
    b = seq([*range(8), 50, 51, 52, 53, 54], rid="b")  # shares a's two blocks, fills one more
    bm.free(a)
    admit(bm, b)
    (more,) = bm.take_events()
    assert more.parent_block_hash == external_hash(h1) and more.token_ids == [50, 51, 52, 53]
    assert all(0 <= h < 2**64 for h in [*stored.block_hashes, *more.block_hashes])


def test_evictions_name_the_hashes_that_were_stored():
    bm = BlockManager(3, BS)
    bm.record_events()
    a = seq(range(8))
    admit(bm, a)
    bm.free(a)
    stored = bm.take_events()[0].block_hashes
    b = seq(range(100, 112), rid="b")  # three fresh blocks: both of a's cached blocks are evicted
    admit(bm, b)
    removed, new = bm.take_events()
    assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == sorted(stored)
    assert isinstance(new, BlockStored) and len(new.block_hashes) == 3 and new.parent_block_hash is None


def test_nothing_is_recorded_unless_asked():
    bm = BlockManager(4, BS)
    admit(bm, seq(range(10)))
    assert bm.events is None and bm.take_events() == []


def test_frames_are_vllms_topic_sequence_and_msgpack_batch(ctx):
    sub, endpoint = vllm.subscriber(ctx, b"kv")
    publisher = start_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv",
                                               data_parallel_rank=2))
    assert publisher is not None
    try:
        vllm.wait_subscribed(publisher, sub)
        stored = BlockStored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                             block_size=4, lora_id=None, medium="GPU", lora_name=None)
        publisher.publish([stored])
        publisher.publish([BlockRemoved(block_hashes=[7], medium="GPU")])
        first, second = vllm.receive(sub), vllm.receive(sub)
    finally:
        publisher.shutdown()
    assert first is not None and second is not None
    (topic, seq0, batch), (_, seq1, batch1) = first, second
    assert topic == b"kv" and seq1 == seq0 + 1 and batch.data_parallel_rank == 2
    (event,) = batch.events
    assert isinstance(event, vllm.BlockStored) and event.block_hashes == [2**64 - 1, 7]
    assert event.token_ids == list(range(1, 9)) and event.block_size == 4 and event.parent_block_hash is None
    assert isinstance(batch1.events[0], vllm.BlockRemoved) and batch1.events[0].block_hashes == [7]


# The fields vllm-router 0.1.17 requires and allows in each event (src/kv_index/decode.rs, decode_event)
ROUTER_REQUIRED = {"BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "lora_name"},
                   "BlockRemoved": {"block_hashes", "medium"}}
ROUTER_OPTIONAL = {"type", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                   "locality", "ownership", "session_id"}


def test_events_are_maps_tagged_with_their_type_as_vllm_router_decodes_them(ctx):
    sub, endpoint = vllm.subscriber(ctx)
    publisher = start_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    assert publisher is not None
    try:
        vllm.wait_subscribed(publisher, sub)
        publisher.publish([BlockStored(block_hashes=[5, 6], parent_block_hash=4, token_ids=list(range(8)),
                                       block_size=4, lora_id=None, medium="GPU", lora_name=None),
                           BlockRemoved(block_hashes=[5], medium="GPU")])
        assert sub.poll(5000)
        topic, _, payload = sub.recv_multipart()
    finally:
        publisher.shutdown()
    ts, events, rank = msgspec.msgpack.decode(payload)  # untyped: the shapes on the wire
    assert topic == b"" and isinstance(ts, float) and rank == 0
    stored, removed = events
    assert isinstance(stored, dict) and stored["type"] == "BlockStored" and removed["type"] == "BlockRemoved"
    for event in (stored, removed):
        required = ROUTER_REQUIRED[event["type"]]
        assert required <= event.keys() <= required | ROUTER_OPTIONAL
    assert stored["block_hashes"] == [5, 6] and stored["parent_block_hash"] == 4
    assert len(stored["token_ids"]) == len(stored["block_hashes"]) * stored["block_size"]


def test_replay_resends_buffered_batches_then_the_end_marker(ctx):
    sub, endpoint = vllm.subscriber(ctx)
    replay = f"tcp://127.0.0.1:{vllm.free_port()}"
    publisher = start_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay))
    assert publisher is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        for i in range(3):
            publisher.publish([BlockRemoved(block_hashes=[i], medium="GPU")])
        deadline = time.monotonic() + 5
        while len(publisher._buffer) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = [dealer.recv_multipart() for _ in range(3) if dealer.poll(5000)]
    finally:
        publisher.shutdown()
    assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [1, 2, -1]
    assert vllm.DECODER.decode(frames[0][2]).events[0].block_hashes == [1] and frames[2][2] == b""


def test_a_full_queue_drops_and_counts_without_waiting():
    sub_ctx = zmq.Context()
    try:
        _, endpoint = vllm.subscriber(sub_ctx)
        publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                                                     max_queue_size=1))  # not started: nothing drains
        event = BlockRemoved(block_hashes=[1, 2], medium="GPU")
        start = time.perf_counter()
        for _ in range(4):
            publisher.publish([event])
        assert time.perf_counter() - start < 0.5
        assert publisher.dropped == 3  # three batches of one event did not fit
        publisher.shutdown()
    finally:
        sub_ctx.destroy(linger=0)


def test_an_endpoint_in_use_is_a_start_up_error_naming_it(ctx):
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    with pytest.raises(ValueError, match=f"cannot use endpoint '{endpoint}'.*in use"):
        start_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-test",
                                       replay_endpoint=endpoint))
    taken.close(linger=0)


def test_disabled_or_null_publishes_nothing():
    assert start_publisher(None) is None
    assert start_publisher(KVEventsConfig()) is None
    assert start_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null")) is None


@pytest.fixture(scope="module")
def tiny_loaded():
    return load_model("random:smollm2-135m?num_layers=2", dtype="float32", device="cpu", seed=0)


def run(core: EngineCore, rid: str, prompt: list[int]) -> None:
    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), 0.0))
    while core.has_unfinished_requests():
        core.step()


def test_an_engines_events_match_its_prefix_cache(tiny_loaded, ctx):
    sub, endpoint = vllm.subscriber(ctx)
    events = {"enable_kv_cache_events": True, "endpoint": endpoint}
    core = EngineCore(EngineConfig(num_kv_blocks=12, block_size=BS, max_model_len=48, kv_events_config=events),
                      tiny_loaded)
    try:
        vllm.wait_subscribed(core.kv_events, sub)
        run(core, "a", list(range(1, 22)))  # 21 prompt tokens + 2 generated: five full blocks
        cached = {external_hash(h): block for h, block in core.block_manager.cached.items()}
        stored: list[vllm.BlockStored] = []
        while len(stored) < 1 and (message := vllm.receive(sub)) is not None:
            stored += [e for e in message[2].events if isinstance(e, vllm.BlockStored)]
        hashes = [h for e in stored for h in e.block_hashes]
        assert set(hashes) == set(cached) and len(hashes) == 5
        parent = None
        for event in stored:  # each event continues the chain of the one before
            assert event.parent_block_hash == parent and event.block_size == BS
            for i, h in enumerate(event.block_hashes):
                block = cached[h]
                assert event.token_ids[i * BS:(i + 1) * BS] == list(block.token_ids)
                assert (None if block.parent_hash is None else external_hash(block.parent_hash)) == \
                    (parent if i == 0 else event.block_hashes[i - 1])
            parent = event.block_hashes[-1]
        run(core, "b", list(range(100, 140)))  # 40 tokens need 10 of 12 blocks: a's cached blocks are evicted
        removed = []
        while (message := vllm.receive(sub, 2000)) is not None:
            removed += [h for e in message[2].events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes]
        assert removed and set(removed) <= set(hashes)
        assert core.stats().kv_events_dropped == 0
    finally:
        core.close()


# -- announced when scheduled: a router learns a prefix while its prefill runs ------------------------------


def test_blocks_are_announced_before_they_are_computed_and_hit_only_once_committed():
    bm = BlockManager(8, BS)
    bm.record_events()
    a, twin = seq(range(10)), seq(range(10), rid="twin")
    assert bm.allocate(a, 10)
    bm.announce(a, 10)  # scheduled: its two full blocks are announced now
    (stored,) = bm.take_events()
    h0 = chain_hash(None, (0, 1, 2, 3))
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [external_hash(h0), external_hash(chain_hash(h0, (4, 5, 6, 7)))]
    assert bm.find_cached_prefix(twin) == []  # not computed yet: nobody may read it
    a.num_computed_tokens = 10
    bm.commit(a)
    assert bm.take_events() == [] and not bm.announced  # committing announces nothing twice
    assert len(bm.find_cached_prefix(twin)) == 2


def test_an_announced_block_never_computed_is_withdrawn_when_its_sequence_leaves():
    bm = BlockManager(8, BS)
    bm.record_events()
    a = seq(range(10))
    assert bm.allocate(a, 10)
    bm.announce(a, 10)
    (stored,) = bm.take_events()
    bm.free(a)  # aborted, preempted or failed before its step committed
    (removed,) = bm.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes
    assert not bm.announced and not bm.cached
    bm.check_no_leaks()


def test_a_block_two_sequences_fill_in_one_step_is_announced_once_and_survives_either_leaving():
    bm = BlockManager(8, BS)
    bm.record_events()
    a, b = seq(range(6)), seq([*range(4), 9, 9], rid="b")  # the same first block
    for s in (a, b):
        assert bm.allocate(s, 6)
        bm.announce(s, 6)
    (stored,) = bm.take_events()
    assert len(stored.block_hashes) == 1
    b.num_computed_tokens = 6
    bm.commit(b)  # b caches the block a announced
    bm.free(a)  # a leaves without computing: the block is cached all the same, so nothing is withdrawn
    assert bm.take_events() == [] and list(bm.cached) == [chain_hash(None, (0, 1, 2, 3))]


class Recorder:
    """A publisher that keeps each batch as a vLLM consumer decodes it, and what the pool held when it came."""

    dropped = 0

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.index: set[int] = set()  # a router's view: the block hashes this engine holds
        self.ever_announced: set[int] = set()

    def publish(self, events: list) -> None:
        batch = vllm.DECODER.decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events)))
        for event in batch.events:
            if isinstance(event, vllm.BlockStored):
                self.index.update(event.block_hashes)
                self.ever_announced.update(event.block_hashes)
            elif isinstance(event, vllm.BlockRemoved):
                self.index.difference_update(event.block_hashes)
            else:
                self.index.clear()
        held = {external_hash(h) for h in [*self.bm.cached, *self.bm.announced]}
        assert self.index == held  # the router's view is the cache plus the blocks being computed

    def shutdown(self) -> None:
        pass


def recording_core(tiny_loaded, monkeypatch, num_blocks: int = 12) -> tuple[EngineCore, Recorder]:
    monkeypatch.setenv(FAULT_TOKEN_ENV, str(FAULT_TOKEN))
    core = EngineCore(EngineConfig(num_kv_blocks=num_blocks, block_size=BS, max_model_len=48, max_num_seqs=4),
                      tiny_loaded)
    core.block_manager.record_events()
    recorder = Recorder(core.block_manager)
    core.kv_events = recorder  # type: ignore[assignment]
    return core, recorder


def cached_hashes(core: EngineCore) -> set[int]:
    return {external_hash(h) for h in core.block_manager.cached}


def test_the_event_stream_matches_the_cache_through_preemption_aborts_and_a_failed_step(tiny_loaded, monkeypatch):
    core, recorder = recording_core(tiny_loaded, monkeypatch)
    forward = core.executor.execute_model
    seen_in_forward: list[set[int]] = []

    def execute_model(scheduled, copies, window_copies):
        seen_in_forward.append(set(recorder.index))  # published before the forward pass
        assert {external_hash(h) for h in core.block_manager.announced} <= recorder.index
        return forward(scheduled, copies, window_copies)

    core.executor.execute_model = execute_model  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i in range(4):  # 4 x (18 + 10) tokens need 28 blocks of 12: sequences are preempted
        core.add_request(EngineCoreRequest(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, *range(20 + 10 * i, 30 + 10 * i)],
                                           params, 0.0))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        assert recorder.index == cached_hashes(core) and not core.block_manager.announced
        if steps == 3:
            core.abort_request("r1")
    assert core.num_preemptions > 0 and any(seen_in_forward)
    core.add_request(EngineCoreRequest("poisoned", [*range(60, 68), FAULT_TOKEN], params, 0.0))
    core.step()  # announced two blocks, then failed: they are withdrawn
    assert {external_hash(chain_hash(None, (60, 61, 62, 63)))} <= recorder.ever_announced
    assert recorder.index == cached_hashes(core) and not core.has_unfinished_requests()
    assert external_hash(chain_hash(None, (60, 61, 62, 63))) not in recorder.index
    core.block_manager.check_no_leaks()
    core.close()


def test_a_prefix_is_not_hit_in_the_step_that_computes_it(tiny_loaded, monkeypatch):
    core, recorder = recording_core(tiny_loaded, monkeypatch)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid in ("a", "b"):  # the same prompt, scheduled in one step
        core.add_request(EngineCoreRequest(rid, list(range(1, 14)), params, 0.0))
    core.step()
    assert core.prefix_hit_tokens == 0 and len(recorder.index) == 3  # announced once, computed twice
    while core.has_unfinished_requests():
        core.step()
    core.add_request(EngineCoreRequest("c", list(range(1, 14)), params, 0.0))
    core.step()
    assert core.prefix_hit_tokens == 12
    core.close()


# -- reset_prefix_cache: AllBlocksCleared ----------------------------------------------------------------


def test_a_reset_empties_the_cache_keeps_held_blocks_and_records_all_blocks_cleared():
    bm = BlockManager(8, BS)
    bm.record_events()
    done, running = seq(range(9)), seq(range(100, 109), rid="running")
    admit(bm, done)
    admit(bm, running)
    bm.free(done)
    bm.take_events()
    held = list(running.block_table)
    bm.reset_prefix_cache()
    assert [type(e).__name__ for e in bm.take_events()] == ["AllBlocksCleared"]
    assert not bm.cached and all(b.hash is None for b in bm.blocks)
    assert running.block_table == held and all(bm.blocks[i].ref_count == 1 for i in held)
    assert bm.find_cached_prefix(seq(range(9), rid="again")) == []
    bm.free(running)
    bm.check_no_leaks()
    assert admit(bm, seq(range(100, 109), rid="after")) == 0  # the running one's blocks were not cached again


def test_a_reset_between_steps_reaches_subscribers_and_the_next_identical_request_hits_nothing(tiny_loaded,
                                                                                              monkeypatch):
    core, recorder = recording_core(tiny_loaded, monkeypatch)
    prompt = list(range(1, 14))
    run(core, "a", prompt)
    run(core, "b", prompt)
    assert core.prefix_hit_tokens == 12 and recorder.index
    core.reset_prefix_cache()  # idle: published at once, no step needed
    assert recorder.index == set() and not core.block_manager.cached
    run(core, "c", prompt)
    assert core.prefix_hit_tokens == 12  # c computed its prompt in full
    assert recorder.index == cached_hashes(core) and len(recorder.index) == 3
    core.block_manager.check_no_leaks()
    core.close()


def test_llm_reset_prefix_cache_makes_the_next_identical_prompt_compute_in_full(tiny_loaded):
    llm = LLM(loaded=tiny_loaded, num_kv_blocks=12, block_size=BS, max_model_len=48)
    prompt = {"prompt_token_ids": list(range(1, 14))}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 12
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    llm.llm_engine.block_manager.check_no_leaks()
