"""Write a bench workload as JSON lines of prompt token ids and output lengths, so a peer engine
(vLLM's offline ``LLM.generate``, another server) runs exactly the requests iterserve ran.

    .venv/bin/python scripts/workload_jsonl.py OUT.jsonl [--num-prompts 64 --input-len uniform:32:256 ...]
"""

from __future__ import annotations

import argparse
import json

from iterserve.bench.workloads import WorkloadSpec, synthetic_workload
from iterserve.models.loader import load_tokenizer


def main() -> None:
    defaults = WorkloadSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--input-len", default=defaults.input_len)
    parser.add_argument("--output-len", default=defaults.output_len)
    parser.add_argument("--workload-seed", type=int, default=defaults.seed)
    args = parser.parse_args()
    spec = WorkloadSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                        seed=args.workload_seed)
    requests = synthetic_workload(spec, tokenizer=load_tokenizer(args.model))
    with open(args.out, "w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "output_len": r.output_len}) + "\n")
    print(f"{len(requests)} requests, {sum(r.prompt_len for r in requests)} prompt and "
          f"{sum(r.output_len for r in requests)} output tokens -> {args.out}")


if __name__ == "__main__":
    main()
