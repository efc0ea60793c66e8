"""LoRA adapters behind the server: ``--lora-modules name=path`` listed in /v1/models under the base model, a
request's ``model`` choosing its adapter (the offline engine's tokens), unknown names a 404, and vLLM's
``vllm:lora_requests_info`` gauge."""

from __future__ import annotations

import httpx
import pytest

from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.lora.conftest import make_adapter_folders, make_base_folder
from tests.lora.test_generate import PROMPTS, lora, make_llm, tokens
from tests.server.conftest import ServerThread, metric_samples

BASE = "tiny-base"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny base model's folder and its adapters' folders."""
    return make_base_folder(tmp_path_factory), make_adapter_folders(tmp_path_factory)


@pytest.fixture(scope="module")
def lora_server(folders):
    base, adapters = folders
    config = EngineConfig(model=str(base), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                          enable_lora=True, max_loras=2, max_lora_rank=8, load_progress=False)
    modules = tuple(f"{name}={folder}" for name, folder in adapters.items())
    with ServerThread(build_app(config, ServerConfig(served_model_name=BASE, lora_modules=modules))) as s:
        yield s


def completion_tokens(server: ServerThread, model: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 10,
                                                         "temperature": 0, "ignore_eos": True, "logprobs": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_the_adapters_under_the_base(lora_server, folders):
    cards = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("all", BASE), ("some", BASE)]
    assert cards[1]["root"] == str(folders[1]["all"])
    assert httpx.get(f"{lora_server.url}/v1/models/some").json()["parent"] == BASE


def test_model_name_selects_the_adapter(lora_server, folders):
    base, adapters = folders
    llm = make_llm(base)
    for name in (None, "all", "some"):
        want = tokens(llm, PROMPTS[:1], None if name is None else lora(adapters, name))[0]
        assert completion_tokens(lora_server, name or BASE, PROMPTS[0]) == want
    info = [labels for (name, labels) in metric_samples(lora_server) if name == "vllm:lora_requests_info"]
    assert info == [(("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", ""))]


def test_unknown_model_is_404(lora_server):
    r = httpx.post(f"{lora_server.url}/v1/completions", json={"model": "nope", "prompt": PROMPTS[0],
                                                              "max_tokens": 2})
    assert r.status_code == 404 and "'all', 'some'" in r.json()["error"]["message"]


def test_lora_modules_need_enable_lora(folders):
    base, adapters = folders
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_app(EngineConfig(model=str(base)), ServerConfig(lora_modules=(f"all={adapters['all']}",)))
    with pytest.raises(ValueError, match="name=path"):
        ServerConfig(lora_modules=("just-a-path",))
