"""Multi-LoRA end to end through ``LLM``: float32 greedy tokens under each adapter equal transformers' with the
adapter merged, a batch mixing the base model and both adapters gives every request its tokens alone, and the
prefix cache never serves one adapter's blocks to another."""

from __future__ import annotations

import pytest

from iterserve import LLM, SamplingParams
from iterserve.lora import LoRARequest
from tests.lora.conftest import base_model, hf_greedy, merged_model

NEW_TOKENS = 10
PROMPTS = [[5 + (i * 37 + j * 11) % 300 for j in range(n)] for i, n in enumerate((13, 6, 21))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)


def make_llm(base_folder, **kwargs) -> LLM:
    options = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4, "enable_lora": True,
               "max_loras": 2, "max_lora_rank": 8, **kwargs}
    return LLM(model=str(base_folder), **options)


def lora(adapter_folders, name: str) -> LoRARequest:
    return LoRARequest(name, {"all": 1, "some": 2}[name], str(adapter_folders[name]))


def tokens(llm: LLM, prompts: list[list[int]], lora_request=None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False,
                        lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def references(adapter_folders) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: hf_greedy(base_model(), PROMPTS, NEW_TOKENS)}
    for name, folder in adapter_folders.items():
        refs[name] = hf_greedy(merged_model(folder), PROMPTS, NEW_TOKENS)
    return refs


def test_each_adapter_equals_transformers_with_it_merged(base_folder, adapter_folders, references):
    llm = make_llm(base_folder)
    for name in adapter_folders:
        assert references[name] != references[None]  # the adapter changes the tokens
        assert tokens(llm, PROMPTS, lora(adapter_folders, name)) == references[name]
    assert tokens(llm, PROMPTS) == references[None]
    llm.engine.block_manager.check_no_leaks()


def test_mixed_batch_gives_each_request_its_tokens_alone(base_folder, adapter_folders, references):
    llm = make_llm(base_folder, max_num_batched_tokens=16, step_history=100)  # chunks and decodes mix
    names = [None, "all", "some", "some", None, "all"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    loras = [None if n is None else lora(adapter_folders, n) for n in names]
    assert tokens(llm, prompts, loras) == [references[n][i % 3] for i, n in enumerate(names)]
    assert {None, "all", "some"} in step_adapters(llm, names)


def step_adapters(llm: LLM, names: list[str | None]) -> list[set[str | None]]:
    """The adapters of each step's rows (request i of a fresh engine has id str(i))."""
    return [{names[int(row.request_id)] for row in step.seqs} for step in llm.engine.step_history]


def test_max_loras_bounds_the_adapters_of_a_step(base_folder, adapter_folders, references):
    """With one adapter slot the two adapters' requests never share a step, and an adapter evicted from the
    LRU is loaded again when it comes back."""
    llm = make_llm(base_folder, max_loras=1, step_history=100)
    names = ["all", "some", None, "all"]
    loras = [None if n is None else lora(adapter_folders, n) for n in names]
    assert tokens(llm, PROMPTS[:2] * 2, loras) == [references[n][i % 2] for i, n in enumerate(names)]
    assert all(not {"all", "some"} <= adapters for adapters in step_adapters(llm, names))
    runner = llm.engine.core.executor.worker.runner
    assert runner.lora is not None and len(runner.lora.loaded) == 1


def test_prefix_cache_is_per_adapter(base_folder, adapter_folders):
    llm = make_llm(base_folder)
    prompt = [PROMPTS[2]]
    tokens(llm, prompt, lora(adapter_folders, "all"))
    hits = llm.engine.prefix_hit_tokens
    tokens(llm, prompt, lora(adapter_folders, "some"))  # another adapter: no hit
    assert llm.engine.prefix_hit_tokens == hits
    tokens(llm, prompt)  # the base model: no hit
    assert llm.engine.prefix_hit_tokens == hits
    tokens(llm, prompt, lora(adapter_folders, "some"))  # the same adapter again: its blocks are hit
    assert llm.engine.prefix_hit_tokens > hits
    llm.engine.block_manager.check_no_leaks()


def test_lora_request_needs_enable_lora(base_folder, adapter_folders):
    llm = LLM(model=str(base_folder), dtype="float32", device="cpu", num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        tokens(llm, PROMPTS[:1], lora(adapter_folders, "all"))
    assert not llm.engine.has_unfinished_requests()


def test_one_lora_request_per_prompt(base_folder, adapter_folders):
    llm = make_llm(base_folder)
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        tokens(llm, PROMPTS, [None, lora(adapter_folders, "all")])
