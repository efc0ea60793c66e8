#!/usr/bin/env bash
# Regenerate every figure of docs/concepts.md, printing each command and the numbers it prints.
#
#   scripts/make_concept_figures.sh [--small] [--only NAME,...] [OUTDIR]
#
# OUTDIR defaults to docs/figures. --small runs the same workloads on a tiny random model with one
# repeat (the step counts are the real model's, the timings are not); the tests run it. The commands
# themselves live in iterserve/cli/concepts.py. It runs the project's .venv (scripts/setup.sh makes it);
# set PYTHON to use another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=.venv/bin/python
    [[ -x "$PYTHON" ]] || { echo "no .venv here: run scripts/setup.sh first, or set PYTHON" >&2; exit 1; }
fi
exec "$PYTHON" -m iterserve.cli.concepts "$@"
