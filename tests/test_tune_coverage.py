"""Where `normtune tune` fits and validates by default (the `span` set beside seed and llm, the generated held-out
shapes over the same region), how it keeps buying quality with time left after its rounds, and what its report and
`normtune compare`'s markdown say about where they ran. No measuring: fast."""

from __future__ import annotations

import math

from normtune.kernels.config import MAX_N, Problem
from normtune.tuner.shapes import FEW, HELDOUT, LLM, LLM_HIDDEN, PRESETS, SEED, SPAN, parse_shapes, span_shapes
from normtune.tuner.tune import unseen


def test_the_span_set_covers_narrow_and_few_row_shapes_and_never_the_heldout_preset():
    assert span_shapes() == SPAN and parse_shapes("span") == list(SPAN) and PRESETS["span"] == SPAN
    assert len(SPAN) == len(set(SPAN)) and not set(SPAN) & set(HELDOUT)
    widths, rows = {N for _, N in SPAN}, {M for M, _ in SPAN}
    assert min(widths) == 128 and max(widths) == 65536 and min(rows) == 64 and max(rows) >= 200_000
    # the lattice's corner on a held-out shape moved one row step outward: a table's box reaches past every
    # held-out shape's rows
    assert max(M for M, N in SPAN if N == 128) > max(M for M, N in HELDOUT)
    # one width in every power-of-two range of columns: rules serve widths up to the power of two their own
    # rounds up to, so a range without a fitted width would run a neighbour's tiles padded to another length
    fitted_widths = {N for _, N in SEED + LLM + FEW + SPAN}
    for top in (256 << k for k in range(9)):
        assert any(top // 2 < N <= top for N in fitted_widths), top
    assert any(N & (N - 1) for N in widths) and any(M & (M - 1) for M in rows)  # not only powers of two
    assert any(N <= 1024 and M >= 100_000 for M, N in SPAN)  # narrow rows, very many of them
    assert any(M <= 256 and N <= 2048 for M, N in SPAN) and any(M <= 256 and N >= 16384 for M, N in SPAN)
    assert all(N % (64 if N >= 1024 else 8) == 0 and N <= MAX_N for _, N in SPAN)


def test_the_default_plan_adds_the_span_set_within_a_sensible_problem_count():
    from normtune.commands.tune import _problems

    problems, notes = _problems(None, None, None, None, None, "plain,residual", False)
    shapes = {(p.M, p.N) for p in problems}
    assert shapes == set(SEED) | set(LLM) | set(FEW) | set(SPAN) and not notes
    assert not shapes & set(HELDOUT)
    assert 196 < len(problems) <= 340


def test_every_model_width_is_fitted_on_few_rows_as_well_as_many():
    """A table's rules are bucketed by width: a width fitted only on tall shapes would give its few-row calls the
    tall config. `few` adds few-row shapes where `llm` has none, never a held-out one."""
    assert PRESETS["few"] == FEW and parse_shapes("few") == list(FEW) and not set(FEW) & set(HELDOUT)
    fitted = set(LLM) | set(FEW)
    for N in LLM_HIDDEN:
        assert any(M <= 512 for M, n in fitted if n == N) and any(M >= 4096 for M, n in fitted if n == N), N
    assert not set(FEW) & set(LLM)


def _octant(value: float, lo: float, hi: float, parts: int) -> int:
    return min(parts - 1, max(0, int(parts * math.log(value / lo) / math.log(hi / lo))))


def test_generated_heldout_shapes_span_the_fitted_region_and_stay_within_its_size():
    fitted = [Problem("rms_norm", M, N, "bf16") for M, N in SEED + LLM + SPAN]
    drawn = unseen.unseen_problems(fitted, 8, "seed-1")
    assert len(drawn) == 8 and drawn == unseen.unseen_problems(fitted, 8, "seed-1")
    most = max(p.M * p.N for p in fitted)
    assert all(p.M * p.N <= most and (p.M, p.N) not in set(HELDOUT) for p in drawn)
    inside = [p for p in drawn if 128 <= p.N <= 65536]
    # the draws inside the range fall in distinct log-slices of the widths: narrow ones among them
    assert len({_octant(p.N, 128, 65536, 8) for p in inside}) == len(inside) >= 4
    assert any(p.N <= 1024 for p in drawn) and any(p.M <= 512 for p in drawn)


def test_the_report_names_the_gpu_in_its_plot_and_shows_the_table_path_as_given(tmp_path, monkeypatch):
    from pathlib import Path
    from types import SimpleNamespace

    from normtune.tuner.report import plots
    from normtune.tuner.tune import journal as J
    from normtune.tuner.tune import report

    titles = []

    def save(self, fig, name):
        titles.append(fig.axes[0].get_title())
        return f"![{name}]({name})"

    monkeypatch.setattr(plots.Pictures, "save", save)
    summary = {"geomean_regret": 1.05, "worst_regret": 1.2, "shapes": 4}
    attrs = {J.VALIDATIONS: [{"emission": 3, "elapsed_s": 12.0, "summary": summary, "default_regret": 1.1}]}
    journal = SimpleNamespace(get=lambda key, default=None: attrs.get(key, default), elapsed_s=lambda: 12.0)
    ctx = SimpleNamespace(
        journal=journal, info=SimpleNamespace(name="NVIDIA H200"), heldout=[], fit_problems=lambda: [],
        plan=SimpleNamespace(tune_id="abc", gpu_key="h200", interpret=False, reference_trials=8, warm_start=None,
                             as_new_gpu=True), incumbent_label=None, command_line="normtune tune")
    monkeypatch.chdir(tmp_path)
    table = {"families": {}, "provenance": {"tune": {"table": 1}}}
    text = report.write(ctx, Path("report"), Path("out/h200.json"), table, None, None).read_text()
    assert titles == ["Time to table — NVIDIA H200"]
    assert "Table: `out/h200.json` (table 1 of the tune" in text


def test_time_left_after_the_resweeps_buys_more_of_them_past_trials_where_the_regret_is_highest():
    from types import SimpleNamespace

    from normtune.tuner.measure.spread import Ratio
    from normtune.tuner.tune import driver, resweep

    fitted = [Problem("rms_norm", M, N, "bf16") for M, N in ((4096, 1024), (4096, 2048), (4096, 5120))]
    worst = Problem("rms_norm", 3000, 3584, "bf16")
    row = SimpleNamespace(problem=worst, regret=Ratio(1.3, 1.27, 1.33))
    at_trials = {p.key: 40 for p in fitted}
    # every problem near the worst shape already has --trials: nothing more within --trials ...
    within = resweep.decide([row], fitted, [worst], at_trials, trials=40)
    assert all(k not in within["targets"] for k in at_trials)
    # ... but a later resweep with time left may go past it, near the worst shape only
    past = resweep.decide([row], fitted, [worst], at_trials, trials=40, ceiling=80)
    nearest = {k for k in past["targets"] if k in at_trials}
    assert len(nearest) == resweep.NEAREST and all(past["targets"][k] > 40 for k in nearest)
    assert fitted[0].key not in nearest  # the farthest width is not raised

    def ctx(budget):
        return SimpleNamespace(clock=SimpleNamespace(budget_s=budget), plan=SimpleNamespace(trials=40))

    assert driver.resweeps_allowed(ctx(None)) == driver.RESWEEPS
    assert driver.resweeps_allowed(ctx(600.0)) > driver.RESWEEPS
    assert driver.ceiling(ctx(600.0), 0) == 40 and driver.ceiling(ctx(600.0), driver.RESWEEPS) > 40


def test_a_budgeted_resweep_goes_past_trials_when_nothing_is_left_within_them(monkeypatch):
    """With a time budget, a resweep whose shapes' nearest problems all have --trials already raises them past it
    (up to the later resweeps' ceiling) instead of ending the tune with its time unused."""
    from types import SimpleNamespace

    from normtune.tuner.measure.spread import Ratio
    from normtune.tuner.tune import driver
    from normtune.tuner.tune import journal as J

    fitted = [Problem("rms_norm", M, N, "bf16") for M, N in ((4096, 1024), (4096, 2048), (4096, 5120))]
    worst = Problem("rms_norm", 3000, 3584, "bf16")
    bridge = Problem("rms_norm", 4096, 3584, "bf16")  # the fitted row count at the worst shape's width: taken
    row = SimpleNamespace(problem=worst, regret=Ratio(1.3, 1.27, 1.33))
    entries = {J.VALIDATIONS: [{"rows": []}], J.RESWEEPS: []}
    journal = SimpleNamespace(get=lambda k, d=None: entries.get(k, d),
                              append=lambda k, v: entries.setdefault(k, []).append(v), touch=lambda: None)
    swept = []
    monkeypatch.setattr(driver, "rows_of", lambda record: [row])
    monkeypatch.setattr(driver, "sweep_to_targets", lambda ctx, seconds, only: swept.append(only) or True)

    def ctx(budget):
        return SimpleNamespace(clock=SimpleNamespace(budget_s=budget), plan=SimpleNamespace(trials=40),
                               journal=journal, heldout=[worst], progress=None, say=lambda text: None,
                               fit_problems=lambda: fitted + [bridge],
                               targets=lambda: {p.key: 40 for p in fitted + [bridge]})

    assert driver.resweep(ctx(None), 0, None) is None and not swept  # no budget: within --trials only
    assert driver.resweep(ctx(600.0), 0, 60.0) is True
    targets = entries[J.RESWEEPS][0]["targets"]
    assert targets and all(40 < t <= driver.ceiling(ctx(600.0), driver.RESWEEPS) for t in targets.values())


def test_the_first_validation_may_use_all_the_time_left():
    """Until a table of the tune is validated, its validation gets every second the phases have left; later ones
    their share."""
    from types import SimpleNamespace

    from normtune.tuner.tune import driver
    from normtune.tuner.tune import journal as J
    from normtune.tuner.tune.clock import Clock

    entries = {}
    clock = Clock(330.0)
    c = SimpleNamespace(clock=clock, journal=SimpleNamespace(get=lambda k, d=None: entries.get(k, d)))
    assert abs(driver.validation_share(c, "") - clock.free_s()) < 1.0
    entries[J.VALIDATIONS] = [{}]
    assert driver.validation_share(c, "") < 0.5 * clock.free_s()
