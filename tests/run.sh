#!/usr/bin/env bash
# Set up and run the whole test suite on a CPU-only machine (the kernels run in Triton's interpreter):
#   bash tests/run.sh [extra pytest args]
# Installs normtune with its test extras (torch pinned to 2.13.0, the version the CPU suite runs on, so that an
# installed CPU build is kept; an unpinned torch would pull several GB of CUDA wheels), starts a loopback
# PostgreSQL server for the storage and multi-worker tests, runs pytest on 2 workers, and stops that server again
# on exit (whether pytest passed, failed or was interrupted). A server that was already running before is left running.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[dev]"
DIR="${NORMTUNE_PG_DIR:-/tmp/normtune-pg-$(id -un)}"
if [ -f "$DIR/postmaster.pid" ] && kill -0 "$(head -n 1 "$DIR/postmaster.pid")" 2>/dev/null; then
    started_here=0
else
    started_here=1
fi
stop_postgres() { if [ "$started_here" = 1 ]; then bash tests/postgres.sh --stop || true; fi; }
trap stop_postgres EXIT
eval "$(bash tests/postgres.sh)"
# Python keeps the modules it compiles (in a folder outside the checkout): under PYTHONDONTWRITEBYTECODE each worker
# rewrote and compiled every test module again, and so did every Python process the tests start (sweeps, their
# measuring processes, CLI runs) with normtune's sources.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${TMPDIR:-/tmp}/normtune-pycache-$(id -un)}"
# One intra-op thread per process: the 2 workers (and the sweeps they start) already keep the cores busy, and tiny
# tensors only lose time to threads synchronizing.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --dist loadgroup: tests marked xdist_group (those sharing an expensive module fixture) run on one worker, the
# others are spread one by one.
"$PY" -m pytest -n 2 --dist loadgroup -q --durations=30 "$@"   # the 30 slowest tests, to keep the suite within 10 minutes
