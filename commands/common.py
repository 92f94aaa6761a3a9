"""What every command shares: the options defined once (`Gpu`, `Norms`, `Shapes`, …), their parsing into values,
and the error handling that turns a known error into one `error: …` line and exit code 1."""

from __future__ import annotations

import errno
import os
import re
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
Norms = Annotated[Optional[str], typer.Option("--norm", help="Comma list: layer_norm, rms_norm [default: both; with "
                                                               "--shapes-from, the model's]")]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="Activation dtype: bf16, fp16 or fp32 [default: bf16; "
                                                              "with --shapes-from, the model's]")]
Shapes = Annotated[Optional[str], typer.Option(
    "--shapes", help="seed | llm | few | span | heldout | tiny | FILE (one MxN per line) | 4096x8192,... ; "
                     "gated RMSNorm problems: qwen3-next | mamba2 | gated-issue | gated-tiny "
                     "[default: seed on a GPU, tiny with --interpret]")]
ShapesFrom = Annotated[Optional[Path], typer.Option(
    "--shapes-from", help="A model's Hugging Face config.json (or its folder), instead of --shapes: the widths of "
                          "its norms (hidden size, per-head q/k norms, MLA ranks) x --tokens, in the model's norm "
                          "kind, zero-centering and dtype unless --norm/--dtype/--zero-centered say otherwise")]
Tokens = Annotated[Optional[str], typer.Option(
    "--tokens", help="Tokens per batch for --shapes-from, comma list (per-head norms get tokens x heads rows) "
                     "[default: 4096,16384]")]
Interpret = Annotated[bool, typer.Option("--interpret", is_eager=True,
                                         help="Run on CPU through the Triton interpreter (no GPU; timings are not "
                                              "GPU timings).")]
WeightDtype = Annotated[Optional[str], typer.Option("--weight-dtype", help="Weight dtype: bf16, fp16 or fp32 "
                                                                           "[default: the activation dtype]")]
Residual = Annotated[bool, typer.Option("--residual", help="The fused residual form: h = x + residual, y = norm(h); "
                                                          "the backward adds h's gradient (its own problem family)")]
ResidualDtype = Annotated[Optional[str], typer.Option(
    "--residual-dtype", help="With --residual: the residual stream's dtype, the activation dtype or fp32 "
                             "[default: the activation dtype]")]
Storage = Annotated[str, typer.Option("--db", "--storage", help="SQLAlchemy URL of the results database.")]
# A command that writes results: with no --db, the user's database (`user_db`), never the repository's results.db.
WritingStorage = Annotated[Optional[str], typer.Option(
    "--db", "--storage", help="SQLAlchemy URL of the results database [default: results.db in the user directory: "
                              "$NORMTUNE_HOME, else ~/.config/normtune]")]
Device = Annotated[int, typer.Option("--device", help="CUDA device index.")]

DEFAULT_DB = "sqlite:///results.db"  # the repository's committed database: read by default, written only when named


def user_db(db: str | None, make: bool = True) -> str:
    """--db as given, else the user's database (`user_database_url`: the one `normtune sweep` writes when --db is
    not given), its folder made unless `make` is false (a command that only reads it)."""
    if db is not None:
        return db
    from normtune.tuner.store.database import user_database_url

    return user_database_url(make=make)


class CLIError(Exception):
    """An error worth one line, not a traceback."""


def known_errors() -> tuple[type[BaseException], ...]:
    """The errors worth one line. Only modules already imported are asked for theirs: an error class of a module
    never imported cannot have been raised, and importing the store (and with it torch) just to name its error
    would cost a command that failed on its options seconds."""
    errors: list[type[BaseException]] = [CLIError, ValueError, OSError]
    for module, name in (("normtune.tuner.store.models", "StoreError"), ("normtune.tuner.gpu_info", "NoGPUError")):
        found = getattr(sys.modules.get(module), name, None)
        if found is not None:
            errors.append(found)
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


# Triton's interpreter runs the kernels from this version on (3.6's fails inside kernel_1); pyproject.toml accepts
# older Triton for the compiled kernels. DEVELOPERS.md states both.
INTERPRET_MIN_TRITON = (3, 9)


def check_interpreter_triton(version: str) -> None:
    numbers = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if numbers < INTERPRET_MIN_TRITON:
        need = ".".join(map(str, INTERPRET_MIN_TRITON))
        raise CLIError(f"--interpret needs Triton >= {need} (installed: {version}); install it in an environment of "
                       f"its own: pip install \"triton>={need}\"")


def use_interpreter(interpret: bool) -> None:
    """--interpret must take effect before Triton is imported: Triton's own library functions (tl.sum, tl.max, ...)
    are decorated when triton is imported, and the kernels when normtune's are; both must be the interpreter's."""
    if not interpret:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("triton")
    except PackageNotFoundError:
        raise CLIError("--interpret needs Triton: pip install triton") from None
    check_interpreter_triton(installed)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise CLIError("--interpret was given after Triton was imported for a GPU in this process: set "
                       "TRITON_INTERPRET=1 before starting Python")
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
    from normtune.tuner.gpu_info import check_gpu_key, detect

    if device < 0:
        raise CLIError(f"--device {device}: give a CUDA device index, 0 or more (0 is the first GPU)")
    info = detect(device, interpret=interpret)
    check_gpu_key(gpu, info)
    return info


def parse_shapes_option(spec: str | None, interpret: bool):
    from normtune.tuner.shapes import parse_shapes

    try:
        return parse_shapes(("tiny" if interpret else "seed") if spec is None else spec)
    except ValueError as err:
        raise CLIError(f"--shapes: {err}") from None


def run_ids_option(text: str | None, option: str) -> tuple[int, ...] | None:
    """The run ids of a comma-list option; None when the option was not given."""
    try:
        values = None if text is None else tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if values is not None and (not values or min(values) < 1):
        raise CLIError(f"{option} {text!r}: use a comma list of run ids, e.g. 1,2,5")
    return values


def positive_seconds(value: float, option: str) -> float:
    """A time budget: a positive finite number of seconds."""
    if not (value > 0 and value != float("inf")):  # also refuses NaN
        raise CLIError(f"{option} {value}: give a positive number of seconds, e.g. {option} 0.5")
    return value


def problems_option(shapes: str | None, shapes_from: Path | None, tokens: str | None, norm: str | None,
                    dtype: str | None, weight_dtype: str | None, *, interpret: bool, bias: bool | None = None,
                    zero_centered: bool | None = None, save: str = "input", residual: bool = False,
                    residual_dtype: str | None = None):
    """The problems of --shapes x --norm, or of --shapes-from's model x --tokens (its norm kinds, zero-centering
    and dtype unless --norm, --zero-centered, --dtype are given), in the residual form with --residual (h in
    --residual-dtype). Returns (problems, the model or None)."""
    problems, model = _plain_problems(shapes, shapes_from, tokens, norm, dtype, weight_dtype, interpret=interpret,
                                      bias=bias, zero_centered=zero_centered, save=save)
    return with_residual(problems, residual, residual_dtype), model


def with_residual(problems: list, residual: bool, residual_dtype: str | None) -> list:
    """`problems` in the fused residual form (--residual, --residual-dtype), or as they are (gated ones always)."""
    if residual_dtype is not None and not residual:
        raise CLIError(f"--residual-dtype {residual_dtype}: it names the residual stream's dtype; add --residual")
    if not residual:
        return problems
    import dataclasses

    from normtune.kernels.config import ConfigError
    rd = parse_dtype(residual_dtype, "--residual-dtype") if residual_dtype is not None else None
    try:  # a gated norm has no residual stream: gated problems stay as they are
        return [p if p.gate is not None else dataclasses.replace(p, residual=True, residual_dtype=rd)
                for p in problems]
    except ConfigError as err:
        raise CLIError(f"--residual-dtype {residual_dtype}: {err}") from None


def _plain_problems(shapes: str | None, shapes_from: Path | None, tokens: str | None, norm: str | None,
                    dtype: str | None, weight_dtype: str | None, *, interpret: bool, bias: bool | None,
                    zero_centered: bool | None, save: str):
    from normtune.kernels.config import NORMS
    from normtune.tuner import model_shapes as MS

    norms = parse_list(norm, NORMS, "--norm") if norm is not None else None
    dt = parse_dtype(dtype) if dtype is not None else None
    wdt = parse_dtype(weight_dtype, "--weight-dtype") if weight_dtype else None
    if shapes_from is None:
        if tokens is not None:
            raise CLIError(f"--tokens {tokens}: token counts go with --shapes-from CONFIG.json (a model's norms); "
                           "add it, or give MxN shapes with --shapes")
        gated, shapes = gated_presets(shapes, dt or "bf16", wdt, norms, zero_centered, save)
        plain = [] if gated and shapes is None else problems_for(
            norms or list(NORMS), dt or "bf16", wdt, parse_shapes_option(shapes, interpret), bias=bias,
            zero_centered=bool(zero_centered), save=save)
        return plain + gated, None
    if shapes is not None:
        raise CLIError(f"--shapes {shapes} and --shapes-from {shapes_from} both name the shapes: give one of them")
    try:
        counts = MS.parse_tokens(tokens) if tokens is not None else list(MS.DEFAULT_TOKENS)
    except ValueError as err:
        raise CLIError(f"--tokens {err}") from None
    try:
        model = MS.model_shapes(shapes_from)
        plain = model.problems(counts, norms=norms, dtype=dt, weight_dtype=wdt, bias=bias,
                               zero_centered=zero_centered, save=save)
        gated = []
        if norms is None or "rms_norm" in norms:  # the hybrid model's gated norms, their own families
            from normtune.tuner.gated_shapes import config_problems

            found = config_problems(MS.read_config(shapes_from), counts, dt or model.activation_dtype(),
                                    str(shapes_from))
            gated = _gated_options(found, wdt, zero_centered, save, f"--shapes-from {shapes_from}")
        return plain + gated, model
    except ValueError as err:
        raise CLIError(f"--shapes-from {one_line(err)}") from None


def gated_presets(spec: str | None, dtype: str, weight_dtype: str | None, norms: list[str] | None,
                  zero_centered: bool | None, save: str) -> tuple[list, str | None]:
    """The gated presets' problems in a --shapes list (qwen3-next, mamba2, ...: `gated_shapes.GATED_PRESETS`), and
    what is left of the list for the plain problems (None when nothing)."""
    from normtune.tuner.gated_shapes import GATED_PRESETS, preset_problems

    items = [s.strip() for s in (spec or "").split(",") if s.strip()]
    names = [s for s in items if s in GATED_PRESETS]
    if not names:
        return [], spec
    if norms is not None and "rms_norm" not in norms:
        raise CLIError(f"--shapes {spec}: {', '.join(names)} are gated RMSNorm problems; add rms_norm to --norm")
    found = [p for name in names for p in preset_problems(name, dtype)]
    rest = [s for s in items if s not in GATED_PRESETS]
    return _gated_options(found, weight_dtype, zero_centered, save, f"--shapes {spec}"), ",".join(rest) or None


def _gated_options(problems: list, weight_dtype: str | None, zero_centered: bool | None, save: str,
                   option: str) -> list:
    """Gated problems with --weight-dtype and --zero-centered; --save output refused (the gated form saves x)."""
    import dataclasses

    from normtune.kernels.config import ConfigError

    if save != "input" and problems:
        raise CLIError(f"{option} with --save {save}: the gated form saves its input; drop --save")
    try:
        return list(dict.fromkeys(dataclasses.replace(p, weight_dtype=weight_dtype or p.weight_dtype,
                                                      zero_centered=bool(zero_centered)) for p in problems))
    except ConfigError as err:
        raise CLIError(f"{option}: {err}") from None


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
    from normtune.tuner.store.database import Store

    return run_checked(Store, url)


def existing_store(url: str):
    """The results database for a command that changes only what is there (`prune`): refused, untouched, unless
    it already holds normtune results (a missing or empty file is not created)."""
    from normtune.tuner.store.database import OlderSchemaError, Store

    try:
        Store(url, read_only=True).close()
    except OlderSchemaError:
        pass  # ours, of an older schema: opening it for writing upgrades it
    return Store(url)


def read_only_store(db: str):
    """The results database for a command that only reads it (`emit` without --remeasure, `report`, `status`):
    opened read-only, so that nothing is created, upgraded or switched to WAL. A SQLite file of an older schema
    is read through an upgraded copy (`Store.for_reading`), said in one note line."""
    from normtune.tuner.store.database import SCHEMA_VERSION, Store

    store = Store.for_reading(db)
    if store.upgraded_from is not None:
        typer.secho(f"note: --db {db} has schema {store.upgraded_from}; read through a copy upgraded to schema "
                    f"{SCHEMA_VERSION} and left unchanged (a writing command such as `normtune sweep` upgrades it "
                    "in place)", err=True)
    return store


def write_text(path: Path, text: str, option: str = "--out") -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise CLIError(f"{option} {path}: cannot be written ({err.strerror or err})") from None


def check_writable_file(path: Path, option: str) -> None:
    """Before the work whose result goes to `path`: it can be written (its folder exists or can be made, it is not
    a folder, a file can be opened there); what is at `path` is left as it is."""
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise NotADirectoryError(errno.ENOTDIR, f"{path.parent} is not a folder") from None
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as err:
        raise CLIError(f"{option} {path}: cannot be written ({err.strerror or err}); pass a writable file path") \
            from None


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
