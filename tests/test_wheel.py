"""The wheel: one `normtune` package holding the runtime, the tuner, the CLI and the shipped tables, and nothing
with a generic top-level name (kernels, tuner, cli, tests) landing in site-packages.

Built from a copy of the working tree (the files git would track, results.db and docs left out) so that the
build leaves nothing behind in the checkout.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and not f.startswith(("docs/", ".")) and f != "results.db"
            and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know which files belong to the tree")
    src = tmp_path_factory.mktemp("src")
    for rel in _tree_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest)
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                             "--no-index", "-q", "-w", str(dist), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = dist.glob("normtune-*.whl")
    return path


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("normtune/__init__.py", "normtune/configs/h100.json", "normtune/configs/h200.json",
                     "normtune/configs/__init__.py", "normtune/cli.py", "normtune/kernels/__init__.py",
                     "normtune/kernels/select/tables.py", "normtune/kernels/api/ops.py",
                     "normtune/kernels/patching/patch.py", "normtune/tuner/__init__.py",
                     "normtune/tuner/store/database.py",
                     "normtune/commands/common.py"):
        assert required in names, required
    dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert len(dist_info) == 1
    tops = {n.split("/")[0] for n in names} - dist_info
    assert tops == {"normtune"}, f"top-level entries besides normtune: {sorted(tops - {'normtune'})}"
    # Nothing but the runtime, the tuner, the CLI (and its commands) and the tables: no tests, databases or docs.
    subpackages = {n.split("/")[1] for n in names if n.startswith("normtune/") and n.count("/") >= 2}
    assert subpackages == {"kernels", "tuner", "commands", "configs"}
    assert {n for n in names if n.startswith("normtune/") and n.count("/") == 1} == {"normtune/__init__.py",
                                                                                    "normtune/cli.py"}
    assert not [n for n in names if n.endswith((".db", ".png", ".md")) or "/tests/" in n or "/docs/" in n]
    # Every module of the source tree is in the wheel, those of subpackages (`packages` is an explicit list) too.
    for pkg in ("kernels", "tuner", "commands", "configs"):
        for module in (ROOT / pkg).rglob("*.py"):
            assert f"normtune/{module.relative_to(ROOT).as_posix()}" in names


def test_wheel_metadata(wheel):
    z = zipfile.ZipFile(wheel)
    (info,) = {n.split("/")[0] for n in z.namelist() if ".dist-info/" in n}
    entry_points = configparser.ConfigParser()
    entry_points.read_string(z.read(f"{info}/entry_points.txt").decode())
    assert dict(entry_points["console_scripts"]) == {"normtune": "normtune.cli:main"}
    assert z.read(f"{info}/top_level.txt").decode().split() == ["normtune"]
    metadata = z.read(f"{info}/METADATA").decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = sorted(r.split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r)
    assert runtime == ["torch", "triton"]  # the tuner's dependencies are the [tune] extra
    assert any("optuna" in r and 'extra == "tune"' in r for r in requires)


def test_pyproject_files_exist():
    """pyproject.toml names a readme and license files: without them the wheel has no description and
    setuptools only warns (the unmatched license-files pattern is deprecated, later an error)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    missing = [name for name in [project.get("readme"), *project.get("license-files", [])]
               if isinstance(name, str) and not list(ROOT.glob(name))]
    assert not missing, f"pyproject.toml names {missing}, missing from {ROOT}"


def test_installed_wheel_finds_its_tables(wheel, tmp_path):
    """Unpacked on sys.path ahead of the checkout: the package data is read from the wheel's files."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import normtune.kernels.select.tables as t, normtune.cli as c; "
            "paths = [x.path for x in t.shipped_tables()]; "
            "print(t.__file__); print(c.__file__); print('\\n'.join(paths)); "
            "print(sorted(x.gpu_name for x in t.shipped_tables()))")
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(line.startswith(str(site)) for line in lines[:-1]), lines
    assert len(lines) == 5 and lines[-1] == "['NVIDIA H100 80GB HBM3', 'NVIDIA H200']"
