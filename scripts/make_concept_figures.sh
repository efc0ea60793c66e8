#!/usr/bin/env bash
# Regenerate every figure of docs/concepts.md, printing each command and the numbers it prints.
#
#   scripts/make_concept_figures.sh [--small] [--only NAME,...] [OUTDIR]
#
# OUTDIR defaults to docs/figures. --small runs the same workloads on a tiny random model with one
# repeat (the step counts are the real model's, the timings are not); the tests run it. The commands
# themselves live in iterserve/cli/concepts.py. Set PYTHON to the interpreter to use.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m iterserve.cli.concepts "$@"
