"""`tests/run.sh` (the CI command) stops the PostgreSQL server it started, also when pytest fails."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Stands in for Python: `-m pip` does nothing; `-m pytest` reports the server it was given and fails.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$2" = "pip" ]; then exit 0; fi
echo "server: $NORMTUNE_TEST_POSTGRES_URL"
exit 3
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.postgres
def test_run_sh_stops_its_postgres_server_when_pytest_fails(tmp_path):
    if not (shutil.which("pg_ctl") or list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))):
        pytest.skip("no PostgreSQL server binaries here")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    # A cluster of its own (outside tmp_path: the server's user must be able to reach it), on a free port.
    cluster = Path(f"/tmp/normtune-pg-runtest-{uuid.uuid4().hex[:8]}")
    port = _free_port()
    env = dict(os.environ, PYTHON=str(fake), NORMTUNE_PG_DIR=str(cluster), NORMTUNE_PG_PORT=str(port))
    env.pop("NORMTUNE_TEST_POSTGRES_URL", None)
    try:
        result = subprocess.run(["bash", "tests/run.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=240)
        assert result.returncode == 3, result.stdout + result.stderr  # pytest's status, passed on
        assert f"server: postgresql://normtune:normtune@127.0.0.1:{port}/normtune" in result.stdout
        assert not (cluster / "postmaster.pid").exists(), "tests/run.sh left its PostgreSQL server running"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something still listens on port {port}"
    finally:
        subprocess.run(["bash", "tests/postgres.sh", "--stop"], cwd=REPO, env=env, capture_output=True, timeout=60)
        shutil.rmtree(cluster, ignore_errors=True)
        Path(f"{cluster}.log").unlink(missing_ok=True)
