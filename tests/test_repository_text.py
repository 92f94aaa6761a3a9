"""The repository as a reader meets it: no file speaks of one particular environment's machines or holds an
absolute path of a machine (a report, a log or a doc written on it), and every module of the package stays a size
one can hold in mind (one job each)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Spelled in pieces, so that this file does not match itself.
ENVIRONMENT_WORDS = ("project's " + "machines", "this " + "workplace", "device " + "tool")
MACHINE_PATHS = ("/" + "work/", "/" + "root/", "/" + "home/")


def _tracked_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to know which files belong to the repository")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    files = []
    for name in filter(None, names.split("\0")):
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:  # text, not a database or an image
            files.append(path)
    return files


def test_no_file_describes_an_environment_or_holds_a_machine_path():
    found = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        # Tests may build such paths as inputs (a fake home folder); everything else must not hold one.
        needles = ENVIRONMENT_WORDS if path.relative_to(ROOT).parts[0] == "tests" else ENVIRONMENT_WORDS + MACHINE_PATHS
        for needle in needles:
            if needle in text:
                found.append(f"{path.relative_to(ROOT)}: {needle!r}")
    assert not found, found


MAX_MODULE_LINES = 400
PACKAGE_FOLDERS = ("kernels", "tuner", "commands", "configs")


def test_every_module_of_the_package_stays_under_400_lines():
    modules = [ROOT / "cli.py"] + [p for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py")]
    too_long = {str(p.relative_to(ROOT)): n for p in modules
                if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert not too_long, f"split these by job: {too_long}"
