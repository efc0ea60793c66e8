# Sourced by the scripts that start a server: wait_ready URL PID [SECONDS] returns once URL/health
# answers, fails at once if PID exits first, and gives up after SECONDS (default 600).
wait_ready() {
  local tries=$(( ${3:-600} * 2 ))
  for _ in $(seq "$tries"); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited before it was ready" >&2; return 1; }
    sleep 0.5
  done
  echo "server not ready after ${3:-600} s" >&2; return 1
}
