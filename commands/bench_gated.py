"""`normtune bench --gated`: gated RMSNorm calls, as hybrid models make them, timed for normtune and the peers of
the gated form."""

from __future__ import annotations

from pathlib import Path


def gated_calls(shapes: str | None, shapes_from: Path | None, tokens: str | None, dtype: str | None,
                interpret: bool) -> list:
    """The calls of --shapes' gated sets (qwen3-next, mamba2, gated-issue, gated-tiny) or of --shapes-from's hybrid
    model x --tokens, in --dtype; a ValueError naming the option otherwise."""
    from normtune.tuner import gated_shapes as G
    from normtune.tuner import model_shapes as MS

    from .common import parse_dtype

    dt = parse_dtype(dtype) if dtype is not None else None
    if shapes_from is not None:
        if shapes is not None:
            raise ValueError(f"--shapes {shapes} and --shapes-from {shapes_from} both name the shapes: give one")
        counts = MS.parse_tokens(tokens) if tokens is not None else list(MS.DEFAULT_TOKENS)
        try:
            return G.gated_problems_from_config(shapes_from, counts, dt or "bf16")
        except ValueError as err:
            raise ValueError(f"--shapes-from {err}") from None
    if tokens is not None:
        raise ValueError(f"--tokens {tokens}: token counts go with --shapes-from CONFIG.json")
    spec = shapes if shapes is not None else ("gated-tiny" if interpret else "qwen3-next,mamba2")
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in G.GATED_PRESETS]
    if bad or not names:
        raise ValueError(f"--shapes {spec} with --gated: use a comma list of the gated sets "
                         f"{', '.join(G.GATED_PRESETS)}, or --shapes-from a hybrid model's config.json")
    return G.gated_set([G.GATED_PRESETS[n] for n in names], dt or ("fp32" if interpret else "bf16"))


def check_gated_options(peers: str, config: str, residual: bool, db: str | None) -> list[str]:
    """The gated peers' names ('all', 'none' or a comma list); the options the gated bench does not take refused."""
    from normtune.tuner.measure.peers_gated import parse_gated_peers

    if residual:
        raise ValueError("--gated with --residual: the gated form has no residual stream; drop one of them")
    if db:
        raise ValueError("--db with --gated: the gated bench writes its files only; drop --db")
    if config == "default":
        raise ValueError("--config default is not offered with --gated: use table (normtune's runtime choice, as a "
                         "user's call gets) or an explicit config")
    return [] if peers.strip().lower() == "none" else parse_gated_peers(peers)


def run_gated(console, info, calls, peer_names, config: str, cold, timing, out: Path):
    from normtune.tuner.measure import bench as B
    from normtune.tuner.measure import bench_gated as BG
    from normtune.tuner.measure import bench_output

    from .bench_residual import run_block_bench
    from .common import run_checked

    explicit = None if config == "table" else run_checked(B.parse_config_option, config)
    run_checked(bench_output.check_out_dir, out)
    opts = BG.GatedBenchOptions(calls=calls, peers=peer_names, config=explicit, cold=cold, timing=timing)

    run_block_bench(console, BG, BG.run_gated_bench, opts, info, out)
