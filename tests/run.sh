#!/usr/bin/env bash
# Set up and run the whole test suite on a CPU-only machine (the kernels run in Triton's interpreter):
#   bash tests/run.sh [extra pytest args]
# Installs normtune with its test extras (torch pinned to 2.13.0: on the project's machines that is the local
# CPU build; an unpinned torch would pull several GB of CUDA wheels), starts a loopback PostgreSQL server for
# the storage and multi-worker tests, and runs pytest on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[dev]"
eval "$(bash tests/postgres.sh)"
exec "$PY" -m pytest -n 2 -q "$@"
