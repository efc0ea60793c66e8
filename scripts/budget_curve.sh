#!/usr/bin/env bash
# The token budget's trade-off served: the 64-stream workload (as in compare_servers.sh) against one iterserve
# server per --max-num-batched-tokens value, one after the other, then TTFT p50 and TPOT p50 against output tok/s,
# one point per budget, drawn to OUT_DIR/budget.png and tabled on stdout.
#   bash scripts/budget_curve.sh OUT_DIR [BUDGETS]        # BUDGETS: default "512 1024 2048 4096 8192"
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 budgets=${2:-512 1024 2048 4096 8192} dtype=${DTYPE:-bfloat16}
mkdir -p "$out"
source scripts/wait_ready.sh
for budget in $budgets; do
  .venv/bin/iterserve serve --port 8210 --served-model-name smollm2-135m --dtype "$dtype" \
      --max-num-batched-tokens "$budget" >"$out/budget-$budget.server.log" 2>&1 &
  pid=$!
  wait_ready http://127.0.0.1:8210 "$pid"
  .venv/bin/iterserve bench serve --base-url http://127.0.0.1:8210 --model smollm2-135m --label "budget $budget" \
      --num-prompts 64 --input-len uniform:32:256 --output-len lognormal:64:1:384 --workload-seed 0 \
      --max-concurrency 64 --prompt-format ids --disable-tqdm --output-json "$out/budget-$budget.json" >/dev/null
  kill -TERM "$pid"; wait "$pid" || true
done
.venv/bin/python - "$out" $budgets <<'PY'
import json, sys
from iterserve.bench.charts import Series, throughput_latency_chart
from iterserve.bench.tables import render_table
out, budgets = sys.argv[1], sys.argv[2:]
runs = [json.load(open(f"{out}/budget-{b}.json"))["runs"][0] for b in budgets]
print(render_table(["max_num_batched_tokens", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms"],
                   [[b, r["output_throughput"], r["median_ttft_ms"], r["p99_ttft_ms"], r["median_tpot_ms"]]
                    for b, r in zip(budgets, runs)]))
tput = [r["output_throughput"] for r in runs]
throughput_latency_chart(
    [Series("TTFT p50", tput, [r["median_ttft_ms"] for r in runs], budgets),
     Series("TPOT p50", tput, [r["median_tpot_ms"] for r in runs], budgets)],
    f"{out}/budget.png", xlabel="output tokens/s (64 streams)", ylabel="ms",
    title="the step's token budget (--max-num-batched-tokens), served")
print(f"chart written to {out}/budget.png")
PY
