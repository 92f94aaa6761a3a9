"""`normtune sweep`: an Optuna search over both kernels' launch knobs, per problem, measured cold-L2, stored.

One job per module: `options` (what to do, names, summaries), `measuring` (the GPU process), `compiling` (the
compile-ahead workers), `sampling` (sampler and seeds), `trials` (one problem's study), `driver` (the ask/tell
loop of one worker), `device_workers` (one worker process per GPU), `progress` (live view and status, from the database).
"""

from .costs import line as costs_line
from .driver import Sweep
from .device_workers import run_on_devices
from .measuring import MeasuringProcess, start_helpers
from .options import SAMPLERS, ProblemSummary, SweepOptions, SweepSummary, study_name, summary_json
from .progress import LiveView, snapshot, worker_lines

__all__ = ["SAMPLERS", "LiveView", "MeasuringProcess", "ProblemSummary", "Sweep", "SweepOptions", "SweepSummary",
           "costs_line", "run_on_devices", "snapshot", "start_helpers", "study_name", "summary_json", "worker_lines"]
