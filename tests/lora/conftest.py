"""A tiny seeded Llama saved by transformers, and two seeded-random PEFT adapters of it (different targets,
ranks and scalings; lora_B drawn at random, since PEFT starts it at zero)."""

from __future__ import annotations

import pytest
import torch
import transformers

VOCAB = 320
BASE_SHAPES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 128, "bos_token_id": 1,
               "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.15}
ADAPTERS = {  # name -> (LoraConfig arguments, seed)
    "all": ({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]}, 1),
    "some": ({"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]}, 2),
}


def base_model(**changes) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE_SHAPES, **changes})).eval()


def save_adapter(folder, base: transformers.PreTrainedModel, lora_args: dict, seed: int) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_args))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)


def make_base_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    base_model().save_pretrained(folder)
    return folder


def make_adapter_folders(tmp_path_factory) -> dict[str, object]:
    folders = {}
    for name, (args, seed) in ADAPTERS.items():
        folder = tmp_path_factory.mktemp(f"lora_{name}")
        save_adapter(folder, base_model(), args, seed)
        folders[name] = folder
    return folders


@pytest.fixture(scope="session")
def base_folder(tmp_path_factory):
    return make_base_folder(tmp_path_factory)


@pytest.fixture(scope="session")
def adapter_folders(tmp_path_factory) -> dict[str, object]:
    return make_adapter_folders(tmp_path_factory)


def merged_model(adapter_folder) -> transformers.PreTrainedModel:
    """The base with the adapter merged into its weights by PEFT: the reference."""
    peft = pytest.importorskip("peft")
    return peft.PeftModel.from_pretrained(base_model(), str(adapter_folder)).merge_and_unload().eval()


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out
