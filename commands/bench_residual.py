"""`normtune bench --residual`: the residual block timed for normtune and the peers with the fused form."""

from __future__ import annotations

from pathlib import Path


def check_residual_options(peers: str, config: str) -> list[str]:
    """The residual peers' names; --config checked before anything is measured (ValueError naming it). The
    problems' own rules (--residual-dtype) are checked where they are built (commands.common.with_residual)."""
    from normtune.tuner.measure.peers_residual import parse_residual_peers

    names = parse_residual_peers(peers)
    if config == "default":
        raise ValueError("--config default is not offered with --residual: use table (normtune's runtime choice, "
                         "as a user's call gets) or an explicit config")
    return names


def run_residual(console, info, norms, dtype, shapes, peer_names, residual_dtype, weight_dtype, config: str, cold,
                 timing, out: Path):
    from normtune.tuner.measure import bench as B
    from normtune.tuner.measure import bench_output
    from normtune.tuner.measure import bench_residual as R

    from .common import run_checked

    explicit = None if config == "table" else run_checked(B.parse_config_option, config)
    run_checked(bench_output.check_out_dir, out)
    opts = R.ResidualBenchOptions(norms=norms, dtype=dtype, shapes=shapes, peers=peer_names,
                                  residual_dtype=residual_dtype, weight_dtype=weight_dtype, config=explicit,
                                  cold=cold, timing=timing)

    run_block_bench(console, R, R.run_residual_bench, opts, info, out)


def run_block_bench(console, module, run, opts, info, out: Path) -> None:
    """A block bench (residual or gated) as the command runs it: `run(opts, info, progress=…, checkpoint=…)`
    printing a line per row as it lands and writing the files (`module.write_all`) after each shape, then the
    whole report written and printed (`module.to_markdown`)."""
    from .common import refuse, run_checked

    def on_row(msg, row):
        t = row.get("block_us") if row else None
        console.print(f"{msg}: " + (f"{t:.1f} µs block, {row['backward_us']:.1f} µs backward" if t else
                                    f"{row['status']} ({row['error']})"), markup=False, highlight=False)

    def write(report):
        try:
            return module.write_all(report, out)
        except OSError as err:
            run_checked(refuse, f"writing {out} failed ({err})")

    # Each finished shape's rows go to the files at once: a bench stopped part way keeps what it measured.
    report = run_checked(run, opts, info, progress=on_row, checkpoint=write)
    paths = write(report)
    console.print(module.to_markdown(report), markup=False, highlight=False)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
