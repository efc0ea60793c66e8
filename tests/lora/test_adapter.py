"""Adapters that cannot run are refused when their request is added, with an error naming the problem, and
leave nothing behind: no request queued, no block held, the engine serving the next request as before."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from iterserve.lora import LoRARequest
from iterserve.lora.adapter import TENSOR_NAME
from tests.lora.conftest import ADAPTERS, base_model, save_adapter
from tests.lora.test_generate import PROMPTS, make_llm, tokens


@pytest.fixture(scope="module")
def llm(base_folder):
    return make_llm(base_folder, max_lora_rank=8)


def copy(adapter_folders, tmp_path, name: str = "all"):
    folder = tmp_path / f"copy{len(list(tmp_path.iterdir()))}_{name}"
    shutil.copytree(adapter_folders[name], folder)
    return folder


def rewrite_tensors(folder, change) -> None:
    path = folder / "adapter_model.safetensors"
    save_file(change(load_file(str(path))), str(path))


def refused(llm, folder, match: str, lora_id: int = 7) -> None:
    with pytest.raises(ValueError, match=match):
        tokens(llm, PROMPTS[:2], LoRARequest("bad", lora_id, str(folder)))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.block_manager.check_no_leaks()


def test_missing_folder_and_files(llm, adapter_folders, tmp_path):
    refused(llm, tmp_path / "nowhere", "adapter folder does not exist")
    refused(llm, tmp_path, "no adapter_config.json")
    folder = copy(adapter_folders, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    refused(llm, folder, "no adapter_model.safetensors")
    with pytest.raises(ValueError, match="no lora_path"):
        tokens(llm, PROMPTS[:1], LoRARequest("pathless", 8))


def test_malformed_files(llm, adapter_folders, tmp_path):
    folder = copy(adapter_folders, tmp_path)
    (folder / "adapter_config.json").write_text("{not json")
    refused(llm, folder, "cannot read adapter_config.json")
    (folder / "adapter_config.json").write_text(json.dumps({"lora_alpha": 16}))
    refused(llm, folder, "no rank 'r'")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    refused(llm, folder, "unsupported adapter options: use_dora")
    folder = copy(adapter_folders, tmp_path, "some")
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    refused(llm, folder, "cannot read adapter_model.safetensors")


def test_rank_above_max_lora_rank(base_folder, adapter_folders):
    small = make_llm(base_folder, max_lora_rank=4)
    refused(small, adapter_folders["all"], "rank 8 is above max_lora_rank=4")
    assert tokens(small, PROMPTS[:1], LoRARequest("some", 2, str(adapter_folders["some"])))  # rank 4 fits


def test_module_the_model_does_not_have(llm, adapter_folders, tmp_path):
    folder = copy(adapter_folders, tmp_path)
    rewrite_tensors(folder, lambda t: {k.replace("mlp.up_proj", "mlp.fc1"): v for k, v in t.items()})
    refused(llm, folder, "'fc1'.*does not have")
    folder = copy(adapter_folders, tmp_path, "some")
    rewrite_tensors(folder, lambda t: {k.replace("layers.1.", "layers.5."): v for k, v in t.items()})
    refused(llm, folder, "layer 5; the model has 2 layers")
    folder = copy(adapter_folders, tmp_path, "some")
    rewrite_tensors(folder, lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k})
    refused(llm, folder, "lora_A or lora_B alone")


def test_adapter_of_another_base_model(llm, tmp_path):
    folder = tmp_path / "wider"
    args, seed = ADAPTERS["all"]
    save_adapter(folder, base_model(intermediate_size=128), args, seed)
    refused(llm, folder, r"layers.0.mlp.down_proj.lora_A has shape \(8, 128\), expected \(8, 96\).*another base model")


def test_one_id_one_adapter(llm, adapter_folders):
    assert tokens(llm, PROMPTS[:1], LoRARequest("all", 1, str(adapter_folders["all"])))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'all'"):
        tokens(llm, PROMPTS[:1], LoRARequest("some", 1, str(adapter_folders["some"])))
    llm.engine.block_manager.check_no_leaks()


def test_lora_request_fields():
    r = LoRARequest("name", 3, "/p")
    assert (r.lora_name, r.lora_int_id, r.lora_path, r.adapter_id) == ("name", 3, "/p", 3)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("name", 0, "/p")


def test_peft_tensor_names():
    m = TENSOR_NAME.search("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight")
    assert m is not None and m.groups() == ("12", "q_proj", "A")
    assert TENSOR_NAME.search("base_model.model.lm_head.lora_A.weight") is None
