"""How `normtune emit` writes a table: atomically (a kill mid-write leaves the old table whole), never over a table
it did not write or that was changed since it wrote it (unless --force), keeping the replaced one as .bak."""

from __future__ import annotations

import builtins
import hashlib
import io
import json

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, kernel_1_config
from normtune.kernels.select.table_chain import HOME_VAR
from normtune.kernels.select.tables import read_table
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.store.database import Store

GPU = DeviceInfo(name="NVIDIA Test GPU X1", key="test-gpu-x1", compute_capability="9.0", sm_count=8,
                 l2_bytes=50 * 2**20, memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6", torch="2.6.0",
                 triton="3.2.0", normtune="0.1.0", git_revision="0123abcd", host="gpu-7", python="3.11.9",
                 interpret=False)
FAST = BackwardConfig(kernel_1_config(block_row=1, block_col=256, num_warps=4), Kernel2Config(128, 16, 4))
SLOW = BackwardConfig(kernel_1_config(block_row=2, block_col=256, num_warps=8), Kernel2Config(64, 32, 4))


def _db(tmp_path, fast_us: float = 5.0) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --gpu test-gpu-x1")
        for M in (64, 512):
            for cfg, us in ((FAST, fast_us), (SLOW, 9.0)):
                store.add_measurement(run, Problem("rms_norm", M, 256), cfg,
                                      MeasureResult(status="ok", median_us=us, p10_us=us, p90_us=us, reps=20),
                                      source="sweep")
        store.end_run(run)
    return url


@pytest.fixture
def home(tmp_path, monkeypatch):
    folder = tmp_path / "home"
    monkeypatch.setenv(HOME_VAR, str(folder))
    return folder


def _emit(url: str, *more: str):
    return CliRunner().invoke(app, ["emit", "--gpu", GPU.key, "--db", url, "--user", *more])


def _one_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_emit_user_refuses_a_hand_written_table_unless_forced(tmp_path, home):
    url = _db(tmp_path)
    path = home / f"{GPU.key}.json"
    home.mkdir()
    mine = '{"my": "table", "do not": "touch"}\n'
    path.write_text(mine)
    line = _one_error(_emit(url))
    assert str(path) in line and "was not written by normtune emit" in line and "--force" in line, line
    assert path.read_text() == mine and not (home / f"{GPU.key}.json.bak").exists()

    result = _emit(url, "--force")
    assert result.exit_code == 0, result.output
    assert read_table(str(path)).lookup(Problem("rms_norm", 100, 256)) == FAST
    assert (home / f"{GPU.key}.json.bak").read_text() == mine
    assert f"{GPU.key}.json.bak" in result.output.replace("\n", "")


def test_emit_user_refuses_a_table_changed_since_it_wrote_it(tmp_path, home):
    url = _db(tmp_path)
    assert _emit(url).exit_code == 0
    path = home / f"{GPU.key}.json"
    record = home / f"{GPU.key}.json.sha256"
    assert record.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {GPU.key}.json\n"
    # The same emission again: nothing to keep, nothing refused.
    assert _emit(url).exit_code == 0 and not (home / f"{GPU.key}.json.bak").exists()

    edited = path.read_text().replace('"num_warps": 4', '"num_warps": 2')  # emit's formatting, another value
    assert edited != path.read_text()
    path.write_text(edited)
    line = _one_error(_emit(url))
    assert "changed since normtune emit wrote it" in line and str(record) in line, line
    assert path.read_text() == edited


def test_emit_user_keeps_the_table_it_replaces(tmp_path, home):
    url = _db(tmp_path)
    assert _emit(url).exit_code == 0
    path = home / f"{GPU.key}.json"
    first = path.read_bytes()
    with Store(url) as store:  # a later sweep makes the table change
        run = store.start_run(GPU, kind="sweep", command_line="again")
        for M in (64, 512):
            store.add_measurement(run, Problem("rms_norm", M, 256), SLOW,
                                  MeasureResult(status="ok", median_us=1.0, p10_us=1.0, p90_us=1.0, reps=20),
                                  source="sweep")
        store.end_run(run)
    result = _emit(url)
    assert result.exit_code == 0, result.output
    assert path.read_bytes() != first and (home / f"{GPU.key}.json.bak").read_bytes() == first
    assert read_table(str(path)).gpu_key == GPU.key


def test_emit_over_a_table_written_by_emit_elsewhere_needs_no_force(tmp_path):
    """A table in emit's exact form without its record (a shipped table, a copy) is emit's to replace."""
    out = tmp_path / "t.json"
    first = CliRunner().invoke(app, ["emit", "--gpu", GPU.key, "--db", _db(tmp_path / "a"), "--out", str(out)])
    assert first.exit_code == 0, first.output
    (tmp_path / "t.json.sha256").unlink()
    old = out.read_bytes()
    result = CliRunner().invoke(app, ["emit", "--gpu", GPU.key, "--db", _db(tmp_path / "b", fast_us=4.0),
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() != old and (tmp_path / "t.json.bak").read_bytes() == old


def test_a_kill_while_writing_leaves_the_previous_table_whole(tmp_path, home, monkeypatch):
    """Killed at its first write (simulated: every file opened for writing raises at its first write()), emit
    leaves the user table it was replacing as it was, never a truncated file the runtime would refuse."""
    url = _db(tmp_path)
    assert _emit(url).exit_code == 0
    path = home / f"{GPU.key}.json"
    before = path.read_bytes()
    real_open = io.open

    class Killed(BaseException):
        pass

    class DiesOnWrite:
        def __init__(self, fh):
            self._fh = fh

        def write(self, data):
            raise Killed()

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._fh.close()

    def killing_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return DiesOnWrite(fh) if any(c in mode for c in "wax+") else fh

    with Store(url) as store:
        run = store.start_run(GPU, kind="sweep", command_line="again")
        store.add_measurement(run, Problem("rms_norm", 64, 256), SLOW,
                              MeasureResult(status="ok", median_us=1.0, p10_us=1.0, p90_us=1.0, reps=20),
                              source="sweep")
        store.end_run(run)
    monkeypatch.setattr(io, "open", killing_open)
    monkeypatch.setattr(builtins, "open", killing_open)
    with pytest.raises(Killed):
        CliRunner().invoke(app, ["emit", "--gpu", GPU.key, "--db", url, "--user"], catch_exceptions=False)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert json.loads(before) and read_table(str(path)).gpu_key == GPU.key
    assert sorted(p.name for p in home.iterdir()) == [f"{GPU.key}.json", f"{GPU.key}.json.sha256"]
