"""Under torchrun, on one node: rank 0 runs ``generate``, the other ranks become its workers, and the text
is the single-process engine's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:smollm2-135m?num_layers=2"  # 9 heads, 3 KV heads, with the embedded tokenizer


@pytest.mark.slow
def test_torchrun_ranks_generate_the_text_of_one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(port),
           "-m", "iterserve.cli", "generate", "Once upon a time", "--model", MODEL, "--dtype", "float32",
           "--device", "cpu", "--num-kv-blocks", "16", "--max-tokens", "8", "--ignore-eos",
           "--tensor-parallel-size", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    llm = LLM(MODEL, dtype="float32", device="cpu", num_kv_blocks=16)
    expected = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert result.stdout.strip() == expected.strip()
