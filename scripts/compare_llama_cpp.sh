#!/usr/bin/env bash
# Side by side: llama.cpp's server and iterserve's on the same GGUF file, driven one after the other by
# the same client (iterserve bench serve) with the same token-id requests, at 1 and at 16 streams.
#   bash scripts/compare_llama_cpp.sh LLAMA_SERVER OUT_DIR [ROUNDS] [GGUF]
# LLAMA_SERVER: a llama-server binary built from llama.cpp's public source (not a dependency of this
# project). GGUF: the file both serve (default: the embedded SmolLM2, Q4_1/Q8_0), any file whose tokenizer is
# SmolLM2's (scripts/make_random_gguf.py writes one), since the client sends SmolLM2 token ids. iterserve serves
# with --quantization gguf: both compute on the file's own blocks.
set -euo pipefail
cd "$(dirname "$0")/.."
llama_server=$1 out=$2 rounds=${3:-1}
gguf=${4:-$(.venv/bin/python -c "from iterserve.models.sources import embedded_model_path; print(embedded_model_path())")}
threads=$(nproc)
mkdir -p "$out"
source scripts/wait_ready.sh

run_one() {  # label port streams command...
  local label=$1 port=$2 streams=$3; shift 3
  "$@" >"$out/$label.server.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$port" "$pid"
  .venv/bin/iterserve bench serve --base-url "http://127.0.0.1:$port" --model smollm2-135m --label "$label" \
      --num-prompts $((streams == 1 ? 8 : 4 * streams)) --input-len uniform:32:256 --output-len fixed:128 \
      --workload-seed 0 --max-concurrency "$streams" --prompt-format ids --disable-tqdm \
      --output-json "$out/$label.json" | tee "$out/$label.txt"
  kill -TERM "$pid"; wait "$pid" || true
}

for round in $(seq "$rounds"); do
  for streams in 1 16; do
    run_one "llama.cpp-$streams-$round" 8300 "$streams" "$llama_server" -m "$gguf" --port 8300 -t "$threads" \
        -np "$streams" -c $((2048 * streams)) --alias smollm2-135m
    run_one "iterserve-$streams-$round" 8200 "$streams" .venv/bin/iterserve serve --model "$gguf" --port 8200 \
        --served-model-name smollm2-135m --quantization gguf --max-num-seqs "$streams"
  done
done
