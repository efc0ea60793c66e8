"""Write the embedded GGUF model as a Hugging Face folder (bf16 safetensors + tokenizer), so peers
that read only Hugging Face folders (vLLM) serve exactly the weights iterserve serves.

    .venv/bin/python scripts/gguf_to_hf.py OUT_DIR [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from iterserve.models.sources import embedded_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="smollm2-135m", help="an embedded model name or a .gguf file")
    args = parser.parse_args()
    gguf = Path(args.model) if args.model.endswith(".gguf") else embedded_model_path(args.model)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # transformers marks a model read from GGUF as quantized and refuses to save it; the weights are
    # already dequantized, so copy them into a plain model of the same config.
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
