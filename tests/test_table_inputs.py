"""Table files a hostile or careless user may hand normtune: a rule's `fitted_on` that is not a list of shapes (it
would drop the rule's shape limits), JSON nested 200,000 levels deep, bytes that are not UTF-8, and an
interpreter table compared for a GPU. Each is refused in one line naming the file, wherever the table comes in."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.select.select import clear_caches
from normtune.kernels.select.table_chain import ENV_VAR, HOME_VAR, table_for
from normtune.kernels.select.tables import TableError, read_table

CONFIGS = Path(str(resources.files("normtune.configs")))
RMS_KEY = "rms_norm/bf16/wbf16/nobias/save-input"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv(HOME_VAR, str(tmp_path / "normtune-home"))
    clear_caches()
    yield
    clear_caches()


def _with_fitted_on(tmp_path, value) -> Path:
    data = json.loads((CONFIGS / "h100.json").read_text())
    data["families"][RMS_KEY]["rules"][0]["fitted_on"] = value
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("value", [["-5x-5"], "4096x8192", ["4096x0"], ["4096"], [4096], [["64", "256"]],
                                   ["0064x256"], {"M": 64}])
def test_a_fitted_on_that_is_not_a_list_of_shapes_is_refused(tmp_path, value):
    path = _with_fitted_on(tmp_path, value)
    with pytest.raises(TableError) as err:
        read_table(str(path))
    message = str(err.value)
    assert str(path) in message and "rule 0" in message and "fitted_on=" in message and "MxN" in message


def test_a_table_fitted_on_shapes_still_loads(tmp_path):
    assert read_table(str(_with_fitted_on(tmp_path, ["64x128", "4096x128"]))).families[RMS_KEY]


def _deep(tmp_path) -> Path:
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return path


def _latin1(tmp_path) -> Path:
    path = tmp_path / "latin1.json"
    text = json.dumps({"schema_version": 1, "gpu": {"name": "GPU caf\u00e9"}}, ensure_ascii=False)
    path.write_bytes(text.encode("latin-1"))
    return path


BAD_FILES = {"deep": (_deep, "nests too deeply"), "latin1": (_latin1, "not valid UTF-8")}


def _one_error(result, path: Path, words: str) -> None:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert str(path) in lines[0] and words in lines[0], lines[0]


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_deep_or_non_utf8_table_is_one_error_naming_the_file(tmp_path, monkeypatch, case):
    make, words = BAD_FILES[case]
    path = make(tmp_path)
    with pytest.raises(TableError, match=words) as err:
        read_table(str(path))
    assert str(path) in str(err.value)
    runner = CliRunner()
    _one_error(runner.invoke(app, ["where", "--gpu", "h100", "--shape", "64x256", "--config-file", str(path)]),
               path, words)
    clear_caches()
    _one_error(runner.invoke(app, ["compare", str(path), str(CONFIGS / "h100.json"), "--dry-run", "--gpu", "h100",
                                   "--shapes", "64x256"]), path, words)
    clear_caches()
    _one_error(runner.invoke(app, ["emit", "--gpu", "h100", "--runs-of", str(path), "--out",
                                   str(tmp_path / "out.json")]), path, words)
    monkeypatch.setenv(ENV_VAR, str(path))
    clear_caches()
    with pytest.raises(TableError, match=words):
        table_for("NVIDIA H100 80GB HBM3")
    clear_caches()
    _one_error(runner.invoke(app, ["where", "--gpu", "h100", "--shape", "64x256"]), path, words)


def test_compare_refuses_an_interpreter_table_for_a_gpu(tmp_path):
    data = json.loads((CONFIGS / "h100.json").read_text())
    data["interpret"] = True
    path = tmp_path / "interp.json"
    path.write_text(json.dumps(data))
    for more in (["--dry-run", "--gpu", "h100"], ["--dry-run"]):
        clear_caches()
        result = CliRunner().invoke(app, ["compare", str(CONFIGS / "h100.json"), str(path), "--shapes", "64x256",
                                          *more])
        _one_error(result, path, "Triton-interpreter timings")
