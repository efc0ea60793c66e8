"""``iterserve plan --quantization``: the flag reaches the plan, the table names the format, bad values exit 2."""

from __future__ import annotations

import json

from iterserve import planner
from iterserve.cli.plan import main


def test_quantization_flag_sets_the_plans_weight_format(capsys):
    assert main(["llama-3-8b", "--gpu", "L4", "--quantization", "Q4_1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    cfg = planner.load_model_config("llama-3-8b")
    assert plan["quantization"].startswith("Q4_1")
    assert plan["weight_bytes"] == planner.weight_bytes(cfg, "bf16", "q4_1")
    assert plan["streamed_weight_bytes"] == planner.streamed_weight_bytes(cfg, "bf16", "q4_1")

    assert main(["smollm2-135m", "--gpu", "L4", "--quantization", "gguf"]) == 0
    table = capsys.readouterr().out
    assert "weight format" in table and "gguf, from the file: Q4_1" in table
    assert "weight bytes read per step" in table


def test_quantization_flag_refuses_unknown_formats_and_validation(capsys):
    assert main(["llama-3-8b", "--gpu", "L4", "--quantization", "q3_k"]) == 2
    assert "invalid choice: 'q3_k'" in capsys.readouterr().err
    assert main(["smollm2-135m", "--validate", "--quantization", "int8"]) == 2
    assert "drop --quantization" in capsys.readouterr().err
