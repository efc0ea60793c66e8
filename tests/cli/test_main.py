"""The command line: flags generated from the config dataclasses, help with defaults everywhere,
``--log-level`` choices, and ``iterserve serve MODEL`` as vLLM spells it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

import iterserve.server
from iterserve.cli.main import build_parser, main
from iterserve.config import DEFAULT_MODEL, EngineConfig, ServerConfig


def _parsers(parser: argparse.ArgumentParser, path: str = "iterserve"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_option_of_every_command_has_help_and_shows_its_default():
    missing = [(path, a.option_strings or a.dest) for path, p in _parsers(build_parser()) for a in p._actions
               if a.help is None and not isinstance(a, argparse._SubParsersAction)]
    assert not missing
    serve = dict(_parsers(build_parser()))["iterserve serve"]
    text = " ".join(serve.format_help().split())
    assert "most sequences in one step's batch (default: 256)" in text
    assert "--batching {continuous,static,dynamic}" in text and "(default: continuous)" in text
    assert "(default: $ITERSERVE_API_KEY)" in text


def test_flags_are_generated_from_the_config_fields():
    parsers = dict(_parsers(build_parser()))
    for path in ("iterserve serve", "iterserve generate", "iterserve bench throughput", "iterserve bench ttft"):
        dests = {a.dest for a in parsers[path]._actions}
        flagged = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)}
        assert flagged <= dests, (path, flagged - dests)
    assert {f.name for f in dataclasses.fields(ServerConfig) if f.metadata.get("cli", True)} <= {
        a.dest for a in parsers["iterserve serve"]._actions}


@pytest.fixture
def served(monkeypatch):
    """Runs ``iterserve serve ...`` up to run_server, which records its two configs instead of serving."""
    calls: list[tuple[EngineConfig, ServerConfig]] = []
    monkeypatch.setattr(iterserve.server, "run_server", lambda engine, server: calls.append((engine, server)) or 0)
    return calls


def test_serve_builds_both_configs_from_its_flags(served, monkeypatch):
    monkeypatch.setenv("ITERSERVE_API_KEY", "from-env")
    assert main(["--log-level", "debug", "serve", "random:smollm2-135m", "--port", "8123", "--max-num-seqs", "4",
                 "--batching", "static", "--no-prefix-caching", "--dtype", "float32", "--max-waiting", "9",
                 "--data-parallel-size", "2"]) == 0
    engine, server = served[-1]
    assert engine == EngineConfig(model="random:smollm2-135m", dtype="float32", max_num_seqs=4, batching="static",
                                  enable_prefix_caching=False)
    assert server == ServerConfig(port=8123, api_key="from-env", max_waiting=9, log_level="DEBUG",
                                  data_parallel_size=2)
    assert server.model_name(engine) == "random:smollm2-135m"


def test_serve_model_positional_or_flag(served, capsys):
    assert main(["serve"]) == 0 and served[-1][0].model == DEFAULT_MODEL
    assert main(["serve", "random:qwen3-0.6b"]) == 0 and served[-1][0].model == "random:qwen3-0.6b"
    assert main(["serve", "--model", "random:qwen3-0.6b"]) == 0 and served[-1][0].model == "random:qwen3-0.6b"
    assert main(["serve", "random:qwen3-0.6b", "--model", "random:qwen3-0.6b"]) == 0
    assert len(served) == 4
    assert main(["serve", "random:qwen3-0.6b", "--model", "smollm2-135m"]) == 2
    assert len(served) == 4
    assert "given twice and differs" in capsys.readouterr().err


def test_vllm_serve_flags_are_taken_with_their_meaning(served, monkeypatch, caplog, tmp_path):
    import iterserve.cli.vllm_flags

    monkeypatch.setattr(iterserve.cli.vllm_flags, "available_memory_bytes", lambda: 8 * 2**30)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with caplog.at_level("INFO", logger="iterserve.cli"):
        assert main(["serve", "random:smollm2-135m", "--gpu-memory-utilization", "0.25", "--max-model-len", "512",
                     "--no-enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     "--chat-template", str(template)]) == 0
    engine, server = served[-1]
    assert engine.kv_cache_memory == 2 * 2**30 and engine.max_model_len == 512 and not engine.enable_prefix_caching
    assert server.chat_template == str(template)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--gpu-memory-utilization 0.25: the KV cache gets 2.00 GiB" in said and "Hermes" in said
    assert main(["serve", "--enable-prefix-caching"]) == 0 and served[-1][0].enable_prefix_caching
    assert served[-1][0].hybrid_swa_memory
    assert main(["serve", "--disable-hybrid-kv-cache-manager"]) == 0 and not served[-1][0].hybrid_swa_memory
    assert main(["serve", "--gpu-memory-utilization", "1.5"]) == 2


def test_a_plain_input_len_is_a_fixed_length():
    from iterserve.bench.workloads import LengthDist

    assert LengthDist.parse("64") == LengthDist.parse("fixed:64")
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--input-len", "64"])
    assert LengthDist.parse(args.input_len).params == (64.0,)


def test_bad_values_are_errors_not_tracebacks(served, capsys):
    for argv in (["--log-level", "LOUD", "serve"], ["serve", "--batching", "eager"], ["serve", "--port", "x"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err
    assert main(["serve", "--max-num-seqs", "0"]) == 2  # refused by EngineConfig's own check
    assert "max_num_seqs must be an integer >= 1, got 0" in capsys.readouterr().err
    assert not served


def test_under_torchrun_rank_0_runs_the_command_and_the_others_become_workers(served, monkeypatch, capsys):
    import iterserve.engine.worker

    workers = []
    monkeypatch.setattr(iterserve.engine.worker, "run_worker",
                        lambda config, launch: workers.append((config, launch)) or 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["serve", "random:smollm2-135m", "--tensor-parallel-size", "2"]) == 0
    config, launch = workers[-1]
    assert config.model == "random:smollm2-135m" and config.tensor_parallel_size == 2
    assert (launch.rank, launch.world_size, launch.local_rank, launch.init_method) == (1, 2, 1, "env://")
    assert not served  # a worker serves no HTTP
    monkeypatch.setenv("RANK", "0")
    assert main(["serve", "random:smollm2-135m", "--tensor-parallel-size", "2"]) == 0
    assert served[-1][0].tensor_parallel_size == 2 and len(workers) == 1
    assert main(["serve", "--tensor-parallel-size", "3"]) == 2  # every rank refuses a size torchrun did not start
    assert "torchrun started 2 ranks" in capsys.readouterr().err
