"""The options that pick a command's GPUs and compile processes: `--devices` and `--compile-workers`."""

from __future__ import annotations

from .common import CLIError


def parse_devices(text: str | None) -> list[int] | None:
    """--devices "0,1,…" as a list of distinct CUDA indices; None when not given."""
    if not text:
        return None
    items = [d.strip() for d in text.split(",") if d.strip()]
    if not items or not all(d.isdigit() for d in items) or len(set(items)) != len(items):
        raise CLIError(f"--devices {text!r}: use a comma list of distinct CUDA device indices, e.g. 0,1")
    return [int(d) for d in items]


def compile_processes(value: int | None, gpus: int) -> int:
    """--compile-workers as given, or the default for `gpus` GPUs (16 each, within the host's cores)."""
    if value is None:
        from normtune.tuner.sweep.compiling import default_compile_workers

        return default_compile_workers(gpus)
    if value < 0:
        raise CLIError(f"--compile-workers {value}: give 0 (compile in the measuring process) or more")
    return value
