"""The concepts document's figure commands, small configuration: the counts it prints are the ones the
document leads with (continuous batching at least 2x the output tokens per step of static batching,
paged allocation fitting more sequences than reserved in the same pool), and the JSON agrees."""

from __future__ import annotations

import json
import re

import pytest

from iterserve.bench.prompt_sweep import sweep_prompt_lengths
from iterserve.cli import concepts
from iterserve.config import EngineConfig
from iterserve.models.loader import load_model


def counts_rows(text: str) -> dict[str, list[str]]:
    """mode -> cells of the counts table printed after the command line."""
    table = text.split("counts (machine-independent)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("│").split("│")] for line in table if line.startswith("│")]
    return {row[0]: row for row in rows}


def test_small_configuration_prints_the_documented_counts(tmp_path, capsys):
    rc = concepts.main(["--small", "--only", "static_vs_continuous,paged_vs_reserved", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    first, second = text.split("\n$ iterserve ")[1:]

    ratio = float(re.search(r"continuous / static: ([\d.]+)x output tokens per step", first).group(1))
    assert ratio >= 2
    rows = counts_rows(first)
    data = json.loads((tmp_path / "static_vs_continuous.json").read_text())
    runs = {r["mode"]: r for r in data["runs"]}
    for mode in ("static", "continuous"):
        assert int(rows[mode][1]) == runs[mode]["num_steps"]
        assert float(rows[mode][2]) == pytest.approx(runs[mode]["output_tokens_per_step"], abs=0.005)
    assert data["continuous_over_static_per_step"] == pytest.approx(ratio, abs=0.005)
    assert runs["continuous"]["joined_running_batch"] > 0 and runs["static"]["joined_running_batch"] == 0
    # the counts docs/concepts.md quotes in sections 1 and 2
    assert {m: (r["num_steps"], r["joined_running_batch"]) for m, r in runs.items()} == {
        "static": (69, 0), "continuous": (31, 24)}

    rows = counts_rows(second)
    data = json.loads((tmp_path / "paged_vs_reserved.json").read_text())
    runs = {r["mode"]: r for r in data["runs"]}
    assert int(rows["continuous"][3]) == runs["continuous"]["peak_running"] == 8  # every slot filled
    assert int(rows["reserved"][3]) == runs["reserved"]["peak_running"] < 8  # reservations of 128 tokens crowd out
    assert runs["continuous"]["total_output_tokens"] == runs["reserved"]["total_output_tokens"]
    # the counts docs/concepts.md quotes in section 3
    assert {m: (r["num_steps"], r["peak_running"]) for m, r in runs.items()} == {
        "continuous": (18, 8), "reserved": (43, 3)}
    for png in ("static_vs_continuous", "joins", "throughput_latency", "paged_vs_reserved"):
        assert (tmp_path / f"{png}.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_figure_names_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        concepts.main(["--only", "nope", str(tmp_path)])


def test_prompt_sweep_prefills_in_one_step_and_decodes_one_token_a_step():
    loaded = load_model(concepts.SMALL_MODEL, dtype="float32", device="cpu")
    config = EngineConfig(model=concepts.SMALL_MODEL, dtype="float32", device="cpu", num_kv_blocks=64)
    points = sweep_prompt_lengths(loaded, config, [40, 8], output_len=5, repeats=2)
    assert [p.prompt_len for p in points] == [8, 40]
    assert [p.first_step_tokens for p in points] == [8, 40]  # the whole prompt in one forward pass
    assert all(p.steps_per_request == 5 for p in points)  # that pass yields token 1; one pass per later token
    assert all(len(p.ttft_ms_runs) == len(p.tpot_ms_runs) == 2 and p.ttft_ms > 0 for p in points)
    assert [p.step_tokens for p in points] == [[8, 1, 1, 1, 1], [40, 1, 1, 1, 1]]  # the steps of one request
    assert all(len(p.step_ms) == 5 and min(p.step_ms) > 0 for p in points)


def test_ttft_command_draws_one_request_step_by_step(tmp_path, capsys):
    rc = concepts.main(["--small", "--only", "ttft", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    longest = json.loads((tmp_path / "ttft_vs_prompt.json").read_text())["points"][-1]
    assert longest["step_tokens"][0] == longest["prompt_len"] == 256
    assert "steps of one 256-token request: 256 tokens in its first pass" in text
    assert (tmp_path / "request_steps.png").read_bytes()[:4] == b"\x89PNG"


def table_rows(text: str) -> dict[str, list[str]]:
    """first cell -> cells of every row of the tables in ``text``."""
    rows = [[cell.strip() for cell in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.startswith("│")]
    return {row[0]: row for row in rows}


def test_arrivals_prints_the_documented_counts_of_the_three_policies(tmp_path, capsys):
    """Simulated at a constant step time: these counts are the document's, on any machine."""
    assert concepts.main(["--small", "--only", "arrivals", str(tmp_path)]) == 0
    rows = table_rows(capsys.readouterr().out.rsplit("\n$ iterserve ", 1)[1])
    # trace, requests, out tokens, steps, out tok/step, peak, mean running, occupancy, joined, median queue ms
    assert {k: (v[2], v[3], v[8]) for k, v in rows.items()} == {
        "static": ("161", "99", "0"), "dynamic": ("161", "93", "0"), "continuous": ("161", "76", "28")}
    assert rows["dynamic"][9] == "300.00"  # the median request waits the whole max_batch_wait for its batch
    assert (tmp_path / "arrivals.png").read_bytes()[:4] == b"\x89PNG"


def test_offered_load_runs_every_policy_at_every_load(tmp_path, capsys):
    assert concepts.main(["--small", "--only", "offered_load", str(tmp_path)]) == 0
    assert "capacity: continuous batching, all 32 at once:" in capsys.readouterr().out
    data = json.loads((tmp_path / "offered_load.json").read_text())
    assert [(p["mode"], p["load"]) for p in data["points"]] == [
        (m, x) for m in ("static", "dynamic", "continuous") for x in (0.5, 1.5)]
    assert data["total_output_tokens"] == 161 and data["capacity_steps"] == 31  # section 1's workload and count
    assert (tmp_path / "offered_load.png").read_bytes()[:4] == b"\x89PNG"
