"""Perplexity through the engine's prompt logprobs: the same number the model's own logits give, on the same
windows, and ``iterserve bench perplexity`` printing each weight format side by side."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve import LLM
from iterserve.bench.perplexity import SHIPPED_TEXT, perplexity, windows_of
from iterserve.cli.main import main
from iterserve.models.loader import load_model
from tests.models.test_llama import run_ours

TINY = "random:smollm2-135m?num_layers=2"


def test_windows_cover_the_text_and_drop_a_lone_last_token():
    assert windows_of(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert windows_of(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows_of([1, 2], 1)


def test_perplexity_is_the_mean_nll_of_the_models_own_logits():
    loaded = load_model(TINY, "float32", "cpu")
    text = SHIPPED_TEXT.read_text()[:600]
    result = perplexity(LLM(TINY, loaded=loaded, dtype="float32", num_kv_blocks=64), text, window=40)
    nll, scored = 0.0, 0
    windows = windows_of(loaded.tokenizer.encode(text, add_special_tokens=False), 40)
    for window in windows:
        ids = torch.tensor(window)
        with torch.no_grad():
            logp = torch.log_softmax(run_ours(loaded.model, ids, [len(ids)], block_size=16).double(), -1)
        nll -= logp[torch.arange(len(ids) - 1), ids[1:]].sum().item()
        scored += len(ids) - 1
    assert result.scored == scored and result.windows == len(windows) > 1
    assert result.nll == pytest.approx(nll / scored, rel=1e-4)
    assert result.perplexity == pytest.approx(math.exp(nll / scored), rel=1e-4) and result.tokens_per_s > 0
    with pytest.raises(ValueError, match="shorter than two tokens"):
        perplexity(LLM(TINY, loaded=loaded, num_kv_blocks=8), "a", window=40)


@pytest.mark.slow  # loads the model twice and scores the text twice
def test_bench_perplexity_compares_formats(capsys):
    assert main(["bench", "perplexity", "--model", TINY, "--dtype", "float32", "--formats", "none,int8",
                 "--window", "64"]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in out.splitlines()]
    rows = {c[0]: c for c in cells if c[0] in ("none", "int8")}
    assert set(rows) == {"none", "int8"}
    assert float(rows["int8"][2]) < 0.3 * float(rows["none"][2])  # weights MB
    assert rows["none"][4] == "+0.00%"


def test_bench_perplexity_scores_each_kv_cache_dtype(capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(SHIPPED_TEXT.read_text()[:800])
    assert main(["bench", "perplexity", "--model", TINY, "--dtype", "float32", "--formats", "none",
                 "--kv-cache-dtypes", "auto,fp8,int8", "--window", "64", "--text", str(text)]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.strip("│ ").split("│")] for line in out.splitlines()]
    rows = {c[1]: c for c in cells if len(c) > 1 and c[0] == "none"}
    assert set(rows) == {"auto", "fp8", "int8"} and rows["auto"][4] == "+0.00%"
    for kv in ("fp8", "int8"):  # one-byte K/V cost a random model's perplexity little
        assert abs(float(rows[kv][3]) / float(rows["auto"][3]) - 1) < 0.05
    assert main(["bench", "perplexity", "--model", TINY, "--kv-cache-dtypes", "fp4", "--text", str(text)]) != 0
    assert "kv_cache_dtype must be one of auto, fp8" in capsys.readouterr().err
