"""`normtune bench --gated`: gated RMSNorm calls for normtune and the gated peers on the same inputs, values
checked against float64 before anything is timed (transformers' eager module runs on CPU; the GPU-only peers are
a one-line "unavailable" in the interpreter), the summary, the files, and the command's one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from bench_support import StandInTiming
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.device import interpret_mode
from normtune.tuner.gated_shapes import GatedProblem
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure import bench_gated as BG
from normtune.tuner.measure import peers_gated as pg

needs_interpreter = pytest.mark.skipif(not interpret_mode(), reason="runs normtune's kernels on CPU: set "
                                                                    "TRITON_INTERPRET=1")
runner = CliRunner()
CALL = GatedProblem(8, 64, "after", 32, "fp32", eps=1e-5)  # two groups of 32 columns


@needs_interpreter
def test_bench_rows_summary_and_files(tmp_path):
    pytest.importorskip("transformers")
    opts = BG.GatedBenchOptions(calls=[CALL], peers=["hf-eager", "fla-fn"])
    report = BG.run_gated_bench(opts, detect(interpret=True), session=StandInTiming())
    rows = {r["impl"]: r for r in report.rows}
    assert list(rows) == ["normtune", "hf-eager", "fla-fn"]
    assert rows["normtune"]["status"] == "ok" and rows["hf-eager"]["status"] == "ok", rows
    assert rows["fla-fn"]["status"] == "unavailable" and "interpreter" in rows["fla-fn"]["error"]
    for impl in ("normtune", "hf-eager"):
        r = rows[impl]
        assert r["block_us"] and r["backward_us"] and r["forward_us"], r
        assert set(r["errors"]) == {"y", "dx", "dz", "dw"} and max(r["errors"].values()) < 1e-4, r["errors"]
        assert r["block_host_us"] > 0 and r["backward_host_us"] > 0, r  # host-timed in the shared rounds
    assert rows["fla-fn"]["block_host_us"] is None
    (line,) = BG.summary(report.rows)
    assert line["group"] == 32 and line["best_peer_block"] == "hf-eager"
    assert line["block_speedup"] == pytest.approx(rows["hf-eager"]["block_us"] / rows["normtune"]["block_us"])
    paths = BG.write_all(report, tmp_path)
    data = json.loads(paths[0].read_text())
    assert data["summary"][0]["gate"] == "after" and len(data["rows"]) == 3
    text = paths[1].read_text()
    assert "| after | 8 × 64 | 32 | fp32 |" in text and "fla-fn: unavailable" in text
    assert "interpreter wall-clock" in text
    assert "| case | normtune | hf-eager |" in text and "| after 8 × 64 group 32 |" in text  # host µs per impl


@needs_interpreter
def test_a_bench_stopped_part_way_keeps_the_calls_it_finished(tmp_path, monkeypatch):
    """The command writes its files after every call (`checkpoint`), each file replaced whole: stopped during the
    second call, they hold the first call's rows, with "finished" null in the provenance."""
    calls = [CALL, GatedProblem(4, 64, "after", 32, "fp32", eps=1e-5)]
    real = BG.make_inputs

    def stopped_at_the_second(call, device):
        if call is calls[1]:
            raise KeyboardInterrupt
        return real(call, device)

    monkeypatch.setattr(BG, "make_inputs", stopped_at_the_second)
    opts = BG.GatedBenchOptions(calls=calls, peers=[])
    with pytest.raises(KeyboardInterrupt):
        BG.run_gated_bench(opts, detect(interpret=True), session=StandInTiming(),
                           checkpoint=lambda report: BG.write_all(report, tmp_path))
    data = json.loads((tmp_path / "gated.json").read_text())
    assert data["provenance"]["finished"] is None
    assert [(r["impl"], r["M"], r["status"]) for r in data["rows"]] == [("normtune", 8, "ok")]
    assert "| after | 8 × 64 | 32 |" in (tmp_path / "gated.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gated.json", "gated.md"]  # no temporary left


def test_a_wrong_implementation_is_reported_not_timed():
    pytest.importorskip("transformers")

    class Wrong(pg.TransformersEager):
        def prepare(self, problem, inputs):
            prepared = super().prepare(problem, inputs)
            good = prepared.block
            prepared.block = lambda: tuple(g * 1.5 for g in good())
            return prepared

    inputs = pg.make_inputs(CALL, "cpu")
    session = StandInTiming()
    host = []
    out = BG._time_impl(session, Wrong(), CALL, inputs, pg.reference(CALL, inputs), row={}, host=host)
    assert out["status"] == "error" and "wrong values" in out["error"] and "dz" in out["error"]
    assert session.calls == 0 and host == []  # neither GPU- nor host-timed


@pytest.mark.parametrize("args,needles", [
    (["--shapes", "4x64"], ["--shapes 4x64 with --gated", "qwen3-next"]),
    (["--shapes", "gated-tiny", "--residual"], ["--gated with --residual"]),
    (["--shapes", "gated-tiny", "--peers", "hf-eager,apex"], ["unknown gated peer", "apex"]),
    (["--shapes", "gated-tiny", "--config", "default"], ["--config default", "--gated"]),
    (["--shapes", "gated-tiny", "--db", "sqlite:///x.db"], ["--db with --gated"]),
    (["--shapes", "gated-tiny", "--norm", "layer_norm"], ["--gated", "drop --norm"]),
    (["--tokens", "8"], ["--tokens 8", "--shapes-from"]),
])
def test_command_refusals_are_one_line(args, needles, tmp_path):
    result = runner.invoke(app, ["bench", "--interpret", "--gated", "--out", str(tmp_path), *args])
    assert result.exit_code == 1, result.output
    text = result.stderr if result.stderr is not None else result.output
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_calls_of_a_hybrid_config_keep_their_groups(tmp_path):
    from normtune.commands.bench_gated import gated_calls

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mamba2", "hidden_size": 64, "expand": 2, "n_groups": 2,
                                  "num_heads": 8, "head_dim": 16}))
    (call,) = gated_calls(None, config, "16", None, True)
    assert (call.M, call.N, call.group, call.gate_position) == (16, 128, 64, "after")
    assert call.problem.N == 64  # what the tuner plans for it: each group's columns


@needs_interpreter
def test_command_times_a_hybrid_models_call_with_the_eager_peer(tmp_path):
    """The whole command on CPU: a Mamba-2 config's call (8 tokens, width 64 in 2 groups), normtune against
    transformers' eager MambaRMSNormGated on the same inputs, written as gated.json and gated.md."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mamba2", "hidden_size": 32, "expand": 2, "n_groups": 2,
                                  "num_heads": 4, "head_dim": 16}))
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", "--interpret", "--gated", "--shapes-from", str(config), "--tokens", "8",
                                 "--peers", "hf-eager", "--budget", "0.01", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "gated.json").read_text())["rows"]
    assert [(r["impl"], r["status"], r["M"], r["N"], r["group"]) for r in rows] == [
        ("normtune", "ok", 8, 64, 32), ("hf-eager", "ok", 8, 64, 32)], rows
    assert "| after | 8 × 64 | 32 |" in (out / "gated.md").read_text()


@pytest.mark.parametrize("init, whole, grouped", [
    ("group_size", {"group_size": 64}, {"group_size": 32}),
    ("n_groups", {"n_groups": 1}, {"n_groups": 2}),
    (None, {}, None),  # an older MambaRMSNormGated: the whole width only
])
def test_transformers_norm_after_the_gate_is_built_for_its_version(monkeypatch, init, whole, grouped):
    """MambaRMSNormGated's constructor differs between transformers versions: groups go to the argument the
    installed one has, and a version without one times whole-width calls and refuses grouped ones in one line."""
    import sys
    import types

    made = []

    class Norm(torch.nn.Module):
        if init == "group_size":
            def __init__(self, hidden_size, group_size, eps=1e-6):
                super().__init__()
                made.append({"group_size": group_size})
        elif init == "n_groups":
            def __init__(self, hidden_size, n_groups=1, eps=1e-6):
                super().__init__()
                made.append({"n_groups": n_groups})
        else:
            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                made.append({})

    fake = types.ModuleType("modeling_mamba2")
    fake.MambaRMSNormGated = Norm
    monkeypatch.setitem(sys.modules, "transformers.models.mamba2.modeling_mamba2", fake)
    _, name = pg.transformers_module(GatedProblem(8, 64, "after", None, "fp32"))
    assert name == "MambaRMSNormGated" and made[-1] == whole
    if grouped is None:
        with pytest.raises(pg.PeerUnavailable, match="whole width only"):
            pg.transformers_module(CALL)
    else:
        pg.transformers_module(CALL)
        assert made[-1] == grouped
