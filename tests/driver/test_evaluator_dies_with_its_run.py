"""The evaluator dies with its run (issue 30, group 8): a task's ``evaluate`` that hangs is ended at
``limits.evaluate_seconds`` with one sentence; a run killed with SIGKILL while its evaluator is stuck in a hung
``evaluate`` leaves no evaluator behind (the parent-death signal), so ``--resume`` proceeds at once; and a folder
lock held by a live process that is not the one that took it is refused naming that process's pid. The task is
tests/tasks/failing_task.py with ``TASK_FAIL=hang_evaluate``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import support
from tests.support.cli import call_cli

TASK_SOURCE = (Path(__file__).resolve().parents[1] / "tasks" / "failing_task.py").read_text()
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}


def _freeze(project, **limits):
    project.entry = project.task_module(TASK_SOURCE, "FailingDigits")
    project.freeze(entry=project.entry, budget={"clock": "updates", "amount": 8, "fractions": [0.5, 1.0]},
                   training={"checkpoint_every": 0.5}, arms={"adamw": ADAMW}, limits=limits or None)
    return project


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_hung_evaluate_is_ended_at_its_limit_with_a_sentence(project, tmp_path):
    _freeze(project, evaluate_seconds=2)
    hang = tmp_path / "evaluator.pid"
    child = support.spawn(project, project.run_args("adamw", 1), TASK_FAIL="hang_evaluate", TASK_HANG_PID=str(hang))
    support.wait_for(hang, child)
    hung_at = time.monotonic()
    out, err = child.communicate(timeout=120)
    waited = time.monotonic() - hung_at
    assert child.returncode == 1, err
    assert (f"opalctl: error: task {project.entry}'s evaluate ran past limits.evaluate_seconds (2 s) on split "
            f"'development', so the evaluator ended it") in err
    assert "--resume` continues the run" in err or "continues the run" in err
    assert waited < 2 + 8, waited  # the limit, and the time a loaded machine takes to exit
    assert not _alive(int(hang.read_text()))


def test_a_run_killed_while_its_evaluate_hangs_leaves_no_evaluator_and_resumes(project, tmp_path):
    _freeze(project)  # the default limit (an hour): only the run's death can end the evaluator here
    hang = tmp_path / "evaluator.pid"
    child = support.spawn(project, project.run_args("adamw", 1), TASK_FAIL="hang_evaluate", TASK_FAIL_AT="4",
                        TASK_HANG_PID=str(hang))  # the 4th evaluate: stage 1's first split
    support.wait_for(hang, child)
    evaluator = int(hang.read_text())
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    deadline = time.monotonic() + 2
    while _alive(evaluator) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(evaluator), "the evaluator outlived its killed run"
    started = time.monotonic()
    resumed = call_cli(*project.run_args("adamw", 1, "--resume"))  # no lock wait: it may run in this process
    assert resumed.code == 0, resumed.stderr
    assert "another opalctl process" not in resumed.stderr
    assert time.monotonic() - started < 120
    assert support.read(project.run_dir("adamw", 1) / "report.json")["updates"] == 8


def test_a_sigterm_to_a_run_whose_evaluate_hangs_ends_it_and_its_evaluator_in_seconds(project, tmp_path):
    _freeze(project)
    hang = tmp_path / "evaluator.pid"
    child = support.spawn(project, project.run_args("adamw", 1), TASK_FAIL="hang_evaluate", TASK_FAIL_AT="4",
                        TASK_HANG_PID=str(hang))
    support.wait_for(hang, child)
    evaluator = int(hang.read_text())
    signalled = time.monotonic()
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM, err
    # the evaluate hangs until a file that never comes exists, so a run that waited for its evaluator would not end
    # at all; the bound is loose because a loaded host takes seconds to start tearing down a run (5 s failed once)
    assert time.monotonic() - signalled < 30, "the run waited for its evaluator"
    assert "--resume" in err
    assert not _alive(evaluator)


HOLDER = '''
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
if os.fork() == 0:  # the child keeps the lock; the process that took it ends, as a killed run does
    os.setsid()
    print(os.getpid(), flush=True)
    time.sleep(120)
os._exit(0)
'''


def test_a_lock_held_by_a_live_process_that_did_not_take_it_is_refused_naming_its_pid(project, monkeypatch):
    import opalctl.driver.run
    from opalctl.layout import RunLayout

    _freeze(project)
    lock_file = RunLayout.of(project.run_dir("adamw", 1)).folder_lock
    lock_file.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_file)], stdout=subprocess.PIPE, text=True)
    pid = int(holder.stdout.readline())
    holder.wait(timeout=60)
    holder.stdout.close()
    try:
        monkeypatch.setattr(opalctl.driver.run, "LOCK_WAIT_SECONDS", 1.0)
        code, _, err = call_cli(*project.run_args("adamw", 1))
        assert code == 2, err
        assert f"another opalctl process (pid {pid}) is running" in err
    finally:
        os.kill(pid, signal.SIGKILL)


def test_limits_evaluate_seconds_is_frozen_with_its_default_and_refused_when_not_positive(project):
    from opalctl.errors import BadInput

    assert support.read(_freeze(project).lock)["protocol"]["limits"]["evaluate_seconds"] == 3600.0
    assert support.read(_freeze(project, evaluate_seconds=2).lock)["protocol"]["limits"]["evaluate_seconds"] == 2.0
    for seconds in (0, -1, "soon"):
        with pytest.raises(BadInput, match=r"limits.evaluate_seconds: input should be (greater than 0|a valid number)"):
            _freeze(project, evaluate_seconds=seconds)
