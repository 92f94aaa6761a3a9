"""docs/results-db.md against the committed results.db: its pandas recipe, run as written on the file (read-only),
keeps the plain norms and their fused residual form apart and finds the same best config as the store; and the
Optuna dashboard hint promises no study the shipped file lacks."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from normtune.kernels.config import Problem
from normtune.tuner.store.database import Store

ROOT = Path(__file__).resolve().parents[1]
REPO_DB = ROOT / "results.db"
PAGE = (ROOT / "docs" / "results-db.md").read_text()
needs_db = pytest.mark.skipif(not REPO_DB.is_file(), reason="no committed results.db")


def recipe() -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", PAGE, re.S) if "pd.read_sql" in b]
    assert len(blocks) == 1, "docs/results-db.md should hold one pandas recipe"
    return blocks[0]


@pytest.fixture(scope="module")
def ran():
    """The recipe's variables after running it in the repository root (where it opens results.db)."""
    if not REPO_DB.is_file():
        pytest.skip("no committed results.db")
    before = REPO_DB.stat().st_mtime_ns, sorted(p.name for p in ROOT.iterdir() if p.name.startswith("results.db"))
    namespace: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        exec(compile(recipe(), "docs/results-db.md", "exec"), namespace)
    try:
        after = REPO_DB.stat().st_mtime_ns, sorted(p.name for p in ROOT.iterdir() if p.name.startswith("results.db"))
        assert after == before, "the recipe wrote to results.db or beside it"
        yield namespace
    finally:
        namespace["con"].close()


@needs_db
def test_the_recipe_opens_the_file_read_only(ran):
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        ran["con"].execute("CREATE TABLE should_fail (x)")


@needs_db
def test_the_recipe_tells_plain_and_fused_problems_apart(ran):
    m, best = ran["m"], ran["best"]
    assert m.residual.any() and not m.residual.all(), "results.db holds plain and fused problems of the H100"
    assert set(m.residual[m.family_key.str.endswith("/res-bf16")]) == {True}
    assert not best.duplicated(["family_key", "M", "N"]).any()
    # A seed shape measured in both forms has two bests, one of each form.
    both = best[(best.norm == "layer_norm") & (best.dtype == "bf16") & (best.M == 8192) & (best.N == 4096)]
    assert sorted(both.residual) == [False, True]
    assert len(best) == len(m.groupby(["family_key", "M", "N"]))


@needs_db
@pytest.mark.parametrize("residual", [False, True])
def test_the_recipes_best_is_the_stores(ran, residual):
    """The best of a plain problem and of its fused form are the ones `Store.best` (the report's) finds."""
    problem = Problem("rms_norm", 8192, 4096, "bf16", residual=residual, residual_dtype="bf16" if residual else None)
    best = ran["best"]
    row = best[best.family_key == problem.family.key].set_index(["M", "N"]).loc[(problem.M, problem.N)]
    with Store.for_reading(f"sqlite:///{REPO_DB}") as store:
        stored = store.best(problem, gpu_key="h100")
    assert stored is not None and row.median_us == pytest.approx(stored.median_us)


@needs_db
def test_the_peers_are_joined_to_their_problems(ran):
    peers = ran["peers"]
    assert {"family_key", "peer", "median_us"} <= set(peers.columns) and len(peers) > 0


@needs_db
def test_the_dashboard_hint_promises_no_study_the_file_lacks():
    con = sqlite3.connect(f"file:{REPO_DB}?mode=ro", uri=True)
    try:
        studies = con.execute("SELECT count(*) FROM studies").fetchone()[0]
    finally:
        con.close()
    docs = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")} | {"README.md": (ROOT / "README.md").read_text()}
    pointing = [name for name, text in docs.items() if re.search(r"optuna-dashboard\s+sqlite:///results\.db", text)]
    if studies == 0:
        assert not pointing, f"these pages open the shipped results.db, which holds no study, in optuna-dashboard: {pointing}"
        assert "holds no Optuna studies" in PAGE


def test_the_study_names_the_page_gives_are_the_ones_written():
    """The validation's reference sweeps are named `normtune-validate-unseeded:…` (an older page gave
    `normtune-validate:`, with which `normtune status --prefix` finds nothing); `status --help`, which names the
    prefixes it knows, agrees."""
    from normtune.commands.status import PREFIXES
    from normtune.tuner.tables.validate import REFERENCE_PREFIX

    named = set(re.findall(r"normtune-validate[\w-]*:", PAGE))
    assert named == {f"{REFERENCE_PREFIX}:"}, named
    assert f"{REFERENCE_PREFIX}:" in PREFIXES
