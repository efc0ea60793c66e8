"""bench timeline: step traces of the simulator (a constant step time, so every count is exact) drawn side
by side, with the counts that tell the batching policies apart on the same arrivals."""

from __future__ import annotations

from iterserve.cli.main import main


def test_three_policies_on_the_same_arrivals(tmp_path, capsys):
    traces = []
    for batching in ("static", "dynamic", "continuous"):
        trace = tmp_path / f"{batching}.jsonl"
        rc = main(["--log-level", "WARNING", "simulate", "run", "--step-time", "0.05", "--batching", batching,
                   "--max-batch-wait", "0.3", "--max-num-seqs", "4", "--num-kv-blocks", "256", "--num-prompts", "12",
                   "--input-len", "uniform:8:32", "--output-len", "uniform:2:12", "--request-rate", "8",
                   "--step-trace", str(trace)])
        assert rc == 0
        traces.append(str(trace))
    capsys.readouterr()
    png = tmp_path / "figs" / "arrivals.png"
    rc = main(["bench", "timeline", *traces, "--labels", "static,dynamic,continuous", "--x", "time",
               "--max-num-seqs", "4", "--output", str(png)])
    assert rc == 0
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in capsys.readouterr().out.splitlines()
             if line.startswith("│")]
    rows = {row[0]: row for row in cells}
    assert list(rows) == ["static", "dynamic", "continuous"]
    joined = {k: int(v[8]) for k, v in rows.items()}
    steps = {k: int(v[3]) for k, v in rows.items()}
    assert joined["static"] == joined["dynamic"] == 0 < joined["continuous"]  # only continuous joins a running batch
    assert len({v[2] for v in rows.values()}) == 1  # the same output tokens under every policy
    assert steps["continuous"] < steps["static"]
    assert png.read_bytes()[:4] == b"\x89PNG"
