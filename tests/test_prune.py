"""`normtune prune`: the Optuna studies of superseded search spaces go, every measurement and the live studies
stay (interpreted sweep on CPU)."""

from __future__ import annotations

import optuna
from sweep_support import sweep_args
from test_sweep import RMS_A, invoke, names, sqlite_url

from normtune.tuner.store.database import Store


def _old_copy(url: str, tag: str) -> str:
    """A copy of RMS_A's study under another space tag: what a sweep of an older search space left."""
    name = names(RMS_A)[0].rsplit(":space-", 1)[0] + f":space-{tag}"
    optuna.copy_study(from_study_name=names(RMS_A)[0], from_storage=url, to_storage=url, to_study_name=name)
    return name


def test_prune_drops_superseded_studies_and_keeps_measurements(tmp_path):
    url = sqlite_url(tmp_path)
    assert invoke(sweep_args(url, trials=3)).exit_code == 0
    old, held = _old_copy(url, "00000000"), _old_copy(url, "11111111")
    with Store(url) as store:
        run_id = store.runs()[0].id
        assert store.workers.claim_slot(held, 1, run_id) == (0, None)  # an unmeasured slot: a worker may still use it
        before = [(m.id, m.config, m.median_us) for m in store.measurements()]

    dry = invoke(["prune", "--db", url, "--dry-run"])
    assert dry.exit_code == 0 and "would drop 1 superseded studies (3 trials)" in dry.output
    assert sorted(optuna.get_all_study_names(url)) == sorted([names(RMS_A)[0], old, held])

    result = invoke(["prune", "--db", url])
    assert result.exit_code == 0 and "dropped 1 superseded studies (3 trials)" in result.output
    assert sorted(optuna.get_all_study_names(url)) == sorted([names(RMS_A)[0], held])
    with Store(url) as store:
        assert [(m.id, m.config, m.median_us) for m in store.measurements()] == before
    assert "dropped 0 superseded studies" in invoke(["prune", "--db", url]).output
    # The live study resumes where it was.
    assert invoke(sweep_args(url, trials=4)).exit_code == 0
    with Store(url) as store:
        assert len(store.measurements(study_name=names(RMS_A)[0])) == 4
