#!/usr/bin/env bash
# Calibrated simulation against the real server on this machine (the embedded model):
#   1. measurement: bench serve at four request rates and over a concurrency sweep, REPEATS times.
#      Each sweep has its own server (a fresh one per repeat, writing a step trace); the load points of
#      the two sweeps alternate in time (concurrency 2, rate 0.5, concurrency 4, rate 1, ...), so both
#      sweeps meet the same drift of this machine's speed (10-30% over minutes);
#   2. calibration, held out: the rate sweep is predicted from a profile (decode cost per batch size)
#      fitted to the concurrency sweeps' traces and the other way round, each profile also measuring the
#      request round trip and admission interval from the client's and the engine's times of its runs;
#   3. simulation: the same workloads, load points and engine settings, step times from the profile;
#   4. a table (median and min-max of the real runs, simulated, error against the median) of output
#      tok/s, median TTFT and median TPOT, and bench plot overlays of each sweep, into OUT_DIR. Rates
#      past the server's capacity (the median request throughput of the real runs at the highest
#      concurrency) are marked and summed up apart: there the queue grows for the whole run, so the
#      median TTFT measures how long the run lasted and how fast the machine was that minute (at
#      2 req/s, 0.9-3.5 s on one server within ten minutes), not a steady state.
#
#   scripts/compare_simulation.sh OUT_DIR
#
# Needs a quiet machine: the server's step times are the model. Knobs (environment): PYTHON,
# PORT (8300; the concurrency sweep's server takes the next one), RATES (0.3,0.45,0.6,2: three below
# capacity, about 0.7 req/s here, and one past it, whose full batches give the profile that predicts
# the concurrency sweep its batch sizes 12-16), CONCURRENCY
# (2,4,8,16), NUM_PROMPTS (48: at concurrency 16 two thirds of the requests then arrive as slots free,
# so the median TTFT is not decided by the first burst), REPEATS (5), MAX_NUM_SEQS (16), NUM_KV_BLOCKS
# (2048), DTYPE (float32), WORKLOAD (bench workload flags), REUSE (1: keep the measurements already in
# OUT_DIR and rerun only calibration and simulation).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
py=${PYTHON:-python}
port=${PORT:-8300}
rates=${RATES:-0.3,0.45,0.6,2}
conc=${CONCURRENCY:-2,4,8,16}
# No prefix caching on either side: a sweep sends the same prompts at every load point, so a real server
# would serve later points from the cache of earlier ones while each simulated point starts empty.
engine=(--max-num-seqs "${MAX_NUM_SEQS:-16}" --num-kv-blocks "${NUM_KV_BLOCKS:-2048}" --no-prefix-caching)
read -r -a workload <<<"${WORKLOAD:---input-len uniform:32:256 --output-len lognormal:64:1:256}"
workload+=(--num-prompts "${NUM_PROMPTS:-48}")
mkdir -p "$out/points"
source scripts/wait_ready.sh

declare -A url pid
url[rates]="http://127.0.0.1:$port"
url[concurrency]="http://127.0.0.1:$((port + 1))"
serve() {  # sweep repeat: a fresh server for this sweep, writing this repeat's step trace
  "$py" -m iterserve.cli serve --port "${url[$1]##*:}" "${engine[@]}" --dtype "${DTYPE:-float32}" \
      --step-trace "$out/trace_$1_$2.jsonl" >>"$out/server.log" 2>&1 &
  pid[$1]=$!
  wait_ready "${url[$1]}" "${pid[$1]}" 300 || { echo "see $out/server.log" >&2; return 1; }
}
stop() { kill -TERM "${pid[$1]}"; wait "${pid[$1]}" || true; }

IFS=, read -r -a rate_list <<<"$rates"
IFS=, read -r -a conc_list <<<"$conc"
order=()  # sweep:load, alternating
for ((i = 0; i < ${#rate_list[@]} || i < ${#conc_list[@]}; i++)); do
  if ((i < ${#conc_list[@]})); then order+=("concurrency:${conc_list[i]}"); fi
  if ((i < ${#rate_list[@]})); then order+=("rates:${rate_list[i]}"); fi
done

repeats=${REPEATS:-5}
echo "== measurement: $repeats x (${order[*]}), a fresh server per sweep and repeat" >&2
for k in $(seq 1 "$repeats"); do
  if [ "${REUSE:-0}" = 1 ] && [ -s "$out/real_rates_$k.json" ] && [ -s "$out/real_concurrency_$k.json" ]; then
    continue
  fi
  serve rates "$k"
  serve concurrency "$k"
  for point in "${order[@]}"; do
    sweep=${point%%:*} load=${point#*:}
    if [ "$sweep" = rates ]; then flag=(--request-rate "$load"); else flag=(--max-concurrency "$load"); fi
    "$py" -m iterserve.cli bench serve --base-url "${url[$sweep]}" --prompt-format ids --disable-tqdm "${workload[@]}" \
        "${flag[@]}" --label "real $k" --output-json "$out/points/real_${sweep}_${k}_$load.json" >/dev/null
  done
  stop rates
  stop concurrency
  for sweep in rates concurrency; do  # one result per sweep and repeat, its runs in load order
    if [ "$sweep" = rates ]; then loads=("${rate_list[@]}"); else loads=("${conc_list[@]}"); fi
    "$py" - "$out/real_${sweep}_$k.json" "${loads[@]/#/$out/points/real_${sweep}_${k}_}" <<'PYEOF'
import json, sys
parts = [json.load(open(f"{name}.json")) for name in sys.argv[2:]]
merged = {**parts[0], "runs": [run for part in parts for run in part["runs"]]}
open(sys.argv[1], "w").write(json.dumps(merged) + "\n")
PYEOF
  done
done

echo "== calibration: each sweep's profile from the other sweep's runs" >&2
calibrate() {  # from-sweep profile
  local args=()
  for k in $(seq 1 "$repeats"); do
    args+=(--trace "$out/trace_$1_$k.jsonl" --serve-json "$out/real_$1_$k.json")
  done
  "$py" -m iterserve.cli simulate calibrate --per-batch-size "${args[@]}" -o "$2"
}
calibrate concurrency "$out/profile_for_rates.json"
calibrate rates "$out/profile_for_concurrency.json"

echo "== simulation" >&2
sim=(--model smollm2-135m "${engine[@]}" "${workload[@]}")
"$py" -m iterserve.cli simulate run "${sim[@]}" --profile "$out/profile_for_rates.json" --sweep-rates "$rates" \
    --label simulated --output-json "$out/sim_rates.json" --no-charts
"$py" -m iterserve.cli simulate run "${sim[@]}" --profile "$out/profile_for_concurrency.json" \
    --sweep-concurrency "$conc" --label simulated --output-json "$out/sim_concurrency.json" --no-charts

for sweep in rates concurrency; do
  "$py" -m iterserve.cli bench plot "$out"/real_"$sweep"_*.json "$out/sim_$sweep.json" --output-prefix "$out/compare_$sweep"
done
"$py" - "$out" <<'PYEOF' | tee "$out/compare_table.md"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
reals = {sweep: [json.loads(f.read_text())["runs"] for f in sorted(out.glob(f"real_{sweep}_*.json"))]
         for sweep in ("rates", "concurrency")}
capacity = statistics.median(runs[-1]["request_throughput"] for runs in reals["concurrency"])
print("| load | metric | real (median) | real min-max | simulated | error |")
print("|---|---|---:|---:|---:|---:|")
worst = {False: 0.0, True: 0.0}  # by: past capacity
for sweep in ("rates", "concurrency"):
    sim = json.loads((out / f"sim_{sweep}.json").read_text())["runs"]
    for i, s in enumerate(sim):
        r = reals[sweep][0][i]
        past = sweep == "rates" and r["request_rate"] > capacity
        load = f"{r['request_rate']} req/s" if sweep == "rates" else f"concurrency {r['max_concurrency']}"
        load += " (past capacity)" if past else ""
        for key, name in (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT ms"),
                          ("median_tpot_ms", "median TPOT ms")):
            values = [runs[i][key] for runs in reals[sweep]]
            real = statistics.median(values)
            err = (s[key] - real) / real
            worst[past] = max(worst[past], abs(err))
            print(f"| {load} | {name} | {real:,.1f} | {min(values):,.1f}-{max(values):,.1f} | {s[key]:,.1f} | {err:+.0%} |")
print(f"\ncapacity (median request throughput at concurrency {reals['concurrency'][0][-1]['max_concurrency']}): "
      f"{capacity:.2f} req/s")
print(f"largest error against the median of {len(reals['rates'])} real runs: {worst[False]:.0%} below capacity, "
      f"{worst[True]:.0%} past it")
PYEOF
