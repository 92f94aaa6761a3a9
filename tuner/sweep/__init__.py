"""`normtune sweep`: an Optuna search over both kernels' launch knobs, per problem, measured cold-L2, stored.

`run(options)` is the one entry point (`launcher`): it starts and stops every process of a sweep and returns a
`SweepResult`. One job per module: `options` (what to do, names, summaries), `measuring` (the GPU process), `compiling` (the
compile-ahead workers, and the host's pool the `--devices` workers share), `compile_ahead` (a worker's compile
jobs, its seeds' ahead of their claims), `pending` (a trial from its claim to its stored measurement), `sampling`
(sampler and seeds),
`trials` (one problem's study), `driver` (the ask/tell loop of one worker), `device_workers` (one worker process
per GPU), `engine` (the measuring process and compile pool kept across the sweeps of one caller), `progress`
(live view and status, from the database), `costs` and `timeline` (where the time went).

The names below are loaded on first use: importing this package (as a spawned measuring process does) imports
neither Optuna nor the database layer nor torch.
"""

from __future__ import annotations

import importlib

_WHERE = {"costs_line": ("costs", "line"), "Sweep": ("driver", "Sweep"), "run": ("launcher", "run"),
          "SweepResult": ("launcher", "SweepResult"), "CLOSING_STEPS": ("launcher", "CLOSING_STEPS"),
          "run_on_devices": ("device_workers", "run_on_devices"),
          "MeasuringProcess": ("measuring", "MeasuringProcess"), "start_helpers": ("measuring", "start_helpers"),
          "KeptHelpers": ("engine", "KeptHelpers"),
          **{name: ("options", name) for name in ("SAMPLERS", "ProblemSummary", "SweepOptions", "SweepSummary",
                                                  "study_name", "summary_json")},
          **{name: ("progress", name) for name in ("LiveView", "event_line", "result_lines", "snapshot",
                                                   "worker_lines")}}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _WHERE[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value
