"""What tensor parallelism costs rank 0 per step on this machine: the step, the broadcast of its inputs,
and the forward pass's collectives (all-reduces and the logits gather), timed around each call.

Collective time includes waiting for the slowest rank to arrive, so on a shared CPU it is an upper bound
on the communication itself. Compare ``--tp 1`` (no collectives) for the step time without the split.

    .venv/bin/python scripts/bench_tp_overhead.py --tp 2 --model 'random:qwen3-0.6b?num_layers=4' --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from iterserve import LLM, SamplingParams
from iterserve.distributed import parallel_state
from iterserve.engine import executor


def _timed(owner: Any, name: str, bucket: list[float]) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen3-0.6b?num_layers=4")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=32, help="decode steps per sequence")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    collectives: list[float] = []
    broadcasts: list[float] = []
    _timed(parallel_state.ParallelState, "all_reduce", collectives)
    _timed(parallel_state.ParallelState, "gather_last_dim", collectives)
    _timed(executor.dist, "broadcast_object_list", broadcasts)
    llm = LLM(args.model, tensor_parallel_size=args.tp, dtype=args.dtype, device="cpu", num_kv_blocks=256,
              step_history=10_000)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate([[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(args.batch)], params, use_tqdm=False)  # warm-up
    collectives.clear()
    broadcasts.clear()
    engine.step_history.clear()
    llm.generate([[11 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(args.batch)], params, use_tqdm=False)
    steps = [s for s in engine.step_history if s.num_prefill_tokens == 0]
    n = len(engine.step_history)
    step_ms = statistics.median(s.duration for s in steps) * 1e3
    per_step = len(collectives) / n
    print(f"{args.model}, tp={args.tp}, batch {args.batch}, {args.dtype}: {len(steps)} decode steps")
    print(f"  step (median decode):       {step_ms:.2f} ms")
    if args.tp > 1:
        print(f"  collectives per step:       {per_step:.0f} (all-reduces + 1 gather), "
              f"{sum(collectives) / n * 1e3:.2f} ms, median {statistics.median(collectives) * 1e6:.0f} us each")
        print(f"  input broadcast per step:   {sum(broadcasts) / n * 1e3:.2f} ms")
    engine.close()


if __name__ == "__main__":
    main()
