"""Which heuristic table a process uses on a device, walked in this order (the first that answers wins):

1. the file named by $NORMTUNE_CONFIG (or, for `normtune where`, its `--config-file`);
2. the user table `<user dir>/<gpu key>.json` (e.g. `h100.json`, written by `normtune emit --user`), where the
   user dir is $NORMTUNE_HOME, else $XDG_CONFIG_HOME/normtune, else ~/.config/normtune;
3. the shipped table whose GPU name is the device's, else one of the same GPU family (key, e.g. h100 for an
   'H100 PCIe'), else one of the same vendor and compute capability (ROCm reports a major version of 9 for
   AMD GPUs, which is no Hopper) — these two with a one-time warning saying which;
4. none: the analytic defaults, sized to the device (with a one-time warning on a GPU saying how to tune it).

$NORMTUNE_HIDE_TABLES (any value but 0) hides steps 2 and 3: the device runs as a GPU nobody tuned, with the
analytic defaults unless step 1 names a table (`normtune tune --as-new-gpu` sets it for its whole run, its spawned
processes included, so that neither its measurements nor its comparisons see a table tuned on the device).

Without a GPU (no device name, or the CPU) only step 1 applies. A table named in step 1 or 2 that cannot be used
(unreadable, malformed, or holding Triton-interpreter timings on a GPU) is refused with an error naming the file.
`choose_table` walks the chain and records every step (what `normtune where` prints); `table_for` is the same
choice with the runtime's warnings.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..device import gpu_key, vendor_of
from .tables import Table, TableError, load_table, shipped_tables

ENV_VAR = "NORMTUNE_CONFIG"
HOME_VAR = "NORMTUNE_HOME"
HIDE_VAR = "NORMTUNE_HIDE_TABLES"


def tables_hidden() -> bool:
    """Whether $NORMTUNE_HIDE_TABLES hides the user and shipped tables."""
    return os.environ.get(HIDE_VAR, "") not in ("", "0")


def user_dir() -> Path:
    """Where user tables live: $NORMTUNE_HOME, else $XDG_CONFIG_HOME/normtune, else ~/.config/normtune."""
    if os.environ.get(HOME_VAR):
        return Path(os.environ[HOME_VAR]).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec ignores a relative path
        return Path(xdg) / "normtune"
    return Path.home() / ".config" / "normtune"


def user_table_path(key: str) -> Path:
    """The user table of a GPU family: `<user dir>/<key>.json`."""
    return user_dir() / f"{key}.json"


@dataclass(frozen=True)
class Step:
    """One link of the chain as walked: its source (env, user, shipped, default), what was found, whether it
    gave the table."""

    source: str
    detail: str
    path: str | None = None
    taken: bool = False


@dataclass(frozen=True)
class TableChoice:
    """The table the chain gave (None: the analytic defaults), every step walked, and the runtime's one-time
    warning for a fallback (None when the choice is exact or explicit)."""

    table: Table | None
    steps: tuple[Step, ...]
    warning: str | None = None


def _refuse_interpreter_table(table: Table, device_name: str | None, fix: str) -> None:
    if table.interpret and device_name and not device_name.startswith("cpu"):
        raise TableError(f"heuristic table {table.path}: it holds Triton-interpreter timings and cannot tune a GPU "
                         f"({device_name}); {fix}")


@functools.lru_cache(maxsize=64)
def choose_table(device_name: str | None, capability: tuple[int, int] | None = None,
                 config_file: str | None = None) -> TableChoice:
    """Walk the chain for the named device (a device name such as 'NVIDIA H100 80GB HBM3', or a GPU key such as
    'h100'; None or 'cpu…': no GPU). `config_file` takes the place of $NORMTUNE_CONFIG. No warnings here."""
    explicit = config_file or os.environ.get(ENV_VAR)
    what = f"--config-file {config_file}" if config_file else f"${ENV_VAR}"
    if explicit:
        table = load_table(explicit)
        _refuse_interpreter_table(table, device_name, "emit one from a GPU sweep")
        return TableChoice(table, (Step("env", f"{what}: {explicit}", explicit, True),))
    steps = [Step("env", f"${ENV_VAR}: not set")]
    if not device_name or device_name.startswith("cpu"):
        steps.append(Step("default", "no GPU: the analytic defaults"))
        return TableChoice(None, tuple(steps))
    if tables_hidden():
        steps += [Step("user", f"user table: hidden by ${HIDE_VAR}"),
                  Step("shipped", f"shipped tables: hidden by ${HIDE_VAR}"), Step("default", "the analytic defaults")]
        return TableChoice(None, tuple(steps))
    key = gpu_key(device_name)
    user = user_table_path(key)
    if user.is_file():
        fix = f"re-emit it with `normtune emit --gpu {key} --user`, or delete it"
        try:
            table = load_table(str(user))
        except TableError as err:
            raise TableError(f"user table: {err}; {fix}") from None
        _refuse_interpreter_table(table, device_name, fix)
        if table.gpu_key == key:
            return TableChoice(table, tuple(steps) + (Step("user", f"user table {user}: found", str(user), True),))
        # Another GPU's table saved under this GPU's name: its configs were never timed here, so it is skipped.
        steps.append(Step("user", f"user table {user}: tuned on {table.gpu_name!r} (GPU family {table.gpu_key}), "
                                  f"not this GPU family {key}: skipped", str(user)))
        choice = _shipped(device_name, key, capability, steps)
        skipped = (f"normtune: the user table {user} was tuned on {table.gpu_name!r}, not on {device_name!r} "
                   f"(GPU family {key}): it is not used; tune this GPU with `normtune tune --gpu auto`, or delete it")
        return TableChoice(choice.table, choice.steps, "; ".join(w for w in (skipped, choice.warning) if w))
    steps.append(Step("user", f"user table {user}: not found", str(user)))
    return _shipped(device_name, key, capability, steps)


def _shipped(device_name: str, key: str, capability: tuple[int, int] | None, steps: list[Step]) -> TableChoice:
    tables = [t for t in shipped_tables() if not t.interpret]
    exact = [t for t in tables if t.gpu_name == device_name]
    if exact:
        t = exact[0]
        return TableChoice(t, tuple(steps) + (Step("shipped", f"shipped table {t.label}: tuned on this GPU "
                                                              f"({t.gpu_name!r})", t.path, True),))
    same_key = [t for t in tables if t.gpu_key == key]
    if same_key:
        t = same_key[0]
        step = Step("shipped", f"shipped table {t.label}: GPU family {key} (tuned on {t.gpu_name!r})", t.path, True)
        return TableChoice(t, tuple(steps) + (step,), f"normtune: no table tuned on {device_name!r}; using {t.label} "
                                                     f"(tuned on {t.gpu_name!r}, same GPU family)")
    cc = f"{capability[0]}.{capability[1]}" if capability else None
    vendor = vendor_of(device_name)
    same_cc = [t for t in tables if cc and t.compute_capability == cc and vendor_of(t.gpu_name) == vendor]
    if same_cc:
        t = same_cc[0]
        step = Step("shipped", f"shipped table {t.label}: same compute capability {cc} (tuned on {t.gpu_name!r})",
                    t.path, True)
        return TableChoice(t, tuple(steps) + (step,), f"normtune: no table for {device_name!r}; using {t.label} "
                                                     f"(tuned on {t.gpu_name!r}, same compute capability {cc})")
    shipped = ", ".join(t.label for t in tables) or "none"
    steps.append(Step("shipped", f"shipped tables ({shipped}): none for GPU family {key}"
                                 + (f" or compute capability {cc}" if cc else "")))
    steps.append(Step("default", "the analytic defaults"))
    warning = (f"normtune: no heuristic table for {device_name!r}: running the analytic default configs, sized to "
               f"this GPU. To tune it: `normtune tune --gpu auto`, which writes the user table {key}.json "
               "(docs/new-gpu.md)")
    return TableChoice(None, tuple(steps), warning)


_warned: set[str] = set()


def warn_once(message: str | None) -> None:
    if message and message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def table_for(device_name: str | None, capability: tuple[int, int] | None = None) -> Table | None:
    """The table the runtime uses on this device (`choose_table`), warning once where it falls back."""
    choice = choose_table(device_name, capability)
    warn_once(choice.warning)
    return choice.table
