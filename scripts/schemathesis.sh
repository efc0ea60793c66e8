#!/usr/bin/env bash
# Fuzz the server with Schemathesis driven by its own /openapi.json: every operation, valid and invalid
# bodies, checked for 5xx answers and for responses that do not match the documented status codes,
# content types and schemas (docs/compatibility.md, "Hostile input"). Not part of the test suite.
#   bash scripts/schemathesis.sh [MAX_EXAMPLES]
# MAX_EXAMPLES (default 30) bounds the generated cases per operation, so that a run ends within 10 minutes.
# The pinned Schemathesis goes into a venv of its own under SCRATCH (default
# ${TMPDIR:-/tmp}/iterserve-schemathesis), made on first use. ITERSERVE is the command that starts the
# server (default .venv/bin/iterserve); PORT (8410) where it listens; SERVE_ARGS adds serve flags.
set -euo pipefail
cd "$(dirname "$0")/.."
SCHEMATHESIS_VERSION=4.32.5
examples=${1:-30} port=${PORT:-8410} scratch=${SCRATCH:-${TMPDIR:-/tmp}/iterserve-schemathesis}
url="http://127.0.0.1:$port"
mkdir -p "$scratch"

venv="$scratch/venv-$SCHEMATHESIS_VERSION"
if [ ! -x "$venv/bin/schemathesis" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION"
fi

# A short context and a small batch bound what one generated request can cost the CPU.
# shellcheck disable=SC2086  # ITERSERVE and SERVE_ARGS are command words
${ITERSERVE:-.venv/bin/iterserve} serve --port "$port" --max-model-len 256 --max-num-seqs 16 \
    ${SERVE_ARGS:-} >"$scratch/server.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
source scripts/wait_ready.sh
wait_ready "$url" "$server" || { echo "see $scratch/server.log" >&2; exit 1; }

report="$scratch/report"
rm -rf "$report"
status=0
"$venv/bin/schemathesis" run "$url/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance \
    --max-examples "$examples" --workers 4 --request-timeout 120 --seed 0 --no-shrink \
    --suppress-health-check all --report ndjson --report-dir "$report" --output-truncate true || status=$?

# The requests sent: every HTTP exchange the run recorded.
"$venv/bin/python" - "$report" <<'EOF'
import json, pathlib, sys
sent = 0
for path in pathlib.Path(sys.argv[1]).glob("*.ndjson"):
    for line in path.read_text().splitlines():
        event = json.loads(line)
        for kind, body in event.items():
            if kind == "ScenarioFinished":
                sent += len(body.get("recorder", {}).get("interactions", {}))
print(f"requests sent: {sent}")
EOF
echo "5xx answers in the server log: $(grep -cE '" 5[0-9]{2} ' "$scratch/server.log" || true)"
echo "ERROR lines in the server log: $(grep -c 'ERROR' "$scratch/server.log" || true)"
exit $status
