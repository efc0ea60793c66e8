"""The ``iterserve`` command: generate, serve, bench, plan and simulate."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from iterserve.engine.llm_engine import EngineConfig
from iterserve.models.loader import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that runs the model."""
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded model name, .gguf file, Hugging Face folder, or random:<preset>")
    g.add_argument("--dtype", default=d.dtype,
                   help="auto (bfloat16 where the hardware computes in it, else float32), float32, bfloat16 or float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="KV pool size, e.g. 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--batching", choices=["continuous", "static"], default=d.batching)
    g.add_argument("--kv-allocation", choices=["paged", "reserved"], default=d.kv_allocation)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--step-trace", default=None, help="write a JSON-lines step trace to this file")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks, batching=args.batching,
        kv_allocation=args.kv_allocation, seed=args.seed, step_trace=args.step_trace,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _cmd_generate(args: argparse.Namespace) -> int:
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(engine_config_from_args(args))
    prompt: str | list[int] = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            raise ValueError("--chat needs a model with a tokenizer")
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params, arrival_time=start)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if args.stream:
                print(out.outputs[0].delta_text, end="", flush=True)
            if out.finished and out.request_id == rid:
                final = out
    engine.close()
    assert final is not None
    c, m = final.outputs[0], final.metrics
    print("" if args.stream else c.text)
    elapsed = m.finished_time - start
    print(
        f"[{len(final.prompt_token_ids)} prompt + {len(c.token_ids)} output tokens, finish={c.finish_reason}, "
        f"TTFT {m.ttft * 1000:.0f} ms, {len(c.token_ids) / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from iterserve.server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("ITERSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $ITERSERVE_API_KEY)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests allowed to wait for the batch; more are refused with 429")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    serve.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="request bodies larger than this are refused with 413 (default: 8 MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="seconds running requests may take to finish after SIGTERM before they are ended")
    add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    from iterserve.planner_cli import add_plan_parser

    add_plan_parser(sub)

    from iterserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from iterserve.simulate.cli import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns bench serve's output
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"iterserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
