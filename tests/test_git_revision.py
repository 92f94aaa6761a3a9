"""The git revision every run records is read without taking git's index lock: a git command the user runs at the
same moment must not fail on .git/index.lock."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from normtune.tuner import gpu_info

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_the_revision_is_read_while_another_git_command_holds_the_index_lock(repo, monkeypatch):
    calls = []
    real_run = subprocess.run

    def recording_run(args, *more, **kwargs):
        calls.append((list(args), (kwargs.get("env") or {}).get("GIT_OPTIONAL_LOCKS")))
        return real_run(args, *more, **kwargs)

    head = _git(repo, "rev-parse", "HEAD").strip()
    monkeypatch.setattr(gpu_info.subprocess, "run", recording_run)
    monkeypatch.delenv("NORMTUNE_GIT_REVISION", raising=False)
    gpu_info.git_revision.__wrapped__()  # this checkout's, as a sweep or bench records it
    assert calls and all(args[1] != "status" for args, _ in calls), calls
    lock = repo / ".git" / "index.lock"
    lock.write_text("held by the user's git commit")
    (repo / "a.py").write_text("x = 2\n")  # a change whose stat info differs from the index's
    assert gpu_info.read_revision(str(repo)) == f"{head}-dirty"
    assert lock.read_text() == "held by the user's git commit"  # not taken over, not removed
    lock.unlink()
    (repo / "a.py").write_text("x = 1\n")
    assert gpu_info.read_revision(str(repo)) == head
    assert not lock.exists()
    assert calls and all(args[0] == "git" and args[1] != "status" for args, _ in calls), calls
    assert all(optional_locks == "0" for _, optional_locks in calls), calls


def test_outside_git_there_is_no_revision(tmp_path):
    assert gpu_info.read_revision(str(tmp_path)) is None
