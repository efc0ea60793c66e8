"""LoRA adapters behind the server: ``--lora-modules name=path`` listed in /v1/models under the base model, a
request's ``model`` choosing its adapter (the offline engine's tokens) and naming it in the response, unknown
names a 404, vLLM's ``vllm:lora_requests_info`` gauge, and the runtime /v1/load_lora_adapter and
/v1/unload_lora_adapter behind their opt-in, refusing bad adapters by name while the other requests carry on."""

from __future__ import annotations

import itertools
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from iterserve.bench.serve import LoadPoint, ServeConfig, request_models, run_serve
from iterserve.bench.workloads import WorkloadSpec, make_workload
from iterserve.config import EngineConfig, ServerConfig
from iterserve.server import build_app
from tests.lora.conftest import ADAPTERS, VOCAB, base_model, make_adapter_folders, make_base_folder, save_adapter
from tests.lora.test_generate import PROMPTS, lora, make_llm, tokens
from tests.server.conftest import ServerThread, metric_samples

BASE = "tiny-base"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny base model's folder and its adapters' folders."""
    return make_base_folder(tmp_path_factory), make_adapter_folders(tmp_path_factory)


def engine_config(base, max_lora_rank: int = 8) -> EngineConfig:
    return EngineConfig(model=str(base), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                        enable_lora=True, max_loras=2, max_lora_rank=max_lora_rank, load_progress=False)


@pytest.fixture(scope="module")
def lora_server(folders):
    base, adapters = folders
    modules = tuple(f"{name}={folder}" for name, folder in adapters.items())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        app = build_app(engine_config(base), ServerConfig(served_model_name=BASE, lora_modules=modules))
    with ServerThread(app) as s:
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
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.startswith("The model `nope` does not exist.")
    assert "'all', 'some'" in message


def test_lora_modules_need_enable_lora(folders):
    base, adapters = folders
    with pytest.raises(ValueError, match="needs --enable-lora"):
        build_app(EngineConfig(model=str(base)), ServerConfig(lora_modules=(f"all={adapters['all']}",)))
    with pytest.raises(ValueError, match="name=path"):
        ServerConfig(lora_modules=("just-a-path",))


def post(server: ServerThread, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)


def served(server: ServerThread) -> list[str]:
    return [card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]]


def test_runtime_load_and_unload(lora_server, folders):
    some = folders[1]["some"]
    r = post(lora_server, "load_lora_adapter", {"lora_name": "again", "lora_path": str(some)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'again' added successfully."
    assert served(lora_server) == [BASE, "all", "some", "again"]
    # the same weights under a new name and id: the same tokens as "some", not the base model's
    assert completion_tokens(lora_server, "again", PROMPTS[1]) == completion_tokens(lora_server, "some", PROMPTS[1])
    assert completion_tokens(lora_server, "again", PROMPTS[1]) != completion_tokens(lora_server, BASE, PROMPTS[1])
    r = post(lora_server, "load_lora_adapter", {"lora_name": "again", "lora_path": str(some)})
    assert r.status_code == 400 and "'again' has already been loaded" in r.json()["error"]["message"]
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "again"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'again' removed successfully."
    assert served(lora_server) == [BASE, "all", "some"]
    r = post(lora_server, "completions", {"model": "again", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and "The model `again` does not exist." in r.json()["error"]["message"]
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "again"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'again' cannot be found."


def bad_adapters(folders, tmp_path) -> dict[str, tuple[str, str]]:
    """``{case: (folder, what the error must say)}``: each a way an adapter cannot run on the tiny base."""
    adapters = folders[1]
    malformed = tmp_path / "malformed"
    shutil.copytree(adapters["all"], malformed)
    (malformed / "adapter_config.json").write_text("{not json")
    high_rank = tmp_path / "rank16"
    save_adapter(high_rank, base_model(), {**ADAPTERS["all"][0], "r": 16}, 3)
    foreign = tmp_path / "fc1"
    shutil.copytree(adapters["all"], foreign)
    tensors = load_file(str(foreign / "adapter_model.safetensors"))
    save_file({k.replace("mlp.up_proj", "mlp.fc1"): v for k, v in tensors.items()},
              str(foreign / "adapter_model.safetensors"))
    wider = tmp_path / "wider"
    save_adapter(wider, base_model(intermediate_size=128), *ADAPTERS["all"])
    return {
        "missing": (str(tmp_path / "nowhere"), "the adapter folder does not exist"),
        "malformed": (str(malformed), "cannot read adapter_config.json"),
        "rank": (str(high_rank), "rank 16 is above max_lora_rank=8"),
        "module": (str(foreign), "targets module 'fc1', which this model does not have"),
        "other base": (str(wider), r"down_proj.lora_A has shape (8, 128), expected (8, 96) for this model: an "
                                   "adapter of another base model?"),
    }


def test_bad_adapters_are_refused_by_name_and_harm_nothing(lora_server, folders, tmp_path):
    before = {name: completion_tokens(lora_server, name, PROMPTS[2]) for name in (BASE, "all")}
    with ThreadPoolExecutor(2) as pool:  # requests running while the bad adapters are refused
        running = [pool.submit(completion_tokens, lora_server, name, PROMPTS[2]) for name in before]
        for case, (path, problem) in bad_adapters(folders, tmp_path).items():
            r = post(lora_server, "load_lora_adapter", {"lora_name": f"bad-{case}", "lora_path": path})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "lora_path", (case, r.text)
            assert f"LoRA adapter 'bad-{case}'" in error["message"] and problem in error["message"], (case, r.text)
        assert [f.result() for f in running] == list(before.values())
    assert served(lora_server) == [BASE, "all", "some"]
    assert {name: completion_tokens(lora_server, name, PROMPTS[2]) for name in before} == before
    r = post(lora_server, "load_lora_adapter", {"lora_name": BASE, "lora_path": str(folders[1]["all"])})
    assert r.status_code == 400 and "served model" in r.json()["error"]["message"]
    r = post(lora_server, "load_lora_adapter", {"lora_name": "no-path"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_a_bad_lora_module_stops_the_start(folders):
    base, adapters = folders
    with pytest.raises(ValueError, match="LoRA adapter 'all'.*rank 8 is above max_lora_rank=4"):
        build_app(engine_config(base, max_lora_rank=4), ServerConfig(lora_modules=(f"all={adapters['all']}",)))


def test_runtime_updating_needs_the_opt_in(folders, monkeypatch):
    base, adapters = folders
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("ITERSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    client = TestClient(build_app(engine_config(base)))  # no lifespan: the routes are there or not
    body = {"lora_name": "x", "lora_path": str(adapters["all"])}
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
    monkeypatch.setenv("ITERSERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    client = TestClient(build_app(engine_config(base)))
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'x' cannot be found."
    assert client.post("/v1/load_lora_adapter", json=body).status_code == 200


@pytest.fixture
def texting_server(folders, tmp_path):
    """The adapters behind a copy of the base model with a word-level tokenizer: text to stream, as bench needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = shutil.copytree(folders[0], tmp_path / "base")
    words = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(base / "tokenizer.json"))
    modules = tuple(f"{name}={folder}" for name, folder in folders[1].items())
    with ServerThread(build_app(engine_config(base), ServerConfig(served_model_name=BASE, lora_modules=modules))) as s:
        yield s


def test_bench_serve_mixes_the_adapters(texting_server):
    assert request_models(2, BASE, (), 0) == [BASE, BASE]
    mixed = request_models(32, BASE, ("all", "some"), 0)
    assert set(mixed) == {"all", "some"} and mixed == request_models(32, BASE, ("all", "some=/the/folder"), 0)
    spec = WorkloadSpec(num_prompts=6, input_len="8", output_len="3")
    cfg = ServeConfig(texting_server.url, prompt_format="ids", lora_modules=("all", "some"))
    result = run_serve(cfg, make_workload(spec, tokenizer=None, vocab_size=VOCAB), None, [LoadPoint()],
                       workload=spec, use_tqdm=False)
    assert (result["completed"], result["failed"], result["lora_modules"]) == (6, 0, ["all", "some"])


def test_the_response_names_the_adapter_asked_for(texting_server):
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    for route, stream, model in itertools.product(("completions", "chat/completions"), (False, True), (BASE, "some")):
        body = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": stream}
        if route == "completions":
            body["prompt"] = "w5 w6"
        else:
            body |= {"messages": [{"role": "user", "content": "w5 w6"}], "chat_template": template}
        r = httpx.post(f"{texting_server.url}/v1/{route}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert chunks and {c["model"] for c in chunks} == {model}, (route, chunks)
        else:
            assert r.json()["model"] == model, (route, r.json())
