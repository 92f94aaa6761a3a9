"""$NORMTUNE_HIDE_TABLES (`kernels/select/table_chain.py`): the lookup chain without the user and shipped tables, as
`normtune tune --as-new-gpu` runs it, so that a GPU with a shipped table can be tuned as if nobody had."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from normtune.kernels.config import Problem, default_config
from normtune.kernels.select.select import clear_caches, explain, select_config
from normtune.kernels.select.table_chain import ENV_VAR, HIDE_VAR, HOME_VAR, choose_table, tables_hidden, user_dir

H100_NAME = "NVIDIA H100 80GB HBM3"
PROBLEM = Problem("rms_norm", 4096, 8192, "bf16")
SHIPPED_H100 = Path(str(resources.files("normtune.configs"))) / "h100.json"


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(HIDE_VAR, raising=False)
    monkeypatch.setenv(HOME_VAR, str(tmp_path / "home"))
    clear_caches()
    yield
    clear_caches()


def test_hidden_tables_leave_the_h100_and_its_same_capability_siblings_to_the_defaults(monkeypatch):
    shipped = choose_table(H100_NAME, (9, 0))
    assert shipped.table is not None and shipped.table.gpu_key == "h100"
    assert select_config(PROBLEM, H100_NAME, (9, 0)) != default_config(PROBLEM)  # the shipped rule answers
    monkeypatch.setenv(HIDE_VAR, "1")
    clear_caches()
    assert tables_hidden()
    for name in (H100_NAME, "NVIDIA H100 PCIe", "NVIDIA GH200 480GB"):  # exact, same family, same capability
        choice = choose_table(name, (9, 0))
        assert choice.table is None and choice.warning is None, name
        assert [s.source for s in choice.steps] == ["env", "user", "shipped", "default"]
        assert all(HIDE_VAR in s.detail for s in choice.steps if s.source in ("user", "shipped"))
    assert select_config(PROBLEM, H100_NAME, (9, 0)) == default_config(PROBLEM)
    assert explain(PROBLEM, H100_NAME, (9, 0)).table is None


def test_hidden_tables_hide_the_user_table_too_but_not_an_explicit_one(monkeypatch, tmp_path):
    user_dir().mkdir(parents=True)
    (user_dir() / "h100.json").write_text(SHIPPED_H100.read_text())
    monkeypatch.setenv(HIDE_VAR, "yes")
    clear_caches()
    assert choose_table(H100_NAME, (9, 0)).table is None
    explicit = tmp_path / "mine.json"
    explicit.write_text(json.dumps(json.loads(SHIPPED_H100.read_text())))
    monkeypatch.setenv(ENV_VAR, str(explicit))
    clear_caches()
    assert choose_table(H100_NAME, (9, 0)).table.path == str(explicit)


def test_zero_or_empty_does_not_hide(monkeypatch):
    for value in ("", "0"):
        monkeypatch.setenv(HIDE_VAR, value)
        clear_caches()
        assert not tables_hidden()
        assert choose_table(H100_NAME, (9, 0)).table is not None


def test_a_gpu_without_a_table_is_told_to_run_tune():
    choice = choose_table("NVIDIA RTX PRO 6000 Blackwell", (12, 0))
    assert choice.table is None
    assert "To tune it: `normtune tune --gpu auto`, which writes the user table" in choice.warning, choice.warning
