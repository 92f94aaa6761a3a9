"""The live progress of a tune, one line on stderr (rich): the phase, the time left of the budget, the trials
measured of those planned (the sweeps' and the validation's reference sweeps'), and the held-out regret of the
latest validated table. The trial counts are read from the database every POLL_S, so they include every worker's
and every host's trials."""

from __future__ import annotations

import threading

from ..tables.validate import REFERENCE_PREFIX

POLL_S = 1.0


class Progress:
    def __init__(self, console, ctx):
        self.console, self.ctx = console, ctx
        self._phase, self._regret, self._trials = "starting", None, None
        self._stop = threading.Event()

    def phase(self, text: str) -> None:
        self._phase = text

    def regret(self, value: float | None) -> None:
        self._regret = value

    def _count(self) -> tuple[int, int]:
        ctx = self.ctx
        targets = ctx.targets()
        fit = {ctx.plan.study(p): targets.get(p.key, 0) for p in ctx.fit_problems()}
        progress = {s.study_name: s.finished for s in ctx.store.workers.study_progress(ctx.plan.study_prefix + ":")}
        done = sum(min(progress.get(name, 0), target) for name, target in fit.items())
        refs = {s.study_name: s.finished for s in ctx.store.workers.study_progress(REFERENCE_PREFIX + ":")}
        from ..sweep.options import study_name

        names = [study_name(ctx.plan.gpu_key, p, ctx.plan.interpret, REFERENCE_PREFIX) for p in ctx.heldout]
        done += sum(min(refs.get(n, 0), ctx.plan.reference_trials) for n in names)
        return done, sum(fit.values()) + len(names) * ctx.plan.reference_trials

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self._trials = self._count()
            except Exception:  # noqa: BLE001 - the line only shows what it can read
                pass
            self._stop.wait(POLL_S)

    def line(self) -> str:
        ctx = self.ctx
        parts = [f"tune {ctx.plan.gpu_key}", self._phase]
        left = ctx.clock.left_s()
        if left is not None:
            parts.append(f"{max(0.0, left):.0f} s of {ctx.clock.budget_s:.0f} s left")
        if self._trials is not None:
            done, planned = self._trials
            parts.append(f"trials {done} of {planned} planned ({max(0, planned - done)} left)")
        parts.append("held-out regret " + ("not validated yet" if self._regret is None else f"{self._regret:.3f}"))
        return " · ".join(parts)

    def __enter__(self):
        from rich.live import Live
        from rich.text import Text

        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        self._live = Live(get_renderable=lambda: Text(self.line()), console=self.console, refresh_per_second=2,
                          transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._live.__exit__(*exc)
        if not self.console.is_terminal:  # redirected: the last frame ends without a newline of its own
            self.console.line()
        self._thread.join(timeout=5)
