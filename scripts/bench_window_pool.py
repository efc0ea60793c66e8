"""What hybrid SWA memory buys: the same KV memory, a model with sliding-window layers, long requests, the
sliding-window layers' blocks in one pool with the full layers' (``--no-hybrid-swa-memory``) or in a pool of
their own that lets go of what falls out of the window, at one or more ``swa_full_tokens_ratio`` values. For
each: the tokens the full layers' pool holds, the most sequences that ran at once, preemptions, and output
tokens/s.

``--arch gemma3`` (the default) is a seeded random Gemma 3 written by transformers with Gemma 3 1B's attention
(26 layers, a 512-token window on five of every six, one KV head of 256) and a narrow residual stream, so that
the KV cache is the real model's and the steps are short. ``--arch phi3`` has Phi-3-mini-4k's window on every
layer (2,047 tokens of a 4,096-token context) in 8 layers of 4 KV heads of 64 (8 KiB a token in bf16): there
the window pool is the only one holding K/V, and the ratio does not apply.

    .venv/bin/python scripts/bench_window_pool.py --kv-cache-memory 160MiB --ratios 0.8,0.3
    .venv/bin/python scripts/bench_window_pool.py --arch phi3 --kv-cache-memory 48MiB --input-len 3072 \
        --output-len 256 --num-prompts 8
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
import transformers

from iterserve import LLM, SamplingParams


def gemma3_folder(folder: str, hidden: int) -> None:
    config = transformers.Gemma3TextConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, max_position_embeddings=8192,
        query_pre_attn_scalar=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)


def phi3_folder(folder: str, hidden: int) -> None:
    config = transformers.Phi3Config(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
        num_attention_heads=hidden // 64, num_key_value_heads=4, sliding_window=2047, max_position_embeddings=4096,
        rope_scaling=None, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(folder)


def run(folder: str, prompts: list[list[int]], args: argparse.Namespace, **settings: object) -> str:
    llm = LLM(model=folder, dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_model_len=args.input_len + args.output_len, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    core = llm.engine.core
    core.peak_running = core.num_preemptions = 0
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    c = core.capacity
    full = c.total_tokens if c.kv_bytes_per_token else "-"  # every layer windowed: no full layers
    return (f"{full:>11} {c.window_blocks * c.block_size:>12} {core.peak_running:>9} "
            f"{core.num_preemptions:>11} {tokens / seconds:>10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("gemma3", "phi3"), default="gemma3")
    ap.add_argument("--kv-cache-memory", default="160MiB")
    ap.add_argument("--ratios", default="0.8,0.3", help="swa_full_tokens_ratio values to run the window pool at")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=1536)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4096) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as folder:
        (gemma3_folder if args.arch == "gemma3" else phi3_folder)(folder, args.hidden)
        print(f"{args.arch}: {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, "
              f"kv_cache_memory={args.kv_cache_memory}, max_num_seqs={args.max_num_seqs}, {args.dtype}")
        print(f"{'KV pools':<22} {'full tokens':>11} {'window tokens':>12} {'peak seqs':>9} "
              f"{'preemptions':>11} {'output t/s':>10}")
        print(f"{'one pool':<22} {run(folder, prompts, args, hybrid_swa_memory=False)}")
        if args.arch == "phi3":
            print(f"{'window pool':<22} {run(folder, prompts, args)}")
            return
        for ratio in args.ratios.split(","):
            row = run(folder, prompts, args, swa_full_tokens_ratio=float(ratio))
            print(f"{'window pool, ratio ' + ratio:<22} {row}")


if __name__ == "__main__":
    main()
