"""The ``iterserve`` command: generate, serve, bench, plan and simulate."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from iterserve.cli.flags import HelpFormatter, add_config_args, config_from_args
from iterserve.cli.vllm_flags import add_vllm_serve_args, apply_vllm_serve_args
from iterserve.config import DEFAULT_MODEL, LOG_LEVELS, EngineConfig, ServerConfig
from iterserve.platforms.malloc import tune_allocator


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens this likely")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the likeliest")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="divide the logits of tokens already seen")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per earlier occurrence")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _cmd_generate(args: argparse.Namespace) -> int:
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(config_from_args(EngineConfig, args))
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
    assert m.finished_time is not None and m.ttft is not None  # a finished request has both
    elapsed = m.finished_time - start
    print(
        f"[{len(final.prompt_token_ids)} prompt + {len(c.token_ids)} output tokens, finish={c.finish_reason}, "
        f"TTFT {m.ttft * 1000:.0f} ms, {len(c.token_ids) / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine a command runs; ``serve`` also takes the model as a positional."""
    if not hasattr(args, "model_tag"):
        return config_from_args(EngineConfig, args)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice and differs: {args.model_tag!r} and --model {args.model!r}")
    return config_from_args(EngineConfig, args, model=args.model_tag or args.model or DEFAULT_MODEL)


def _cmd_serve(args: argparse.Namespace) -> int:
    from iterserve.server import run_server

    apply_vllm_serve_args(args)
    return run_server(_engine_config(args), config_from_args(ServerConfig, args))


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun every rank runs the same command: rank 0 runs it (its engine joins the group), the
    others become tensor-parallel workers here. None where this process runs the command itself."""
    from iterserve.distributed.group import torchrun_launch

    launch = torchrun_launch()
    if launch is None or launch.world_size == 1 or not hasattr(args, "tensor_parallel_size"):
        return None
    if args.tensor_parallel_size != launch.world_size:
        raise ValueError(f"torchrun started {launch.world_size} ranks but --tensor-parallel-size is "
                         f"{args.tensor_parallel_size}; give it the launcher's total number of processes")
    if launch.rank == 0:
        return None
    from iterserve.engine.worker import run_worker

    return run_worker(_engine_config(args), launch)


def _cmd_build_kernels(args: argparse.Namespace) -> int:
    from iterserve.kernels import build

    print(f"built {build(verbose=args.verbose).__file__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                        help="least severe log messages shown")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    add_config_args(gen.add_argument_group("engine"), EngineConfig)
    add_sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help=f"the model to serve, as --model takes it (default: {DEFAULT_MODEL})")
    add_config_args(serve.add_argument_group("server"), ServerConfig)
    add_config_args(serve.add_argument_group("engine"), EngineConfig)
    # --model stays for scripts that use it; unset, so that a positional MODEL can be told apart
    add_vllm_serve_args(serve)
    model = next(a for a in serve._actions if a.dest == "model")
    model.default, model.help = None, f"{model.help} (default: {DEFAULT_MODEL})"
    serve.set_defaults(func=_cmd_serve)

    kernels = sub.add_parser("build-kernels", help="compile the C++ CPU kernels for this machine (set-up runs it)")
    kernels.add_argument("--verbose", action="store_true", help="show the compiler's output")
    kernels.set_defaults(func=_cmd_build_kernels)

    from iterserve.cli.plan import add_plan_parser

    add_plan_parser(sub)

    from iterserve.cli.bench import add_bench_parser

    add_bench_parser(sub)

    from iterserve.cli.simulate import add_simulate_parser

    add_simulate_parser(sub)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's help lists each option's default, whoever built its parser."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns bench serve's output
    tune_allocator()  # a launcher setting, for this process and the engine core it starts
    try:
        status = _torchrun_worker(args)
        return args.func(args) if status is None else status
    except (ValueError, FileNotFoundError) as e:
        print(f"iterserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
