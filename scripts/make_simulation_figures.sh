#!/usr/bin/env bash
# The worked example of docs/simulation.md: Llama-2-13B on an A100-40GB (roofline), continuous
# batching with a paged KV cache against static batching (paged, and reserving prompt + max_tokens
# up front as a naive server does), over a sweep of request rates; and a timeline of continuous
# against static on the first 40 requests. Writes the charts and a markdown table into OUTDIR
# (default docs/figures/simulation); the result JSONs and step traces (bench serve's shape, every
# token's timing included, tens of MB) go to $WORK (default: a temporary folder).
#
#   scripts/make_simulation_figures.sh [OUTDIR]
#
# Set PYTHON to the interpreter to use. Takes a few minutes on two CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-docs/figures/simulation}"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$OUT" "$WORK"
ENGINE=(--model llama-2-13b --gpu A100-40GB --step-overhead 0.002)
WORKLOAD=(--input-len uniform:64:1024 --output-len lognormal:128:1:1024)
run() {
    echo "+ iterserve simulate run ${ENGINE[*]} ${WORKLOAD[*]} $*" >&2
    "$PY" -m iterserve.cli simulate run "${ENGINE[@]}" "${WORKLOAD[@]}" "$@"
}
SWEEP=(--num-prompts 1000 --sweep-rates 0.25,0.5,1,2,4 --no-charts)
run "${SWEEP[@]}" --batching continuous --kv-allocation paged --label "continuous, paged" \
    --output-json "$WORK/a100_continuous.json"
run "${SWEEP[@]}" --batching static --kv-allocation paged --label "static, paged" \
    --output-json "$WORK/a100_static_paged.json"
run "${SWEEP[@]}" --batching static --kv-allocation reserved --label "static, reserved" \
    --output-json "$WORK/a100_static_reserved.json"
"$PY" -m iterserve.cli bench plot "$WORK/a100_continuous.json" "$WORK/a100_static_paged.json" \
    "$WORK/a100_static_reserved.json" --output-prefix "$OUT/a100_13b"
for mode in continuous static; do
    run --num-prompts 40 --request-rate 2 --batching "$mode" --step-trace "$WORK/timeline_$mode.jsonl" >/dev/null
done
"$PY" -c "import sys; from iterserve.bench.timeline import timeline_chart
timeline_chart({'continuous': sys.argv[1], 'static': sys.argv[2]}, sys.argv[3], x='time')" \
    "$WORK/timeline_continuous.jsonl" "$WORK/timeline_static.jsonl" "$OUT/a100_13b_timeline.png"
echo "chart written to $OUT/a100_13b_timeline.png"
"$PY" - "$WORK" <<'PYEOF' | tee "$OUT/a100_13b_table.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
files = ["a100_continuous.json", "a100_static_paged.json", "a100_static_reserved.json"]
print("| mode | rate (req/s) | achieved req/s | output tok/s | p50 TTFT (ms) | p50 TPOT (ms) | p50 E2E (s) | mean batch |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for name in files:
    result = json.loads((out / name).read_text())
    for r in result["runs"]:
        print(f"| {result['label']} | {r['request_rate']:g} | {r['request_throughput']:.2f} | "
              f"{r['output_throughput']:.0f} | {r['median_ttft_ms']:,.0f} | {r['median_tpot_ms']:.1f} | "
              f"{r['median_e2el_ms'] / 1000:.1f} | {r['simulated']['mean_batch']:.1f} |")
PYEOF
