"""A seeded-random Llama too big for the last-level cache, written as GGUF F16 with the ``gguf`` package: the
model for weight-format speed figures that must stream from DRAM (quantize it with llama.cpp's own
``llama-quantize``). The tokenizer and chat template are the embedded SmolLM2's, so every client and server
that reads SmolLM2 token ids reads this file too; the text it writes is noise.

    .venv/bin/python scripts/make_random_gguf.py /tmp/llama-1b-f16.gguf            # Llama-3.2-1B's shapes
    .venv/bin/python scripts/make_random_gguf.py OUT.gguf --hidden 3072 --layers 28 --ffn 8192
    .venv/bin/python scripts/make_random_gguf.py OUT.gguf --experts 8 --experts-used 2   # Mixtral-style MoE

With ``--experts`` every layer's MLP is a mixture of experts of ``--ffn`` each, as llama.cpp writes Mixtral (a
``llama`` with ``ffn_gate_inp`` and 3-D ``ffn_{gate,up,down}_exps``).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from iterserve.models.sources import embedded_model_path


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Every ``tokenizer.*`` field of ``reader`` into ``writer``; the vocabulary's size."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=0, help="experts per layer (0: dense MLPs)")
    ap.add_argument("--experts-used", type=int, default=2, help="experts each token runs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reader = gguf.GGUFReader(embedded_model_path())
    w = gguf.GGUFWriter(args.out, "llama")
    vocab = copy_tokenizer(reader, w)
    w.add_name(f"random llama {args.hidden}x{args.layers} (seed {args.seed})")
    w.add_vocab_size(vocab)
    for add, value in [(w.add_embedding_length, args.hidden), (w.add_feed_forward_length, args.ffn),
                       (w.add_block_count, args.layers), (w.add_head_count, args.heads),
                       (w.add_head_count_kv, args.kv_heads), (w.add_context_length, 8192),
                       (w.add_rope_dimension_count, args.hidden // args.heads)]:
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if args.experts:
        w.add_expert_count(args.experts)
        w.add_expert_used_count(args.experts_used)
    rng = np.random.default_rng(args.seed)

    def weight(*shape: int) -> np.ndarray:  # std 1/sqrt(inputs): activations keep their scale layer to layer
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float16)

    e = args.experts
    mlp = [("ffn_gate", (args.ffn, args.hidden)), ("ffn_up", (args.ffn, args.hidden)),
           ("ffn_down", (args.hidden, args.ffn))]
    if e:
        mlp = [("ffn_gate_inp", (e, args.hidden))] + [(f"{name}_exps", (e, *shape)) for name, shape in mlp]

    kv = args.hidden // args.heads * args.kv_heads
    w.add_tensor("token_embd.weight", weight(vocab, args.hidden))  # tied: the head reads the embedding
    w.add_tensor("output_norm.weight", np.ones(args.hidden, np.float32))
    for i in range(args.layers):
        for name, shape in [("attn_q", (args.hidden, args.hidden)), ("attn_k", (kv, args.hidden)),
                            ("attn_v", (kv, args.hidden)), ("attn_output", (args.hidden, args.hidden)), *mlp]:
            tensor = weight(*shape)
            # the router in float32, as llama.cpp keeps it; scaled up so tokens spread over the experts
            w.add_tensor(f"blk.{i}.{name}.weight", tensor.astype(np.float32) * 8 if name == "ffn_gate_inp" else tensor)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(args.hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


if __name__ == "__main__":
    main()
