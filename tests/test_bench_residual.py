"""The residual block's bench (`normtune bench --residual`): its peers' plumbing on CPU (torch eager and
torch.compile run; quack and Liger, not installed here, are a one-line "unavailable" each), values checked
against float64 before anything is timed, the summary, the files, and the command's one-line refusals; and Liger's
CuTe DSL backend as a peer of the plain norms."""

from __future__ import annotations

import json

import pytest
import torch
from bench_support import StandInTiming
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.device import interpret_mode
from normtune.tuner.measure import bench_residual as R
from normtune.tuner.measure import peers_residual as P
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.peers import PEERS, LigerCuteDSL, PeerUnavailable, liger_backend_call, parse_peers

needs_interpreter = pytest.mark.skipif(not interpret_mode(), reason="runs normtune's kernels on CPU: set "
                                                                    "TRITON_INTERPRET=1")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _problem(norm="rms_norm", residual_dtype=None, M=6, N=40):
    return R.residual_problem(norm, M, N, "bf16", None, residual_dtype)


# torch.compile costs seconds per shape on CPU: one case of it, the eager block on all four.
@pytest.mark.parametrize("name,norm,residual_dtype", [
    ("torch", "rms_norm", None), ("torch", "rms_norm", "fp32"), ("torch", "layer_norm", None),
    ("torch", "layer_norm", "fp32"), ("compile", "layer_norm", "fp32")])
def test_cpu_peers_compute_the_block(name, norm, residual_dtype):
    problem = _problem(norm, residual_dtype)
    inputs = P.make_inputs(problem, "cpu")
    ref = P.reference(problem, inputs)
    prepared = P.RESIDUAL_PEERS[name]().prepare(problem, inputs)
    for call in (prepared.block, prepared.backward, prepared.backward):  # the retained graph runs again
        errors, bad = R.check(problem, call(), ref)
        assert bad == "" and set(errors) >= {"dx", "dresidual", "dw"}, errors
    y, h = prepared.forward()
    assert y.dtype == torch.bfloat16 and h.dtype == (torch.float32 if residual_dtype else torch.bfloat16)
    assert R.relative_error(h, ref["h"]) < 1e-2


def test_the_gradient_of_h_is_added_to_both_inputs():
    """dx = dresidual = dh + norm_backward(dy): without dh the reference differs (the check would catch a peer
    that drops it)."""
    problem = _problem()
    inputs = P.make_inputs(problem, "cpu")
    ref = P.reference(problem, inputs)
    torch.testing.assert_close(ref["dx"], ref["dresidual"])
    no_dh = P.reference(problem, P.BlockInputs(inputs.x, inputs.residual, inputs.weight, inputs.bias, inputs.dy,
                                               torch.zeros_like(inputs.dh)))
    torch.testing.assert_close(ref["dx"] - no_dh["dx"], inputs.dh.double())
    errors, bad = R.check(problem, (no_dh["dx"], no_dh["dresidual"], no_dh["dw"], None), ref)
    assert "dx relative error" in bad and "dresidual relative error" in bad


@pytest.mark.parametrize("name,needle", [("quack", "quack is not importable"), ("quack-w16", "quack is not importable"),
                                         ("liger", "liger_kernel.functional is not importable"),
                                         ("liger-cutedsl", "liger_kernel.functional is not importable")])
def test_missing_libraries_are_a_message(name, needle):
    if name.startswith("quack"):
        try:
            import quack  # noqa: F401
            pytest.skip("quack is installed")
        except ImportError:
            pass
    else:
        try:
            import liger_kernel  # noqa: F401
            pytest.skip("liger-kernel is installed")
        except ImportError:
            pass
    problem = _problem()
    with pytest.raises(PeerUnavailable, match=needle):
        P.RESIDUAL_PEERS[name]().prepare(problem, P.make_inputs(problem, "cpu"))


def test_what_the_fused_peers_do_not_offer_is_named():
    assert "no fused residual LayerNorm" in P.RESIDUAL_PEERS["quack"]().supports(_problem("layer_norm"))
    assert "x's dtype" in P.RESIDUAL_PEERS["liger"]().supports(_problem(residual_dtype="fp32"))
    assert P.RESIDUAL_PEERS["quack"]().supports(_problem(residual_dtype="fp32")) is None


def test_peer_names_are_checked():
    assert P.parse_residual_peers("all") == list(P.RESIDUAL_PEERS)
    assert P.parse_residual_peers("torch, liger-cutedsl") == ["torch", "liger-cutedsl"]
    with pytest.raises(ValueError, match="unknown residual peer.*apex.*allowed: all, none, torch"):
        P.parse_residual_peers("torch,apex")


def test_liger_backend_keyword_follows_its_signature():
    def new(x, *, impl=None, in_place=True):
        return ("impl", impl, in_place)

    def old(x, *, backend=None):
        return ("backend", backend)

    assert liger_backend_call(new, "nvidia-cutedsl")(1, in_place=False) == ("impl", "nvidia-cutedsl", False)
    assert liger_backend_call(old, "nvidia-cutedsl")(1) == ("backend", "nvidia-cutedsl")


def test_liger_cutedsl_is_a_plain_norm_peer():
    assert "liger-cutedsl" in PEERS and "liger-cutedsl" in parse_peers("all")
    try:
        import liger_kernel  # noqa: F401
        pytest.skip("liger-kernel is installed")
    except ImportError:
        pass
    from normtune.kernels.config import Problem

    x = torch.randn(4, 32)
    with pytest.raises(PeerUnavailable, match="pip install liger-kernel"):
        LigerCuteDSL().prepare(Problem("rms_norm", 4, 32, "fp32"), x, torch.ones(32), None, x)


@needs_interpreter
def test_bench_rows_summary_and_files(tmp_path):
    info = detect(interpret=True)
    opts = R.ResidualBenchOptions(norms=["rms_norm"], dtype="bf16", shapes=[(5, 48)], peers=["torch", "quack"])
    session = StandInTiming()
    report = R.run_residual_bench(opts, info, session=session)
    rows = {r["impl"]: r for r in report.rows}
    assert list(rows) == ["normtune", "torch", "quack"]
    assert rows["normtune"]["status"] == "ok" and rows["torch"]["status"] == "ok", rows
    assert rows["quack"]["status"] == "unavailable" and "interpreter" in rows["quack"]["error"]
    for impl in ("normtune", "torch"):
        r = rows[impl]
        assert r["block_us"] and r["backward_us"] and r["forward_us"] and r["rel_err_dx"] < 3e-2
        assert r["block_host_us"] > 0 and r["backward_host_us"] > 0, r  # host-timed in the shared rounds
    assert rows["quack"]["block_host_us"] is None
    (line,) = R.summary(report.rows)
    assert line["best_peer_block"] == "torch"
    assert line["block_speedup"] == pytest.approx(rows["torch"]["block_us"] / rows["normtune"]["block_us"])
    paths = R.write_all(report, tmp_path)
    data = json.loads(paths[0].read_text())
    assert data["summary"][0]["norm"] == "rms_norm" and len(data["rows"]) == 3
    text = paths[1].read_text()
    assert "| rms_norm | 5×48 |" in text and "quack: unavailable" in text
    assert "interpreter wall-clock" in text and "GPU time" not in text.replace("never GPU time", "")
    assert "| case | normtune | torch |" in text and "| rms_norm 5×48 |" in text  # host µs per implementation


@needs_interpreter
def test_a_bench_stopped_part_way_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
    """The command writes its files after every shape (`checkpoint`): stopped during the second, they hold the
    first shape's rows, with "finished" null in the provenance."""
    real = R.make_inputs

    def stopped_at_the_second(problem, device):
        if problem.M == 7:
            raise KeyboardInterrupt
        return real(problem, device)

    monkeypatch.setattr(R, "make_inputs", stopped_at_the_second)
    opts = R.ResidualBenchOptions(norms=["rms_norm"], dtype="bf16", shapes=[(5, 48), (7, 48)], peers=[])
    with pytest.raises(KeyboardInterrupt):
        R.run_residual_bench(opts, detect(interpret=True), session=StandInTiming(),
                             checkpoint=lambda report: R.write_all(report, tmp_path))
    data = json.loads((tmp_path / "residual.json").read_text())
    assert data["provenance"]["finished"] is None
    assert [(r["impl"], r["M"], r["status"]) for r in data["rows"]] == [("normtune", 5, "ok")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["residual.json", "residual.md"]


def test_a_wrong_implementation_is_reported_not_timed(monkeypatch):
    class Wrong(P.TorchEager):
        def prepare(self, problem, inputs):
            prepared = super().prepare(problem, inputs)
            good = prepared.block
            prepared.block = lambda: tuple(g * 1.5 if g is not None else None for g in good())
            return prepared

    problem = _problem()
    inputs = P.make_inputs(problem, "cpu")
    session = StandInTiming()
    host = []
    out = R._time_impl(session, Wrong(), problem, inputs, P.reference(problem, inputs), row={}, host=host)
    assert out["status"] == "error" and "wrong values: dx relative error" in out["error"]
    assert session.calls == 0 and host == []  # neither GPU- nor host-timed


@pytest.mark.parametrize("args,needles", [
    (["--residual-dtype", "fp32"], ["--residual-dtype fp32", "add --residual"]),
    (["--residual", "--residual-dtype", "fp16"], ["--residual-dtype fp16"]),
    (["--residual", "--peers", "torch,apex"], ["unknown residual peer", "apex"]),
    (["--residual", "--config", "default"], ["--config default", "--residual"]),
    (["--residual", "--db", "sqlite:///x.db"], ["--db with --residual"]),
])
def test_command_refusals_are_one_line(args, needles, tmp_path):
    result = runner.invoke(app, ["bench", "--interpret", "--shapes", "4x64", "--out", str(tmp_path), *args])
    assert result.exit_code == 1, result.output
    text = result.stderr if result.stderr is not None else result.output
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@needs_interpreter
def test_command_writes_the_residual_report(tmp_path):
    result = runner.invoke(app, ["bench", "--interpret", "--residual", "--shapes", "3x40", "--norm", "rms_norm",
                                 "--peers", "torch,liger", "--budget", "0.01", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "residual.json").read_text())
    status = {r["impl"]: r["status"] for r in data["rows"]}
    assert status == {"normtune": "ok", "torch": "ok", "liger": "unavailable"}
    assert (tmp_path / "residual.md").exists()
