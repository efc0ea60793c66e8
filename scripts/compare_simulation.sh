#!/usr/bin/env bash
# Calibrated simulation against the real server on this machine (the embedded model):
#   1. measurement: bench serve over a concurrency sweep and a request-rate sweep, REPEATS times. Each
#      sweep has its own server (a fresh one per repeat, writing a step trace). A repeat starts at the
#      highest concurrency, whose request throughput is that repeat's capacity; its rates are fractions
#      of that capacity, and the remaining load points of the two sweeps alternate in time
#      (concurrency 2, 0.4 x capacity, concurrency 4, ...), so both sweeps meet the same drift of this
#      machine's speed (10-30% within minutes, and capacity 0.43-0.80 req/s on different hours);
#   2. calibration, held out: each repeat's rate sweep is predicted from a profile (decode cost per
#      batch size) fitted to that repeat's concurrency-sweep trace and the other way round, each profile
#      also measuring the request round trip and admission interval from the client's and the engine's
#      times of its runs. Per repeat, because the speed also moves between repeats (one of three had
#      a 17-48% lower median TPOT at most load points): a profile pooled over the repeats predicts
#      their mean, not the real median it is compared with;
#   3. simulation: the same workloads, load points (each repeat's rates) and engine settings, step times
#      from the profile;
#   4. a table (median and min-max of the real runs, the median of the repeats' simulations, its error
#      against the real median) of output tok/s, median TTFT and median TPOT, and bench plot overlays
#      of each sweep, into OUT_DIR. The overloaded rate is summed up apart: past capacity the queue
#      grows for the whole run, so its median TTFT measures how long the run lasted and how fast the
#      machine was that minute (at 2 req/s, 0.9-3.5 s on one server within ten minutes), not a steady
#      state.
#
#   scripts/compare_simulation.sh OUT_DIR
#
# Needs a quiet machine: the server's step times are the model. Knobs (environment): PYTHON,
# PORT (8300; the concurrency sweep's server takes the next one), CONCURRENCY (2,4,8,16),
# RATE_FRACTIONS (0.4,0.6,0.8: rates below capacity, as fractions of it), OVERLOAD (3: one more rate
# at this multiple of capacity, whose full batches give the profile that predicts the concurrency
# sweep its batch sizes 12-16), NUM_PROMPTS (48: at concurrency 16 two thirds of the requests then
# arrive as slots free, so the median TTFT is not decided by the first burst), REPEATS (3),
# MAX_NUM_SEQS (16), NUM_KV_BLOCKS (2048), DTYPE (float32), WORKLOAD (bench workload flags), REUSE (1:
# keep the repeats already measured in OUT_DIR, measure the missing ones, rerun calibration and
# simulation).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1
py=${PYTHON:-python}
port=${PORT:-8300}
IFS=, read -r -a conc_list <<<"${CONCURRENCY:-2,4,8,16}"
IFS=, read -r -a fractions <<<"${RATE_FRACTIONS:-0.4,0.6,0.8}"
fractions+=("${OVERLOAD:-3}")
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
point() {  # sweep repeat load: one bench serve run into points/real_SWEEP_REPEAT_LOAD.json
  if [ "$1" = rates ]; then flag=(--request-rate "$3"); else flag=(--max-concurrency "$3"); fi
  "$py" -m iterserve.cli bench serve --base-url "${url[$1]}" --prompt-format ids --disable-tqdm "${workload[@]}" \
      "${flag[@]}" --label "real $2" --output-json "$out/points/real_$1_$2_$3.json" >/dev/null
}
merge() {  # out points...: one bench serve result holding the runs of the given points, in that order
  "$py" - "$@" <<'PYEOF'
import json, sys
parts = [json.load(open(name)) for name in sys.argv[2:]]
merged = {**parts[0], "runs": [run for part in parts for run in part["runs"]]}
open(sys.argv[1], "w").write(json.dumps(merged) + "\n")
PYEOF
}
files() { for load in "${@:3}"; do echo "$out/points/real_$1_$2_$load.json"; done; }  # sweep repeat loads...

repeats=${REPEATS:-3}
top=${conc_list[-1]}
echo "== measurement: $repeats x (concurrency $top, then concurrency ${conc_list[*]:0:${#conc_list[@]}-1} alternating with" \
     "rates ${fractions[*]} x its capacity), a fresh server per sweep and repeat" >&2
for k in $(seq 1 "$repeats"); do
  if [ "${REUSE:-0}" = 1 ] && [ -s "$out/real_rates_$k.json" ] && [ -s "$out/real_concurrency_$k.json" ]; then
    continue
  fi
  serve rates "$k"
  serve concurrency "$k"
  point concurrency "$k" "$top"
  capacity=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["request_throughput"])' \
             "$out/points/real_concurrency_${k}_$top.json")
  rates=()
  for f in "${fractions[@]}"; do rates+=("$("$py" -c "print(round($f * $capacity, 3))")"); done
  echo "repeat $k: capacity $capacity req/s, rates ${rates[*]}" >&2
  for ((i = 0; i < ${#rates[@]}; i++)); do
    if ((i < ${#conc_list[@]} - 1)); then point concurrency "$k" "${conc_list[i]}"; fi
    point rates "$k" "${rates[i]}"
  done
  stop rates
  stop concurrency
  # In time order for calibration (requests are paired with the trace's in sending order), in load
  # order for the table and the charts.
  merge "$out/points/timeline_concurrency_$k.json" $(files concurrency "$k" "$top" "${conc_list[@]:0:${#conc_list[@]}-1}")
  merge "$out/real_concurrency_$k.json" $(files concurrency "$k" "${conc_list[@]}")
  merge "$out/real_rates_$k.json" $(files rates "$k" "${rates[@]}")
done

echo "== calibration and simulation: each repeat's sweep predicted from the other sweep of that repeat" >&2
sim=(--model smollm2-135m "${engine[@]}" "${workload[@]}" --no-charts)
conc=$(IFS=,; echo "${conc_list[*]}")
for k in $(seq 1 "$repeats"); do
  "$py" -m iterserve.cli simulate calibrate --per-batch-size --trace "$out/trace_concurrency_$k.jsonl" \
      --serve-json "$out/points/timeline_concurrency_$k.json" -o "$out/profile_for_rates_$k.json"
  "$py" -m iterserve.cli simulate calibrate --per-batch-size --trace "$out/trace_rates_$k.jsonl" \
      --serve-json "$out/real_rates_$k.json" -o "$out/profile_for_concurrency_$k.json"
  rates=$("$py" -c 'import json, sys; print(",".join(str(r["request_rate"]) for r in json.load(open(sys.argv[1]))["runs"]))' \
          "$out/real_rates_$k.json")
  "$py" -m iterserve.cli simulate run "${sim[@]}" --profile "$out/profile_for_rates_$k.json" --sweep-rates "$rates" \
      --label "simulated $k" --output-json "$out/sim_rates_$k.json"
  "$py" -m iterserve.cli simulate run "${sim[@]}" --profile "$out/profile_for_concurrency_$k.json" \
      --sweep-concurrency "$conc" --label "simulated $k" --output-json "$out/sim_concurrency_$k.json"
done

for sweep in rates concurrency; do
  "$py" -m iterserve.cli bench plot "$out"/real_"$sweep"_*.json "$out"/sim_"$sweep"_*.json \
      --output-prefix "$out/compare_$sweep"
done
"$py" - "$out" "${fractions[@]}" <<'PYEOF' | tee "$out/compare_table.md"
import json, statistics, sys
from pathlib import Path
out, fractions = Path(sys.argv[1]), sys.argv[2:]
runs = {f"{kind}_{sweep}": [json.loads(f.read_text())["runs"] for f in sorted(out.glob(f"{kind}_{sweep}_*.json"))]
        for kind in ("real", "sim") for sweep in ("rates", "concurrency")}
print("| load | metric | real (median) | real min-max | simulated | error |")
print("|---|---|---:|---:|---:|---:|")
worst = {False: 0.0, True: 0.0}  # by: past capacity
for sweep in ("rates", "concurrency"):
    reals, sims = runs[f"real_{sweep}"], runs[f"sim_{sweep}"]
    for i in range(len(reals[0])):
        past = sweep == "rates" and i == len(fractions) - 1
        if sweep == "rates":
            rates = [r[i]["request_rate"] for r in reals]
            load = f"{fractions[i]} x capacity{', past it' if past else ''} ({min(rates):.3f}-{max(rates):.3f} req/s)"
        else:
            load = f"concurrency {reals[0][i]['max_concurrency']}"
        for key, name in (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT ms"),
                          ("median_tpot_ms", "median TPOT ms")):
            values = [r[i][key] for r in reals]
            real, simulated = statistics.median(values), statistics.median(s[i][key] for s in sims)
            err = (simulated - real) / real
            worst[past] = max(worst[past], abs(err))
            print(f"| {load} | {name} | {real:,.1f} | {min(values):,.1f}-{max(values):,.1f} | {simulated:,.1f} | "
                  f"{err:+.0%} |")
capacities = [r[-1]["request_throughput"] for r in runs["real_concurrency"]]
print(f"\ncapacity (request throughput at concurrency {runs['real_concurrency'][0][-1]['max_concurrency']}) per "
      f"repeat: {', '.join(f'{c:.2f}' for c in capacities)} req/s")
print(f"largest error against the median of {len(capacities)} real runs: {worst[False]:.0%} below capacity, "
      f"{worst[True]:.0%} past it")
PYEOF
