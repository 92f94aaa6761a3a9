"""The console script (`cli.main`) ends the process as soon as the command is done (`cli.end`, no interpreter
teardown), with the command's exit code and all of its output, and exits the usual way while something the
command started still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(body: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", body, *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_output_and_exit_code_of_a_command_come_through():
    done = _script("import sys; sys.argv[0] = 'normtune'; from normtune.cli import main; main()", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("normtune ")
    refused = _script("import sys; sys.argv[0] = 'normtune'; from normtune.cli import main; main()", "--no-such")
    assert refused.returncode == 2
    assert "--no-such" in refused.stderr


def test_a_message_exit_prints_it_and_exits_1():
    done = _script("from normtune.cli import end; print('written', flush=False); end('error: the message')")
    assert done.returncode == 1
    assert done.stdout == "written\n"
    assert done.stderr.strip() == "error: the message"


def test_a_running_thread_or_child_process_is_waited_for():
    thread = _script("import threading, time\n"
                     "def late():\n    time.sleep(0.5); print('thread finished', flush=True)\n"
                     "threading.Thread(target=late).start()\n"
                     "from normtune.cli import end; end(3)")
    assert thread.returncode == 3
    assert "thread finished" in thread.stdout
    child = _script("import multiprocessing as mp, time\n"
                    "def late():\n    time.sleep(0.5); print('child finished', flush=True)\n"
                    "if __name__ == '__main__':\n"
                    "    mp.set_start_method('fork'); mp.Process(target=late).start()\n"
                    "    from normtune.cli import end; end(0)")
    assert child.returncode == 0
    assert "child finished" in child.stdout


def test_what_ends_within_the_grace_period_still_ends_without_the_teardown():
    """A thread finishing and a child just killed (a compile pool stopped as the command returns) are waited for
    briefly; then the process ends at once: the interpreter's teardown (its exit handlers) does not run."""
    done = _script("import atexit, multiprocessing as mp, threading, time\n"
                   "from normtune.cli import end\n"
                   "def late():\n    time.sleep(0.05)\n"
                   "if __name__ == '__main__':\n"
                   "    atexit.register(lambda: print('teardown ran', flush=True))\n"
                   "    mp.set_start_method('fork'); child = mp.Process(target=time.sleep, args=(30,)); child.start()\n"
                   "    time.sleep(0.2); threading.Thread(target=late).start(); child.kill(); end(4)")
    assert done.returncode == 4, done.stderr
    assert "teardown ran" not in done.stdout


def test_the_console_script_is_main():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'normtune = "normtune.cli:main"' in text


def test_no_semaphore_is_reported_leaked():
    """The named semaphores of a compile pool and a shared counter are unlinked before the process ends without
    its teardown, so multiprocessing's resource tracker has nothing to warn about."""
    done = _script("import multiprocessing as mp\n"
                   "from concurrent.futures import ProcessPoolExecutor\n"
                   "from normtune.cli import end\n"
                   "if __name__ == '__main__':\n"
                   "    ctx = mp.get_context('spawn'); counter = ctx.Value('i', 0)\n"
                   "    pool = ProcessPoolExecutor(1, mp_context=ctx); pool.submit(abs, -1).result()\n"
                   "    pool.shutdown(wait=True)\n"
                   "    end(0)")
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
