"""Offline throughput of a batch mixing LoRA adapters against the same batch on the base model alone.

One engine (``enable_lora=True``) runs ``--num-prompts`` requests of ``--input-len`` random prompt tokens and
``--output-len`` generated tokens (ignore_eos) all at once, ``max_num_seqs`` = the number of prompts, in two ways
taken in turn ``--repeats`` times: every request on the base model, then request i under adapter i mod
``--num-adapters``. It prints each run's output tokens/s, the medians and their ratio (mixed / base). The adapters
are seeded-random PEFT adapters of the model (rank ``--rank``, every q/k/v/o/gate/up/down target) made with
``peft`` in ``--adapter-dir`` unless they are there already; the model is a Hugging Face folder (a GGUF becomes
one with scripts/gguf_to_hf.py). A first, untimed pass of each way loads the adapters and warms the kernels.

    .venv/bin/python scripts/bench_lora.py --model /tmp/smollm2-hf --adapter-dir /tmp/smollm2-loras \\
        --num-adapters 4 --num-prompts 32 --input-len 128 --output-len 128 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from iterserve import LLM, SamplingParams
from iterserve.lora import LoRARequest

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, folder: Path, count: int, rank: int) -> list[Path]:
    """``count`` seeded-random PEFT adapters of ``model`` under ``folder`` (kept: made once)."""
    paths = [folder / f"adapter{i}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    if not missing:
        return paths
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for path in missing:
        torch.manual_seed(int(path.name.removeprefix("adapter")))
        lora = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: an adapter that changes nothing
                    p.normal_(0.0, 0.02)
        lora.save_pretrained(path)
        base = lora.unload()
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the base model's Hugging Face folder")
    ap.add_argument("--adapter-dir", required=True, help="where the adapters are (made there when missing)")
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    paths = make_adapters(args.model, Path(args.adapter_dir), args.num_adapters, args.rank)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.rank, max_num_seqs=args.num_prompts)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 10000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ways = {"base": None, "mixed": [loras[i % len(loras)] for i in range(args.num_prompts)]}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats + 1):  # the first pass of each way is a warm-up
        for way, lora_request in ways.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            if repeat:
                rates[way].append(tokens / elapsed)
                print(f"{way:5s} run {repeat}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")
    base, mixed = (statistics.median(rates[way]) for way in ways)
    print(f"median output tok/s: base {base:.1f}, {args.num_adapters} adapters mixed {mixed:.1f}, "
          f"ratio {mixed / base:.3f}")


if __name__ == "__main__":
    main()
