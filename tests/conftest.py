"""Shared fixtures: the embedded SmolLM2-135M loaded once, and transformers' reference for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Count from one to ten in French, separated by commas, then say which "
                                 "number is the largest and why that is so."}],
]
NUM_REFERENCE_TOKENS = 24
MODEL_FIXTURES = {"smollm", "hf_smollm", "chat_prompt_ids", "hf_greedy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what a test needs, so a run can pick: ``server`` for tests/server, ``model`` for tests that
    load the real SmolLM2-135M (through the fixtures below, or a server serving it)."""
    server_dir = Path(__file__).parent / "server"
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        in_server = server_dir in Path(str(item.path)).parents
        if in_server:
            item.add_marker(pytest.mark.server)
        if fixtures & MODEL_FIXTURES or (in_server and "server" in fixtures):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def smollm():
    """Our loader's SmolLM2-135M in float32 (shared; engines reuse its weights)."""
    from iterserve.models.loader import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' own reading of the same GGUF: the reference model and tokenizer."""
    import transformers

    from iterserve.models.sources import embedded_model_path

    path = embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="session")
def chat_prompt_ids(hf_smollm) -> list[list[int]]:
    _, tok = hf_smollm
    return [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            for c in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm, chat_prompt_ids) -> list[list[int]]:
    """transformers' greedy continuation of each chat prompt (EOS included when it stops early)."""
    model, tok = hf_smollm
    outs = []
    with torch.no_grad():
        for ids in chat_prompt_ids:
            g = model.generate(torch.tensor([ids]), max_new_tokens=NUM_REFERENCE_TOKENS, do_sample=False,
                               pad_token_id=tok.eos_token_id)
            outs.append(g[0, len(ids):].tolist())
    return outs
