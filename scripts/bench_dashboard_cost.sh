#!/usr/bin/env bash
# What an open dashboard costs the engine: output tokens/s at 64 concurrent streams with nobody
# watching, then with a dashboard open, on one server (docs/dashboard.md, "What it costs").
#   bash scripts/bench_dashboard_cost.sh OUT_DIR [ROUNDS]
# Each round runs bench serve twice, alternating which goes first so a drift of the machine does not
# land on one side. The viewer reads /dashboard/events as the page does; VIEWER=browser opens the
# page itself in headless Chromium (Playwright and Debian's chromium, as the tests use) instead.
# SERVE_ARGS adds iterserve serve flags, BENCH_ARGS bench serve flags; PORT (8400) where it listens.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 rounds=${2:-3} port=${PORT:-8400} viewer=${VIEWER:-feed}
url="http://127.0.0.1:$port"
mkdir -p "$out"
workload=(--num-prompts 256 --input-len uniform:32:256 --output-len lognormal:128:1:384 --workload-seed 0
          --max-concurrency 64 --prompt-format ids --disable-tqdm ${BENCH_ARGS:-})

.venv/bin/iterserve serve --port "$port" --max-num-seqs 64 ${SERVE_ARGS:-} >"$out/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
source scripts/wait_ready.sh
wait_ready "$url" "$server" || { echo "see $out/server.log" >&2; exit 1; }

# A viewer that stays until killed. The feed viewer parses every frame, as the page does.
start_viewer() {
  if [ "$viewer" = browser ]; then
    .venv/bin/python -c '
import sys, time
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    page = p.chromium.launch(executable_path="/usr/bin/chromium").new_page()
    page.goto(sys.argv[1] + "/dashboard")
    page.wait_for_selector("#panels:not([hidden])")
    while True:
        time.sleep(60)
' "$url" &
  else
    .venv/bin/python -c '
import json, sys
import httpx
with httpx.stream("GET", sys.argv[1] + "/dashboard/events", timeout=None) as r:
    r.raise_for_status()
    for line in r.iter_lines():
        if line.startswith("data: "):
            json.loads(line[6:])
' "$url" &
  fi
  viewer_pid=$!
  sleep 3  # the page is open and the core is taking KV snapshots
}

run() {  # label
  .venv/bin/iterserve bench serve --base-url "$url" --label "$1" "${workload[@]}" --output-json "$out/$1.json" \
      | tee "$out/$1.txt"
}

run warmup >/dev/null  # one-time costs (first requests, allocator growth) land on neither side
for round in $(seq "$rounds"); do
  order=(alone watched)
  [ $((round % 2)) -eq 0 ] && order=(watched alone)
  for side in "${order[@]}"; do
    if [ "$side" = watched ]; then
      start_viewer
      run "watched-$round"
      kill "$viewer_pid"; wait "$viewer_pid" 2>/dev/null || true
    else
      run "alone-$round"
    fi
  done
done

.venv/bin/python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
tps = {side: [json.load(open(f"{out}/{side}-{r}.json"))["runs"][0]["output_throughput"] for r in range(1, rounds + 1)]
       for side in ("alone", "watched")}
for side, values in tps.items():
    print(f"{side:8s} output tok/s: median {statistics.median(values):.1f}  runs {', '.join(f'{v:.1f}' for v in values)}")
ratio = statistics.median(tps["watched"]) / statistics.median(tps["alone"])
print(f"watched / alone: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
PY
