"""``vllm serve``'s flags that have no field of the same name here, so that a vLLM command line runs
unchanged: each is mapped onto this server's settings and says, in one log line, what it became.
(``--max-model-len``, ``--chat-template`` and ``--served-model-name`` are fields of the engine and server
configs themselves.)"""

from __future__ import annotations

import argparse
import logging

from iterserve.platforms.memory import available_memory_bytes

logger = logging.getLogger("iterserve.cli")


def add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's flags", "accepted as vllm serve takes them; each logs what it maps to")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="size the KV cache as this fraction of the memory available when the server starts "
                        "(sets --kv-cache-memory)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=argparse.SUPPRESS, help="vLLM's name of --prefix-caching / --no-prefix-caching")
    g.add_argument("--disable-hybrid-kv-cache-manager", dest="hybrid_swa_memory", action="store_false",
                   default=argparse.SUPPRESS, help="vLLM's name of --no-hybrid-swa-memory")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="always on here: tool_choice='auto' parses the model's <tool_call> blocks")
    g.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                   help="the parser of tool_choice='auto' (Hermes <tool_call> blocks, the only one)")


def apply_vllm_serve_args(args: argparse.Namespace) -> None:
    """Rewrite vLLM's flags into this server's settings on ``args``; ValueError for a value out of range."""
    fraction = args.gpu_memory_utilization
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
        available = available_memory_bytes()
        args.kv_cache_memory = int(fraction * available)
        logger.info("--gpu-memory-utilization %g: the KV cache gets %.2f GiB (%g of the %.2f GiB available now; "
                    "the weights come on top)", fraction, args.kv_cache_memory / 2**30, fraction, available / 2**30)
    if args.enable_auto_tool_choice or args.tool_call_parser:
        logger.info("--enable-auto-tool-choice / --tool-call-parser hermes: tool_choice='auto' always parses "
                    "Hermes <tool_call> blocks here")
