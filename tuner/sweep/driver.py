"""`normtune sweep`: an Optuna search over both kernels' launch knobs, per problem, measured cold-L2, stored.

Per problem there is one Optuna study (named deterministically, living in the results database) and the goal
is `trials` finished trials: re-running adds only the difference. The loop uses Optuna's ask/tell interface:

    ask ─► suggest a config ─► (invalid? prune, no compile) ─► compile ahead in a CPU worker ─┐
    tell ◄── store the measurement (committed at once) ◄── gate + time in the measuring process ┘

- The GPU work runs in a separate measuring process; a trial that outlives `trial_timeout_s` (a hung kernel)
  gets that process killed and restarted, and is recorded as `timeout`.
- CPU worker processes compile the next configs (Triton's on-disk cache then serves the measuring process).
- A measurement is committed to the store before the trial is told to Optuna, so a SIGKILL loses nothing that
  was measured; on restart, a trial found measured but not told is completed from the store (no re-measure).
- Several sweeps (processes, GPUs, hosts) may share one database: Optuna heartbeats mark a dead worker's
  trial failed and `RetryFailedTrialCallback` re-queues it; a retry whose original was measured reuses it.
- SIGINT/SIGTERM finish the current trial and stop; a second signal abandons it. `time_budget_s` stops between
  trials and reports what remains.
"""


from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from normtune.kernels.config import BackwardConfig, Problem, default_config

from ..device import DeviceInfo
from ..measure import MeasureResult
from ..space import Space
from .compiling import _compile_init, _compile_one
from .measuring import MeasuringProcess
from .options import FIRST_ROUND, MEASURED, SEED_VERSION, ProblemSummary, SweepOptions, SweepSummary, study_name

log = logging.getLogger("normtune.sweep")


def _retry_callback():
    """(callback class, RDBStorage keyword) re-queuing a trial whose worker's heartbeat stopped. Optuna 4.9
    renamed RetryFailedTrialCallback / failed_trial_callback (deprecated, removed in 6.0)."""
    try:
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        return RetryHeartbeatStaleTrialCallback, "heartbeat_stale_trial_callback"
    except ImportError:  # Optuna < 4.9
        from optuna.storages import RetryFailedTrialCallback

        return RetryFailedTrialCallback, "failed_trial_callback"


@dataclass
class _Pending:
    trial: Any
    config: BackwardConfig
    source: str
    compiled: Future | None
    asked_at: float


class Sweep:
    """One sweep worker: a device, a store, the problems. `run()` returns a `SweepSummary`."""

    def __init__(self, opts: SweepOptions, store, info: DeviceInfo,
                 on_event: Callable[[str, dict], None] | None = None):
        import optuna

        self.opts, self.store, self.info = opts, store, info
        self.emit = on_event or (lambda kind, data: None)
        self._stop_requested = 0
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # e.g. independent-sampling notes of conditional knobs
        import warnings

        # Heartbeats are recorded by this driver's own thread (ask/tell, not Study.optimize), and the retry
        # helper it relies on is marked experimental: both warnings are expected.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self._optuna = optuna
        retry, retry_keyword = _retry_callback()
        self.storage = store.optuna_storage(heartbeat_interval=opts.heartbeat_interval,
                                            grace_period=opts.grace_period, **{retry_keyword: retry(max_retry=2)})
        self._running: dict[int, int] = {}  # trial_id -> number, for heartbeats
        self._lock = threading.Lock()

    # ---- signals
    def _on_signal(self, signum, frame):
        self._stop_requested += 1
        if self._stop_requested == 1:
            self.emit("signal", {"message": f"{signal.Signals(signum).name}: finishing the current trial, then "
                                            "stopping (again to abandon it)"})
        else:
            raise KeyboardInterrupt

    # ---- helpers
    def _sampler(self, space: Space):
        o = self._optuna
        if self.opts.sampler == "random":
            return o.samplers.RandomSampler(seed=self.opts.seed)
        if self.opts.sampler == "grid":
            class AskTellGridSampler(o.samplers.GridSampler):
                """Exhausting the grid calls study.stop(), which only works inside Study.optimize; the sweep asks
                and tells, and stops by itself once the grid's trials are finished."""

                def after_trial(self, study, trial, state, values) -> None:
                    return None

            return AskTellGridSampler({"config": list(range(len(self._grid(space))))}, seed=self.opts.seed)
        return o.samplers.TPESampler(multivariate=True, group=True, constant_liar=True, seed=self.opts.seed,
                                     n_startup_trials=8)

    def _grid(self, space: Space) -> list[BackwardConfig]:
        if not hasattr(self, "_grid_cache") or self._grid_cache[0] != space:
            self._grid_cache = (space, list(space))
        return self._grid_cache[1]

    def _suggest(self, trial, space: Space) -> BackwardConfig:
        if self.opts.sampler == "grid":
            configs = self._grid(space)
            return configs[trial.suggest_categorical("config", list(range(len(configs))))]
        d = space.domains()
        params = {}
        params["k1.two_pass"] = trial.suggest_categorical("k1.two_pass", list(d["k1.two_pass"]))
        for key, dom in d.items():
            if key == "k1.two_pass":
                continue
            if key == "k1.block_col" and not params["k1.two_pass"]:
                params[key] = dom[0]
                continue
            if key == "k1.recompute" and params["k1.two_pass"]:
                params[key] = False
                continue
            params[key] = trial.suggest_categorical(key, list(dom))
        return space.config(params)

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.opts.heartbeat_interval):
            with self._lock:
                ids = list(self._running)
            for tid in ids:
                try:
                    self.storage.record_heartbeat(tid)
                except Exception as err:  # noqa: BLE001 - a missed heartbeat only risks a retry
                    log.debug("heartbeat failed: %s", err)

    def _finished(self, study) -> list:
        TS = self._optuna.trial.TrialState
        return [t for t in study.get_trials(deepcopy=False, states=(TS.COMPLETE, TS.FAIL))
                if t.user_attrs.get("status") in MEASURED]

    def _repair(self, study, name: str, problem: Problem) -> None:
        """Trials measured (stored) but never told — their process died in between — are told now."""
        TS = self._optuna.trial.TrialState
        running = study.get_trials(deepcopy=False, states=(TS.RUNNING,))
        if not running:
            return
        stored = {m.trial_number: m for m in self.store.measurements(study_name=name)
                  if m.trial_number is not None}
        for t in running:
            m = stored.get(t.number)
            if m is not None:
                self._tell_from_record(study, t.number, m)

    def _tell_from_record(self, study, number: int, m) -> None:
        TS = self._optuna.trial.TrialState
        try:
            frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
            self.storage.set_trial_user_attr(frozen._trial_id, "status", m.status)
            if m.status == "ok":
                study.tell(number, m.median_us)
            else:
                study.tell(number, state=TS.FAIL)
        except (RuntimeError, ValueError) as err:  # already told by its own (live) worker
            log.debug("repair of trial %s skipped: %s", number, err)

    # ---- main loop
    def run(self) -> SweepSummary:
        opts = self.opts
        summary = SweepSummary()
        t0 = time.perf_counter()
        old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._on_signal)
        timing = dict(min_reps=opts.min_reps, max_reps=opts.max_reps, budget_s=opts.budget_s)
        if opts.interpret:
            timing = dict(min_reps=1, max_reps=2, budget_s=0.0, warmup=0)
        measurer = MeasuringProcess(opts.device, opts.interpret, self.info.l2_bytes, timing)
        pool = None
        if not opts.interpret and opts.compile_workers > 0:
            pool = ProcessPoolExecutor(opts.compile_workers, mp_context=mp.get_context("spawn"),
                                       initializer=_compile_init, initargs=(opts.device,))
        run_id = self.store.start_run(self.info, kind="sweep", command_line=" ".join(os.sys.argv))
        stop_hb = threading.Event()
        hb = threading.Thread(target=self._heartbeat_loop, args=(stop_hb,), daemon=True)
        hb.start()
        status = "finished"
        self.emit("start", {"problems": len(opts.problems), "trials": opts.trials, "run_id": run_id})
        # Rounds: every problem first gets a few trials (the default and its neighbours), then all are deepened
        # to `trials`, so that a time-budgeted sweep covers every problem before it refines any.
        rounds = sorted({min(opts.trials, FIRST_ROUND), opts.trials})
        try:
            for target in rounds:
                by_key: dict[str, ProblemSummary] = {}
                for index, problem in enumerate(opts.problems):
                    if self._stop_requested or self._over_budget(t0):
                        summary.stopped = "interrupted" if self._stop_requested else "time budget"
                        summary.remaining += [f"{p.key}: up to {opts.trials} trials" for p in opts.problems[index:]]
                        break
                    ps = self._sweep_problem(problem, index, run_id, measurer, pool, t0, summary, target)
                    by_key[problem.key] = ps
                    if summary.stopped:
                        summary.remaining += [f"{p.key}: up to {opts.trials} trials"
                                              for p in opts.problems[index + 1:]]
                        break
                summary.problems = list(by_key.values())
                if summary.stopped:
                    break
        except KeyboardInterrupt:
            summary.stopped = "interrupted"
            status = "interrupted"
        except BaseException:
            status = "failed"
            raise
        finally:
            stop_hb.set()
            with self._lock:
                self._running.clear()
            measurer.close()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            if summary.stopped == "interrupted":
                status = "interrupted"
            self.store.end_run(run_id, status=status)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            summary.wall_s = time.perf_counter() - t0
            self.emit("finish", {"summary": summary})
        return summary

    def _over_budget(self, t0: float) -> bool:
        return self.opts.time_budget_s is not None and time.perf_counter() - t0 >= self.opts.time_budget_s

    def _sweep_problem(self, problem: Problem, index: int, run_id: int, measurer: MeasuringProcess,
                       pool, t0: float, summary: SweepSummary, trials: int) -> ProblemSummary:
        o, opts = self._optuna, self.opts
        TS = o.trial.TrialState
        space = Space(problem, self.info.sm_count)
        name = study_name(opts.gpu_key, problem, self.info.interpret, opts.study_prefix)
        study = o.create_study(study_name=name, storage=self.storage, sampler=self._sampler(space),
                               direction="minimize", load_if_exists=True)
        o.storages.fail_stale_trials(study)
        self._repair(study, name, problem)
        if study.user_attrs.get("seed_version", 1 if study.user_attrs.get("seeded") else 0) < SEED_VERSION:
            # New studies, and studies seeded by an older normtune (fewer seed strategies), get the current
            # seeds; skip_if_exists keeps already-measured ones from being queued twice.
            study.set_user_attr("seeded", True)
            study.set_user_attr("seed_version", SEED_VERSION)
            study.set_user_attr("problem", problem.to_dict())
            study.set_user_attr("gpu_key", opts.gpu_key)
            extra = [space.canonical(BackwardConfig.from_dict(c)) for c in opts.extra_seeds.get(problem.key, [])]
            domains = space.domains()
            for cfg in dict.fromkeys(extra + space.seeds()) if opts.sampler != "grid" else []:
                params = space.params(cfg)
                if space.why_not(cfg) is None and all(v in domains[k] for k, v in params.items()):
                    study.enqueue_trial(params, user_attrs={"source": "seed"}, skip_if_exists=True)
        ps = ProblemSummary(problem, name)
        best = self.store.best(problem, gpu_key=opts.gpu_key, interpret=self.info.interpret)
        if best is not None:
            ps.best_us, ps.best_config = best.median_us, best.config
        default = space.canonical(default_config(problem))
        for m in self.store.measurements(problem=problem, gpu_key=opts.gpu_key, interpret=self.info.interpret,
                                         status="ok"):
            if m.config == default and m.study_name == name:
                ps.default_us = m.median_us
        pending: list[_Pending] = []
        grid_size = len(self._grid(space)) if opts.sampler == "grid" else None

        def done_and_running() -> tuple[int, int]:
            finished = len(self._finished(study))
            running = len(study.get_trials(deepcopy=False, states=(TS.RUNNING,)))
            return finished, running

        finished, _ = done_and_running()
        target = trials if grid_size is None else min(trials, grid_size)
        self.emit("problem", {"index": index, "problem": problem, "study": name, "done": finished,
                              "target": target})
        invalid_streak = 0
        while True:
            finished, running = done_and_running()
            # keep `lookahead` trials asked (compiling) ahead of the measurement
            while (finished + running < target and len(pending) < max(1, opts.lookahead if pool else 1)
                   and not self._stop_requested and not self._over_budget(t0) and invalid_streak < 500):
                trial = study.ask()
                # A first heartbeat at once: a worker dying before its heartbeat thread's first beat would
                # otherwise leave a RUNNING trial that Optuna never considers stale.
                self.storage.record_heartbeat(trial._trial_id)
                cfg = self._suggest(trial, space)
                why = space.why_not(cfg)
                if why is not None:
                    trial.set_user_attr("status", "invalid")
                    trial.set_user_attr("error", why[:500])
                    study.tell(trial, state=TS.PRUNED)
                    invalid_streak += 1
                    continue
                invalid_streak = 0
                cfg = space.canonical(cfg)
                source = trial.user_attrs.get("source", "sweep")
                if opts.source != "sweep":
                    source = opts.source
                with self._lock:
                    self._running[trial._trial_id] = trial.number
                fut = pool.submit(_compile_one, problem.to_dict(), cfg.to_json(), self.info.sm_count) if pool else None
                pending.append(_Pending(trial, cfg, source, fut, time.perf_counter()))
                running += 1
            if not pending:
                if finished >= target or invalid_streak >= 500:
                    break
                if self._stop_requested or self._over_budget(t0):
                    summary.stopped = "interrupted" if self._stop_requested else "time budget"
                    summary.remaining.append(f"{problem.key}: {max(0, target - finished)} trials")
                    break
                # Other workers hold the last trials: wait for them, failing (and so re-queuing) the trials of
                # a worker whose heartbeat stopped.
                time.sleep(min(1.0, opts.heartbeat_interval / 2))
                o.storages.fail_stale_trials(study)
                continue
            item = pending.pop(0)
            self._measure_pending(item, problem, name, run_id, measurer, ps, summary, default)
            if self._stop_requested or self._over_budget(t0):
                self._abandon(study, pending)
                pending = []
                finished, _ = done_and_running()
                if finished < target:
                    summary.stopped = "interrupted" if self._stop_requested else "time budget"
                    summary.remaining.append(f"{problem.key}: {target - finished} trials")
                break
        ps.trials = len(self._finished(study))
        best = self.store.best(problem, gpu_key=opts.gpu_key, interpret=self.info.interpret)
        if best is not None:
            ps.best_us, ps.best_config = best.median_us, best.config
        self.emit("problem_done", {"summary": ps})
        return ps

    def _abandon(self, study, pending: list[_Pending]) -> None:
        TS = self._optuna.trial.TrialState
        for item in pending:
            if item.compiled is not None:
                item.compiled.cancel()
            item.trial.set_user_attr("status", "abandoned")
            study.tell(item.trial, state=TS.PRUNED)
            with self._lock:
                self._running.pop(item.trial._trial_id, None)

    def _measure_pending(self, item: _Pending, problem: Problem, name: str, run_id: int,
                         measurer: MeasuringProcess, ps: ProblemSummary, summary: SweepSummary,
                         default: BackwardConfig) -> None:
        study_trial, cfg = item.trial, item.config
        result = None
        compile_s = None
        # A retry of a trial whose (dead) worker had already stored its measurement reuses it.
        original = _retry_callback()[0].retried_trial_number(self.storage.get_trial(study_trial._trial_id))
        if original is not None:
            prev = [m for m in self.store.measurements(study_name=name) if m.trial_number == original]
            if prev:
                m = prev[0]
                study_trial.set_user_attr("status", m.status)
                study_trial.set_user_attr("reused_from", original)
                if m.status == "ok":
                    self._tell(study_trial, m.median_us)
                else:
                    self._tell(study_trial, None)
                return
        if item.compiled is not None:
            t_wait = time.perf_counter()
            try:
                cstatus, compile_s, cerr = item.compiled.result(timeout=self.opts.trial_timeout_s)
            except Exception as err:  # noqa: BLE001 - a broken pool: measure (and compile) in the measurer
                cstatus, compile_s, cerr = "ok", None, None
                log.debug("compile-ahead failed: %s", err)
            summary.compile_wait_s += time.perf_counter() - t_wait
            summary.compile_s += compile_s or 0.0
            if cstatus in ("compile_error", "out_of_resources"):
                result = MeasureResult(status=cstatus, error=cerr, compile_s=compile_s,
                                       interpret=self.info.interpret)
        if result is None:
            t = time.perf_counter()
            result = measurer.measure(problem, cfg, self.opts.trial_timeout_s)
            summary.measure_s += time.perf_counter() - t
            if compile_s is not None:
                result.compile_s = compile_s
        # Commit the measurement first: a kill after this line loses nothing (restart repairs the trial).
        self.store.add_measurement(run_id, problem, cfg, result, source=item.source, study_name=name,
                                   trial_number=study_trial.number)
        study_trial.set_user_attr("status", result.status)
        study_trial.set_user_attr("config", cfg.to_json())
        if result.error:
            study_trial.set_user_attr("error", result.error[:1000])
        self._tell(study_trial, result.median_us if result.status == "ok" else None)
        ps.measured_now += 1
        if result.status != "ok":
            ps.failures[result.status] = ps.failures.get(result.status, 0) + 1
        elif ps.best_us is None or result.median_us < ps.best_us:
            ps.best_us, ps.best_config = result.median_us, cfg
        if cfg == default and result.status == "ok":
            ps.default_us = result.median_us
        self.emit("trial", {"problem": problem, "config": cfg, "result": result, "best_us": ps.best_us,
                            "default_us": ps.default_us, "number": study_trial.number})

    def _tell(self, trial, value: float | None) -> None:
        TS = self._optuna.trial.TrialState
        study = trial.study
        if value is None or not math.isfinite(value):
            study.tell(trial, state=TS.FAIL)
        else:
            study.tell(trial, value)
        with self._lock:
            self._running.pop(trial._trial_id, None)
