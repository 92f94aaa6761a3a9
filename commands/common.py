"""What every command shares: the options defined once (`Gpu`, `Norms`, `Shapes`, …), their parsing into values,
and the error handling that turns a known error into one `error: …` line and exit code 1."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer


def fail(message: str):
    """Print one error line and exit 1 (for option callbacks, which run outside `run_checked`)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


def _check_gpu(ctx: typer.Context, value: str) -> str:
    """--gpu against --interpret (an eager option, so already parsed): the interpreter's results are labelled
    'interpret', never a GPU's."""
    key = value.strip().lower()
    interpret = bool(ctx.params.get("interpret"))
    if interpret and key not in ("auto", "interpret"):
        fail(f"--gpu {value} cannot be combined with --interpret: interpreter results are labelled 'interpret'; "
             "drop --gpu (or pass --gpu auto)")
    if not interpret and key == "interpret":
        fail("--gpu interpret names the Triton interpreter's results: add --interpret, or name a GPU key such as "
             "h100")
    return value


# ------------------------------------------------------------------------------------------ shared options

Gpu = Annotated[str, typer.Option("--gpu", callback=_check_gpu,
                                  help="GPU key the results are for (h100, h200, …) or 'auto'. Must match the "
                                       "detected device; with --interpret only auto or interpret.")]
Norms = Annotated[str, typer.Option("--norm", help="Comma list: layer_norm, rms_norm.")]
Dtype = Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32.")]
Shapes = Annotated[Optional[str], typer.Option(
    "--shapes", help="seed | llm | heldout | tiny | FILE (one MxN per line) | 4096x8192,... "
                     "[default: seed on a GPU, tiny with --interpret]")]
Interpret = Annotated[bool, typer.Option("--interpret", is_eager=True,
                                         help="Run on CPU through the Triton interpreter (no GPU; timings are not "
                                              "GPU timings).")]
WeightDtype = Annotated[Optional[str], typer.Option("--weight-dtype", help="Weight dtype: bf16, fp16 or fp32 "
                                                                           "[default: the activation dtype]")]
Storage = Annotated[str, typer.Option("--db", "--storage", help="SQLAlchemy URL of the results database.")]
Device = Annotated[int, typer.Option("--device", help="CUDA device index.")]

DEFAULT_DB = "sqlite:///results.db"


class CLIError(Exception):
    """An error worth one line, not a traceback."""


def known_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [CLIError, ValueError, OSError]
    try:
        from normtune.tuner.store import StoreError

        errors.append(StoreError)
    except Exception:  # noqa: BLE001 - the store's optional dependencies may be missing
        pass
    try:
        from normtune.tuner.device import NoGPUError

        errors.append(NoGPUError)
    except Exception:  # noqa: BLE001
        pass
    return tuple(errors)


def run_checked(fn, *args, **kwargs):
    """Call a library function; known errors become 'error: …' and exit code 1."""
    try:
        return fn(*args, **kwargs)
    except known_errors() as err:
        fail(one_line(err))


def one_line(err: BaseException) -> str:
    """An error's message on one line (SQLAlchemy appends a 'Background on this error' link line)."""
    lines = [line.strip() for line in str(err).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("(Background on this error"))


def refuse(message: str):
    raise CLIError(message)


def use_interpreter(interpret: bool) -> None:
    """--interpret must take effect before Triton decorates the kernels (at import)."""
    if not interpret:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    mod = sys.modules.get("normtune.kernels.backward.reduce")
    if mod is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(mod.kernel_2, InterpretedFunction):
            raise CLIError("--interpret was given after the kernels were compiled for a GPU in this process: "
                           "set TRITON_INTERPRET=1 before starting Python")


def parse_dtype(text: str, option: str = "--dtype") -> str:
    from normtune.kernels.config import DTYPES, canonical_dtype

    try:
        return canonical_dtype(text)
    except TypeError:
        raise CLIError(f"{option} {text!r}: use one of {', '.join(DTYPES)}") from None


def parse_list(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise CLIError(f"{option} {text!r}: use a comma list of {', '.join(allowed)}")
    return items


def device_info(gpu: str, interpret: bool, device: int = 0):
    from normtune.tuner.device import check_gpu_key, detect

    info = detect(device, interpret=interpret)
    check_gpu_key(gpu, info)
    return info


def parse_shapes_option(spec: str | None, interpret: bool):
    from normtune.tuner.shapes import parse_shapes

    try:
        return parse_shapes(spec or ("tiny" if interpret else "seed"))
    except ValueError as err:
        raise CLIError(f"--shapes: {err}") from None


def positive_seconds(value: float, option: str) -> float:
    """A time budget: a positive finite number of seconds."""
    if not (value > 0 and value != float("inf")):  # also refuses NaN
        raise CLIError(f"{option} {value}: give a positive number of seconds, e.g. {option} 0.5")
    return value


def problems_for(norms: list[str], dtype: str, weight_dtype: str | None, shapes, *, bias: bool | None,
              zero_centered: bool, save: str):
    from normtune.kernels.config import Problem

    out = []
    for norm in norms:
        has_bias = (norm == "layer_norm") if bias is None else (bias and norm == "layer_norm")
        for M, N in shapes:
            out.append(Problem(norm, M, N, dtype, weight_dtype, True, has_bias, zero_centered, save))
    return out


def open_store(url: str):
    """The results database, opened (and checked) before any work that would be lost if it cannot be."""
    from normtune.tuner.store import Store

    return run_checked(Store, url)


def read_only_store(db: str):
    """The results database for a command that only reads it (`emit` without --remeasure, `report`, `status`):
    opened read-only, so that nothing is created, upgraded or switched to WAL."""
    from normtune.tuner.store import Store

    return Store(db, read_only=True)


def write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise CLIError(f"--out {path}: cannot be written ({err.strerror or err})") from None


def check_out_folder(out: Path) -> None:
    """Before measuring: the output folder exists or can be made, and takes files."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".normtune-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise CLIError(f"--out {out}: cannot write there ({err.strerror or err}); pass a writable folder") from None


INTERPRETER_BANNER = ("[yellow]--interpret: kernels run on CPU in the Triton interpreter; times are host "
                      "wall-clock, not GPU timings[/]")
