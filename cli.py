"""`normtune`: the command line of the tuning service.

    normtune bench    --gpu h100 --shapes seed --peers all --out docs/bench
    normtune sweep    --gpu h100 --shapes seed --trials 60 --time-budget 1800
    normtune emit     --gpu h100 --db results.db --out configs/h100.json
    normtune validate --gpu h100 --shapes heldout
    normtune report   --gpu h100 --db results.db --out docs/report-h100
    normtune where    --gpu h100 --shape 4096x8192 --norm rms_norm
    normtune merge    --from tune.db --runs-of h200-tuned.json --db results.db

Commands are thin: they parse options and call library functions in `normtune.tuner`; each lives in a module of
`normtune.commands` (shared options and error handling in `commands/common.py`). Known errors print one line and
exit with status 1. GPU work needs a CUDA device; `--interpret` runs the same pipeline on CPU through
the Triton interpreter (tests, demos; its timings are host wall-clock and are labelled as such). Its results are
labelled `interpret`, so `--gpu` takes only `auto` or `interpret` with it; `--gpu interpret` needs `--interpret`.
"""

from __future__ import annotations

import sys
from typing import Annotated

# The command line needs the tuner's dependencies, the [tune] extra; `pip install normtune` alone brings the runtime.
TUNE_MODULES = ("typer", "rich", "optuna", "pandas", "sqlalchemy", "matplotlib")


def missing_tune_modules() -> list[str]:
    from importlib.util import find_spec

    missing = []
    for name in TUNE_MODULES:
        try:
            if sys.modules.get(name, False) is None or find_spec(name) is None:
                missing.append(name)
        except ValueError:  # a module without a spec: present, however it got there
            pass
    return missing


if missing_tune_modules():
    sys.stderr.write(f"error: the normtune command needs the tuner's dependencies ({', '.join(missing_tune_modules())} "
                     "missing): pip install \"normtune[tune]\"\n")
    raise SystemExit(1)

import typer  # noqa: E402 - after the check above

from normtune.commands.bench import bench  # noqa: E402
from normtune.commands.compare import compare  # noqa: E402
from normtune.commands.emit import emit  # noqa: E402
from normtune.commands.merge import merge  # noqa: E402
from normtune.commands.prune import prune  # noqa: E402
from normtune.commands.report import report  # noqa: E402
from normtune.commands.slim import slim  # noqa: E402
from normtune.commands.status import status  # noqa: E402
from normtune.commands.sweep import sweep  # noqa: E402
from normtune.commands.tune import tune  # noqa: E402
from normtune.commands.validate import validate  # noqa: E402
from normtune.commands.where import where  # noqa: E402

# Plain help (rich_markup_mode=None): "[default: …]" written in a help text stays (rich markup would take it for
# a style tag and drop it), and flags show as --flag / --no-flag without a type placeholder.
app = typer.Typer(help="Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None)

for command in (bench, sweep, status, tune, emit, validate, compare, report, where, prune, slim, merge):
    app.command()(command)


def normtune_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("normtune")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"normtune {normtune_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print normtune's version and exit.")] = False,
):
    """Autotuning and benchmarking of LayerNorm/RMSNorm backward kernels."""


def main() -> None:
    """The `normtune` console script: the command, then the process ends at once (`end`)."""
    try:
        app()
    except SystemExit as done:
        end(done.code)
    end(0)


END_GRACE_S = 0.25  # how long `end` waits for what the command started to finish before it exits the usual way


def end(code) -> None:
    """End the process with `code` (a SystemExit's: None, a number or a message), without the interpreter's
    teardown, which with torch, Triton and Optuna imported takes about a second after the command's last output.
    Output is flushed first. Where the command left anything that teardown waits for (a child process or a
    non-daemon thread still running END_GRACE_S later) it exits the usual way, so nothing is cut short."""
    import os
    import threading
    import time

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the usual exit reports it
            sys.exit(code)
    mp = sys.modules.get("multiprocessing")

    def running() -> bool:
        return bool(mp is not None and mp.active_children()) or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())

    # Children just killed and a pool's manager thread just told to stop end within milliseconds: wait that long.
    deadline = time.monotonic() + END_GRACE_S
    while running() and time.monotonic() < deadline:
        time.sleep(0.005)
    if running():
        sys.exit(code)
    logging = sys.modules.get("logging")
    if logging is not None:
        logging.shutdown()
    _release_semaphores()
    os._exit(code)


def _release_semaphores() -> None:
    """Unlink the named semaphores of the multiprocessing objects the command made (a compile pool's queues, a
    shared counter) as the interpreter's teardown would: without it multiprocessing's resource tracker, outliving
    the process, cleans them up itself and warns of leaked semaphores."""
    util = sys.modules.get("multiprocessing.util")
    run_finalizers = getattr(util, "_run_finalizers", None)
    if run_finalizers is None:
        return
    try:
        run_finalizers(0)  # the finalizers teardown runs first (priority >= 0): unlinking, closing; no joins
    except Exception:  # noqa: BLE001 - the process ends either way
        pass


if __name__ == "__main__":  # pragma: no cover
    main()
