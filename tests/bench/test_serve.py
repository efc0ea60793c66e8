"""bench serve against the real OpenAI-compatible server, started in-process on 127.0.0.1, and
against a closed port; bench plot over its results."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from iterserve.bench.workloads import WorkloadSpec, make_workload
from iterserve.cli.main import main
from iterserve.config import EngineConfig, ServerConfig
from iterserve.server.api_server import build_app

TINY = "random:smollm2-135m?num_layers=2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    config = EngineConfig(model=TINY, dtype="float32", device="cpu", num_kv_blocks=256, max_num_seqs=8)
    app = build_app(config, ServerConfig(served_model_name="tiny", max_waiting=64))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240  # the engine core process loads the model first
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


SMALL = ["--num-prompts", "6", "--input-len", "uniform:8:24", "--output-len", "uniform:2:12", "--disable-tqdm"]


@pytest.fixture(scope="module")
def asked_output_lens() -> list[int]:
    """The output lengths SMALL's workload asks for (the same for random and text prompts)."""
    spec = WorkloadSpec(num_prompts=6, input_len="uniform:8:24", output_len="uniform:2:12")
    return [r.output_len for r in make_workload(spec, tokenizer=None, vocab_size=1000)]


def test_concurrency_sweep_writes_vllm_fields_and_charts(server_url, asked_output_lens, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server_url, *SMALL, "--sweep-concurrency", "1,4", "--goodput",
               "ttft:60000", "tpot:60000", "--percentiles", "50,99", "--output-json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "model tiny" in table and "goodput req/s" in table
    data = json.loads(out.read_text())
    assert data["model_id"] == "tiny" and data["tokenizer_id"] == "smollm2-135m"
    assert [r["max_concurrency"] for r in data["runs"]] == [1, 4]
    for run in data["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["errors"] == [""] * 6
        assert run["request_rate"] == "inf" and run["burstiness"] == 1.0 and run["num_prompts"] == 6
        assert run["output_lens"] == asked_output_lens  # ignore_eos: every token asked for, counted by the server
        assert run["total_output_tokens"] == sum(asked_output_lens)
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: all good
        assert 0 < run["median_ttft_ms"] <= run["p99_ttft_ms"] and run["mean_e2el_ms"] >= run["mean_ttft_ms"]
        # one gap per streamed chunk after the first; a server behind on its streams may send two tokens in one
        assert len(run["itls"]) == 6 and all(1 <= len(i) + 1 <= n for i, n in zip(run["itls"], run["output_lens"]))
        assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
        for key in ("total_input_tokens", "total_token_throughput", "std_tpot_ms", "p50_itl_ms", "median_e2el_ms",
                    "input_lens", "ttfts"):
            assert key in run
    # one at a time: a request is sent only after the previous one has finished
    solo = data["runs"][0]
    order = sorted(zip(solo["start_times"], solo["ttfts"]))
    assert all(b[0] >= a[0] + a[1] for a, b in zip(order, order[1:]))
    for suffix in ("_latency.png", "_throughput.png"):
        assert (tmp_path / f"serve{suffix}").read_bytes()[:4] == b"\x89PNG"

    both = tmp_path / "both"
    assert main(["bench", "plot", str(out), str(out), "--labels", "ours,again", "--output-prefix", str(both)]) == 0
    assert (tmp_path / "both_latency.png").is_file() and (tmp_path / "both_throughput.png").is_file()


def test_chat_endpoint_and_token_id_prompts(server_url, asked_output_lens, tmp_path):
    chat, ids = tmp_path / "chat.json", tmp_path / "ids.json"
    assert main(["bench", "serve", "--base-url", server_url, *SMALL, "--endpoint", "/v1/chat/completions",
                 "--dataset", "text", "--request-rate", "50", "--output-json", str(chat)]) == 0
    assert main(["bench", "serve", "--base-url", server_url, *SMALL, "--prompt-format", "ids", "--model", "tiny",
                 "--output-json", str(ids)]) == 0
    for path in (chat, ids):
        run = json.loads(path.read_text())["runs"][0]
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["output_lens"] == asked_output_lens
    assert json.loads(chat.read_text())["runs"][0]["request_rate"] == 50.0


# the fields `vllm bench serve --save-result` writes at the top level of its result file
VLLM_RESULT_FIELDS = (
    "date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
    "output_lens", "ttfts", "itls", "errors",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")),
)


def test_a_single_run_also_writes_vllms_flat_result(server_url, tmp_path):
    one, sweep = tmp_path / "one.json", tmp_path / "sweep.json"
    assert main(["bench", "serve", "--base-url", server_url, *SMALL, "--max-concurrency", "2",
                 "--output-json", str(one)]) == 0  # fmt: skip
    data = json.loads(one.read_text())
    assert [k for k in VLLM_RESULT_FIELDS if k not in data] == []
    run = data["runs"][0]
    assert {k: data[k] for k in run} == run  # the flat figures are the one run's
    assert data["backend"] == data["endpoint_type"] == "openai" and data["completed"] == 6
    assert data["max_concurrency"] == 2 and data["request_rate"] == "inf"
    assert data["output_throughput"] == pytest.approx(data["total_output_tokens"] / data["duration"])
    # several runs have no one set of figures to put at the top level
    assert main(["bench", "serve", "--base-url", server_url, *SMALL, "--sweep-concurrency", "1,2",
                 "--output-json", str(sweep)]) == 0  # fmt: skip
    assert "output_throughput" not in json.loads(sweep.read_text())


def test_server_errors_fail_fast_with_a_clear_message(server_url, capsys):
    rc = main(["bench", "serve", "--base-url", server_url, *SMALL, "--model", "no-such-model"])
    assert rc == 2
    assert "test request to" in capsys.readouterr().err


def test_unreachable_server_fails_fast(capsys):
    # a refused connection ends the run with its message (no wall-clock bound: on a shared machine
    # loading the tokenizer alone has taken longer than the old 10 s limit)
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", *SMALL])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:" in err and "is the server running?" in err


def test_bad_load_options_are_refused(capsys):
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9", *SMALL]
    assert main([*base, "--sweep-rates", "1,2", "--sweep-concurrency", "1"]) == 2
    assert main([*base, "--sweep-concurrency", "1.5"]) == 2
    assert main([*base, "--goodput", "latency:5"]) == 2
    assert "METRIC:MILLISECONDS" in capsys.readouterr().err


def test_plot_overlays_vllm_results_and_refuses_other_files(tmp_path, capsys):
    fields = {"median_ttft_ms": 50.0, "p99_ttft_ms": 80.0, "median_tpot_ms": 12.0, "p99_tpot_ms": 15.0}
    for rate in (1, 2):  # what `vllm bench serve --save-result` writes: one run per file
        vllm = {"backend": "vllm", "request_rate": rate, "burstiness": 1.0, "max_concurrency": None,
                "request_throughput": rate * 0.9, "output_throughput": rate * 100.0, **fields}
        (tmp_path / f"vllm-{rate}.json").write_text(json.dumps(vllm))
    prefix = tmp_path / "cmp"
    assert main(["bench", "plot", str(tmp_path / "vllm-1.json"), str(tmp_path / "vllm-2.json"),
                 "--output-prefix", str(prefix)]) == 0
    assert (tmp_path / "cmp_latency.png").is_file() and (tmp_path / "cmp_throughput.png").is_file()
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "batch", "points": []}))
    assert main(["bench", "plot", str(tmp_path / "other.json")]) == 2
    assert main(["bench", "plot", str(tmp_path / "vllm-1.json"), "--labels", "a,b"]) == 2
    assert "not a bench serve result" in capsys.readouterr().err
