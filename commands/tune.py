"""`normtune tune`: a bare GPU to a validated, gated table in one command (`normtune.tuner.tune`)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer import Option as Opt

from .common import (CLIError, Device, Gpu, Interpret, Norms, ShapesFrom, Tokens, WritingStorage,
                     check_writable_file, device_info, gated_presets, parse_dtype, parse_list,
                     parse_shapes_option, positive_seconds, problems_for, problems_option, refuse, run_checked,
                     use_interpreter, user_db, with_residual)
from .devices import compile_processes, parse_devices

FORMS = ("plain", "residual", "gated")


def _shape_sets(spec: str | None, interpret: bool) -> list[tuple[int, int]]:
    """--shapes as a comma list of sets (presets, files, MxN); never the held-out preset."""
    from normtune.tuner.shapes import PRESETS, TUNE_DEFAULT

    spec = ("tiny" if interpret else ",".join(TUNE_DEFAULT)) if spec is None else spec
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        return parse_shapes_option(spec, interpret)  # refused, as every command refuses no shapes
    if "heldout" in items:
        raise CLIError("--shapes heldout: the held-out preset is kept for measuring the finished table (normtune "
                       "validate, normtune compare); a tune never sweeps it: use seed, llm, few, span, a file or "
                       "MxN shapes")
    named = [s for s in items if s in PRESETS or os.path.isfile(s)]
    explicit = [s for s in items if s not in named]
    shapes = [shape for s in named for shape in parse_shapes_option(s, interpret)]
    if explicit:
        shapes += parse_shapes_option(",".join(explicit), interpret)
    return list(dict.fromkeys(shapes))


def _problems(shapes, shapes_from, tokens, norm, dtype, forms, interpret):
    """The plan's problems: every norm x shape x dtype in each form, or the model's norms (their residual form on
    the hidden size); the gated form's from the gated presets in --shapes (qwen3-next, mamba2, ...) or the
    model's gated norms; those of the held-out preset left out (with a note). Returns (problems, notes)."""
    from normtune.kernels.config import NORMS
    from normtune.tuner.tune.plan import without_heldout_preset

    kinds = parse_list(forms, FORMS, "--forms")
    dtypes = [parse_dtype(d) for d in dtype.split(",") if d.strip()] if dtype else [None]
    notes, plain, gated = [], [], []
    if shapes_from is not None:
        if shapes is not None:
            raise CLIError(f"--shapes {shapes} and --shapes-from {shapes_from} both name the shapes: give one of them")
        hidden = None
        for dt in dtypes:
            found, model = problems_option(None, shapes_from, tokens, norm, dt, None, interpret=interpret)
            plain += [p for p in found if p.gate is None]
            gated += [p for p in found if p.gate is not None]
            hidden = model.norms[0].N
            gated_here = [p for p in found if p.gate is not None]
            notes.append(f"--shapes-from {model.describe()}" + (
                f"; gated RMSNorm (the norm {gated_here[0].gate} the gate) {', '.join(sorted({str(p.N) for p in gated_here}))}"
                " wide" if gated_here else ""))
        residual = [p for p in plain if p.N == hidden and p.has_weight]
    else:
        if tokens is not None:
            raise CLIError(f"--tokens {tokens}: token counts go with --shapes-from CONFIG.json")
        norms = parse_list(norm, NORMS, "--norm") if norm is not None else list(NORMS)
        rest = shapes
        for dt in dtypes:
            found, rest = gated_presets(shapes, dt or "bf16", None, norms if norm is not None else None, None,
                                        "input")
            gated += found
        shape_list = [] if gated and rest is None else _shape_sets(rest, interpret)
        for dt in dtypes:
            plain += problems_for(norms, dt or "bf16", None, shape_list, bias=None, zero_centered=False,
                                  save="input")
        residual = plain
    problems = (plain if "plain" in kinds else []) + (with_residual(residual, True, None) if "residual" in kinds
                                                      else []) + (gated if "gated" in kinds else [])
    problems, dropped = without_heldout_preset(list(dict.fromkeys(problems)))
    if dropped:
        notes.append(f"left out {len(dropped)} problems of the held-out preset's shapes (kept for measuring the "
                     "finished table): " + ", ".join(sorted({f"{p.M}x{p.N}" for p in dropped})))
    return problems, list(dict.fromkeys(notes))


def _outputs(out: Path | None, report: Path | None, key: str, interpret: bool) -> tuple[Path, Path]:
    from normtune.kernels.select.table_chain import user_table_path

    if out is None:
        if interpret:
            raise CLIError("--interpret: an interpreter table never tunes a GPU, so it is not written as your user "
                           "table: pass --out FILE")
        out = user_table_path(key)
    check_writable_file(out, "--out")
    report = report if report is not None else out.with_name(out.stem + "-tune")
    try:
        report.mkdir(parents=True, exist_ok=True)
        probe = report / ".normtune-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise CLIError(f"--report {report}: cannot write there ({err.strerror or err}); pass a writable folder") \
            from None
    return out, report


def _warm_start(spec: str | None, info, as_new_gpu: bool):
    if spec is None:
        return None
    from normtune.tuner.tune import warm

    table = warm.resolve(spec)
    if as_new_gpu and not info.interpret and table.gpu_key == info.key:
        raise CLIError(f"--from {spec}: a table of this GPU ({info.key}), which --as-new-gpu hides: warm-start from "
                       f"another GPU's table ({', '.join(k for k in warm.shipped_keys() if k != info.key) or 'none'})")
    return table


def _incumbent(info, as_new_gpu: bool):
    """The table the runtime would use here now (none as a new GPU, none for interpreter timings)."""
    if as_new_gpu:
        return None
    from normtune.kernels.select.table_chain import choose_table

    cc = tuple(int(x) for x in info.compute_capability.split(".")) if info.compute_capability else None
    table = choose_table(None if info.interpret else info.name, cc).table
    return table if table is not None and table.interpret == info.interpret else None


def tune(
    gpu: Gpu = "auto",
    shapes: Annotated[Optional[str], Opt("--shapes", help=(
        "Comma list of shape sets: seed, llm, few, span, tiny, FILE (one MxN per line), MxN; gated RMSNorm sets: "
        "qwen3-next, mamba2, gated-issue, gated-tiny; never heldout [default: seed,llm,few,span; tiny with "
        "--interpret]"
    ))] = None,
    shapes_from: ShapesFrom = None,
    tokens: Tokens = None,
    norm: Norms = None,
    dtype: Annotated[Optional[str], Opt("--dtype", help=(
        "Comma list of activation dtypes: bf16, fp16, fp32 [default: bf16; with --shapes-from, the model's]"))] = None,
    forms: Annotated[str, Opt(help="Comma list: plain (the norm alone), residual (the fused residual add), gated "
                                   "(the gated RMSNorm of --shapes' gated sets or a hybrid model's config)")] =
    "plain,residual,gated",
    trials: Annotated[int, Opt(help="The most sweep trials one problem gets")] = 40,
    heldout: Annotated[int, Opt("--heldout", help="Held-out shapes generated per problem family")] = 4,
    reference_trials: Annotated[int, Opt(help="Trials of the unseeded reference sweep per held-out shape")] = 8,
    time_budget: Annotated[Optional[float], Opt(help=(
        "Hard wall-clock limit in seconds; the table at the end is the best so far (run again to continue)"))] =
    None,
    warm_from: Annotated[Optional[str], Opt("--from", help=(
        "Warm start: a shipped table's GPU key (h100, h200) or a table file; its rules seed each problem's sweep "
        "(measured, never trusted)"))] = None,
    as_new_gpu: Annotated[bool, Opt("--as-new-gpu", help=(
        "Tune as if this GPU had no table: its shipped and user tables are hidden from the whole run"))] = False,
    db: WritingStorage = None,
    device: Device = 0,
    devices: Annotated[Optional[str], Opt(help="Comma list of CUDA devices: one sweep worker per GPU")] = None,
    compile_workers: Annotated[Optional[int], Opt(help=(
        "CPU processes compiling upcoming configs [default: 16 per GPU, within the host's cores]"))] = None,
    heartbeat_interval: Annotated[int, Opt(help="Seconds between a sweep worker's trial heartbeats")] = 20,
    grace_period: Annotated[int, Opt(help=(
        "Seconds without a heartbeat before a worker counts as dead (a killed run's trials are taken over then)"))]
    = 60,
    out: Annotated[Optional[Path], Opt(help="The table file [default: the user table <user dir>/<gpu>.json]")] =
    None,
    report: Annotated[Optional[Path], Opt(help="The report folder [default: beside the table, <table>-tune]")] =
    None,
    interpret: Interpret = False,
):
    """Tune this GPU in one command: sweep both norms (plain and fused residual), fit a table, validate it on
    generated held-out shapes, sweep again where it is weakest, gate it against the analytic default and the
    incumbent table, write it (the user table by default) and a report. Resumable: the same command continues."""
    started = time.monotonic()
    if interpret:  # before Triton is imported, so that its language's own jit helpers are interpreted too
        os.environ["TRITON_INTERPRET"] = "1"
    run_checked(use_interpreter, interpret)
    from rich.console import Console

    console = Console(stderr=True)
    if time_budget is not None:
        run_checked(positive_seconds, time_budget, "--time-budget")
    for option, value in (("--trials", trials), ("--heldout", heldout), ("--reference-trials", reference_trials),
                          ("--heartbeat-interval", heartbeat_interval)):
        if value < 1:
            run_checked(refuse, f"{option} {value}: give a whole number of at least 1")
    if grace_period <= heartbeat_interval:
        run_checked(refuse, f"--grace-period {grace_period} must exceed --heartbeat-interval {heartbeat_interval}: a "
                            "live worker's trial would be taken over")
    device_list = run_checked(parse_devices, devices)
    if device_list and interpret:
        run_checked(refuse, "--devices needs GPUs; --interpret runs one worker on CPU")
    if as_new_gpu:
        from normtune.kernels.select.table_chain import ENV_VAR, HIDE_VAR

        if os.environ.get(ENV_VAR):
            run_checked(refuse, f"--as-new-gpu: ${ENV_VAR} names a table ({os.environ[ENV_VAR]}) that would stand in "
                                "for the hidden ones: unset it")
        os.environ[HIDE_VAR] = "1"  # inherited by every process the tune starts
    problems, notes = run_checked(_problems, shapes, shapes_from, tokens, norm, dtype, forms, interpret)
    info = run_checked(device_info, gpu, interpret, device_list[0] if device_list else device)
    key = info.key
    # The tables read (--from, the incumbent) are checked before the report folder is made.
    warm_table = run_checked(_warm_start, warm_from, info, as_new_gpu)
    incumbent = run_checked(_incumbent, info, as_new_gpu)
    workers = run_checked(compile_processes, compile_workers, len(device_list or ()) or 1)
    out, report = run_checked(_outputs, out, report, key, interpret)
    from normtune.tuner.tune import runner

    db = run_checked(user_db, db)
    code = run_checked(runner.tune, console, runner.Options(
        key=key, info=info, problems=problems, trials=trials, heldout=heldout, reference_trials=reference_trials,
        budget_s=time_budget, started=started, warm=warm_table, as_new_gpu=as_new_gpu, db=db,
        device=device_list[0] if device_list else device, devices=device_list, compile_workers=workers, out=out,
        report=report, incumbent=incumbent, notes=notes,
        heartbeat_interval=heartbeat_interval, grace_period=grace_period))
    raise typer.Exit(code)

