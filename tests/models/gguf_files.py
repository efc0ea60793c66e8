"""Small GGUF files written by tests: the keys every llama.cpp conversion writes from a transformers config."""

from __future__ import annotations

from typing import Any

import gguf


def write_shape(w: gguf.GGUFWriter, cfg: Any) -> None:
    """The model's shape as llama.cpp's converter writes it from ``cfg`` (a transformers config)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def finish(w: gguf.GGUFWriter) -> None:
    """Write the header, the keys and the tensors added, and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
