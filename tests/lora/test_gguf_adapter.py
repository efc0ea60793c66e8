"""llama.cpp's GGUF LoRA adapters: a file written as ``convert_lora_to_gguf.py`` writes one (llama.cpp's names,
``adapter.lora.alpha``, a llama's Q and K ``lora_b`` rows interleaved) serves the same tokens as the PEFT folder
it came from, and a file that is no LoRA adapter is refused with its problem named."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from iterserve.config import ModelConfig
from iterserve.lora import LoRARequest
from iterserve.lora.gguf_adapter import read_gguf_adapter
from tests.lora.conftest import ADAPTERS, BASE_SHAPES, base_model
from tests.lora.test_generate import PROMPTS, make_llm, tokens

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a llama's Q/K output rows (its converter applies it to lora_b)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_adapter(path: Path, peft_folder, alpha: float, general_type: str = "adapter",
                       dtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    heads = {"attn_q": BASE_SHAPES["num_attention_heads"], "attn_k": BASE_SHAPES["num_key_value_heads"]}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, t in sorted(load_file(str(Path(peft_folder) / "adapter_model.safetensors")).items()):
        # base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight
        layer, module, side = name.split(".layers.")[1].split(".", 1)[0], name.split(".")[-4:-2], name.split(".")[-2]
        kind = GGUF_NAMES[".".join(module)]
        x = t.float().numpy()
        if side == "lora_B" and kind in heads:
            x = interleave(x, heads[kind])
        x = gguf.quants.quantize(x, dtype) if dtype != gguf.GGMLQuantizationType.F32 else x
        w.add_tensor(f"blk.{layer}.{kind}.weight.lora_{side[-1].lower()}", x, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llm(base_folder):
    return make_llm(base_folder, max_lora_rank=8)


def test_gguf_adapter_gives_the_peft_folders_tokens(llm, adapter_folders, tmp_path):
    args, _ = ADAPTERS["all"]
    path = write_gguf_adapter(tmp_path / "all.gguf", adapter_folders["all"], args["lora_alpha"])
    want = tokens(llm, PROMPTS, LoRARequest("peft", 1, str(adapter_folders["all"])))
    assert want != tokens(llm, PROMPTS)
    assert tokens(llm, PROMPTS, LoRARequest("gguf", 2, str(path))) == want
    llm.engine.block_manager.check_no_leaks()


def test_gguf_adapter_in_f16_reads_the_peft_values_rounded(adapter_folders, tmp_path):
    """llama.cpp's converter writes F16 by default: read back through gguf-py, Q and K rows put back in order."""
    args, _ = ADAPTERS["all"]
    path = write_gguf_adapter(tmp_path / "f16.gguf", adapter_folders["all"], args["lora_alpha"],
                              dtype=gguf.GGMLQuantizationType.F16)
    peft = {name[name.index("layers."):]: t for name, t in
            load_file(str(Path(adapter_folders["all"]) / "adapter_model.safetensors")).items()}
    config = ModelConfig.from_hf_config(base_model().config.to_dict())
    rank, scaling, tensors = read_gguf_adapter(LoRARequest("f16", 3, str(path)), config)
    assert (rank, scaling) == (args["r"], args["lora_alpha"] / args["r"]) and tensors.keys() == peft.keys()
    for name, t in peft.items():
        assert torch.equal(tensors[name], t.half().float()), name


def test_a_gguf_that_is_no_lora_adapter_is_refused(llm, adapter_folders, tmp_path):
    path = write_gguf_adapter(tmp_path / "model.gguf", adapter_folders["all"], 16.0, general_type="model")
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        tokens(llm, PROMPTS[:1], LoRARequest("bad", 4, str(path)))
    with pytest.raises(ValueError, match="does not exist"):
        tokens(llm, PROMPTS[:1], LoRARequest("missing", 5, str(tmp_path / "missing.gguf")))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_no_leaks()
