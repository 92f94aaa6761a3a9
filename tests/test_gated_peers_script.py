"""docs/experiments/gated_peers.py: its arguments, and a CPU dry run on tiny shapes (Triton's interpreter)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from normtune.tuner.measure import peers_gated as pg

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "experiments" / "gated_peers.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gated_peers_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def autotune_restored(monkeypatch):
    from triton.runtime import autotuner

    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", autotuner.Autotuner.prune_configs)  # undone after


@pytest.mark.parametrize("argv, word", [
    (["--out", "x", "--sets", "issue,nope"], "--sets: unknown nope"),
    (["--out", "x", "--tokens", "4k"], "--tokens"),
    (["--out", "x", "--budget", "0"], "--budget"),
    (["--out", "x", "--device", "cpu"], "add --tiny"),
    (["--sets", "issue"], "--out"),
    (["--out", "x", "--peers", "hf-eager,liger"], "--peers: unknown liger"),
])
def test_bad_arguments_are_one_error_line_and_exit_1(script, argv, word, capsys):
    assert script.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and word in err and len(err.splitlines()) == 1


def test_an_out_path_that_is_a_file_is_one_error_line(script, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert script.main(["--out", str(tmp_path / "f"), "--device", "cpu", "--tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out ") and len(err.splitlines()) == 1


def test_the_scripts_peer_names_are_the_registry(script):
    assert list(script.PEERS) == list(pg.GATED_PEERS)


def test_arguments(script):
    args = script.parse(["--out", "d", "--sets", "mamba2", "--tokens", "1024,2048", "--compile-static"])
    assert args.sets == ["mamba2"] and args.tokens == [1024, 2048] and args.compile_static
    problems = script.problems(args)
    assert {p.gate_position for p in problems} == {"after"} and {p.M for p in problems} == {1024, 2048}
    assert len(script.problems(script.parse(["--out", "d"]))) > 20


def test_cpu_dry_run_checks_then_times_every_peer(script, tmp_path, autotune_restored):
    peers = "hf-eager,fla-gated,mamba" if importlib.util.find_spec("fla") else "hf-eager,mamba"
    assert script.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--peers", peers]) == 0
    report = json.loads((tmp_path / "gated_peers.json").read_text())
    rows = report["rows"]
    assert report["versions"]["torch"] and "flash-linear-attention" in report["versions"]
    assert "| before | 24 × 64 | 64 | fp32 | hf-eager |" in (tmp_path / "gated_peers.md").read_text()
    eager = [r for r in rows if r["peer"] == "hf-eager"]
    assert len(eager) == 4 and all(r["status"] == "ok" and r["block_us"] > 0 and r["backward_us"] > 0
                                   and max(r["errors"].values()) < 3e-2 for r in eager)
    fla = [r for r in rows if r["peer"] == "fla-gated"]
    assert all(r["status"] == ("ok" if r["gate"] == "before" else "unsupported") for r in fla)
    if importlib.util.find_spec("mamba_ssm") is None:
        assert all(r["status"] == "unavailable" for r in rows if r["peer"] == "mamba")


def test_a_wrong_peer_is_reported_not_timed(script, tmp_path, monkeypatch):
    class Wrong(pg.TransformersEager):
        name = "hf-eager"

        def prepare(self, problem, inputs):
            prepared = super().prepare(problem, inputs)
            block = prepared.block
            prepared.block = lambda: tuple(g * 1.1 for g in block())
            return prepared

    monkeypatch.setitem(pg.GATED_PEERS, "hf-eager", Wrong)
    args = script.parse(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--peers", "hf-eager"])
    rows = script.run(args)
    assert rows and all(r["status"] == "wrong" and r["block_us"] is None for r in rows)
    assert "wrong: y " in script.markdown(rows, "t")
