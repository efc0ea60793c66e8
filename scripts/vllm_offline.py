"""Run a JSON-lines workload (scripts/workload_jsonl.py) through vLLM's offline ``LLM.generate``
with the same prompt token ids, max_tokens and ignore_eos that ``iterserve bench throughput`` uses,
and print output tokens/s. Runs in vLLM's own environment, so it imports nothing from iterserve.

    VLLM_CPU_KVCACHE_SPACE=1 vllm-venv/bin/python scripts/vllm_offline.py MODEL_DIR WORKLOAD.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("workload")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    with open(args.workload) as f:
        records = [json.loads(line) for line in f if line.strip()]
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_num_seqs)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in records]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in records]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    for run in range(args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"run": run, "elapsed_s": round(elapsed, 3), "output_tokens": out_tokens,
                          "output_tok_s": round(out_tokens / elapsed, 1)}))


if __name__ == "__main__":
    main()
