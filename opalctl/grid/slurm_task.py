"""One run of a Slurm job array (grid/slurm.py), on the node: ``opalctl run`` in a child process, as locally.

``SlurmRunTask`` is submitit's checkpointable callable. When Slurm warns of the time limit or of a preemption,
submitit's signal (SIGUSR2) reaches this process, and ``checkpoint`` stops the run with SIGTERM (it stays
resumable: docs/architecture.md), waits for it, and hands submitit a fresh task with the same arguments, which
submitit requeues; the next start finds the run folder's resume checkpoint and continues with ``--resume``. The
child starts with SIGUSR2 ignored, since Slurm signals every process of the job and that signal's default would
kill the run before it could stop cleanly.

A task never starts a run another process holds (an older array of the same grid still running, another grid, a
plain ``opalctl run``): it waits for the folder's lock, then does what the folder needs, and answers ``skipped``
when the run finished without it. A lock of several ranks runs under torchrun, as locally.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import submitit

from opalctl.grid.local import GRACE_SECONDS, REFUSALS_RETRIED, child_environment, spawn_run
from opalctl.grid.plan import DONE, RESUME, GridRun
from opalctl.layout import LockRuns
from opalctl.protocol.lock import read_lock

POLL_SECONDS = 0.2


def run_folder(lock: str, runs_dir: str, arm: str, seed: int) -> Path:
    return LockRuns.of(Path(runs_dir), read_lock(Path(lock))).run(arm, seed).root


class SlurmRunTask(submitit.helpers.Checkpointable):
    """``opalctl run`` of one (arm, seed), started with ``--resume`` whenever its folder holds a started run."""

    def __init__(self):
        self.child = None

    def __call__(self, lock: str, runs_dir: str, arm: str, seed: int, threads: int, wave: int,
                 ranks: int = 1) -> dict[str, Any]:
        run = GridRun(arm, seed, run_folder(lock, runs_dir, arm, seed), ranks)
        where = {"node": socket.gethostname(), "job_id": os.environ.get("SLURM_JOB_ID"),
                 "restarts": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)}
        env = child_environment(threads, wave, "slurm")
        refusals = 0
        while True:
            # another process (an older array's task, another grid, a plain `opalctl run`) may hold the folder:
            # its run is not this task's to start; what it leaves decides what this task does
            while run.layout.held():
                time.sleep(POLL_SECONDS)
            need = run.need()
            if need == DONE:  # finished without this task; after a requeue, by this task's earlier start
                ran_before = where["restarts"] > 0
                return {"exit_code": None, "resumed": ran_before, "skipped": not ran_before, **where}
            resumed, state = need == RESUME, run.layout.state
            code = self._run(run, Path(lock), Path(runs_dir), resumed, env)
            if run.refused(code) and refusals < REFUSALS_RETRIED and (run.layout.held() or run.layout.state != state):
                refusals += 1  # refused because another process took or changed the folder first: decide again
                continue
            return {"exit_code": code, "resumed": resumed, "skipped": False, **where}

    def _run(self, run: GridRun, lock: Path, runs_dir: Path, resumed: bool, env: dict[str, str]) -> int:
        """``opalctl run`` of ``run`` until it and its helpers have ended; its exit code."""
        self.child = spawn_run(run, lock, runs_dir, resumed, env, ignore=(signal.SIGUSR2,))
        # polled, not waited for: submitit's signal handler runs in this thread and must be able to reap the
        # child itself (a blocking wait holds the lock that reaping takes, and the handler would wait forever)
        while (code := self.child.poll()) is None:
            time.sleep(POLL_SECONDS)
        while run.layout.held() and self.child.pid in (run.layout.lock_holders() or {self.child.pid}):
            time.sleep(POLL_SECONDS)  # its evaluator and steps helper end after it
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + GRACE_SECONDS
            while child.poll() is None:
                if time.monotonic() > deadline:
                    child.kill()  # the resume checkpoint on disk is still whole
                time.sleep(POLL_SECONDS)
        return submitit.helpers.DelayedSubmission(SlurmRunTask(), *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a child process is never pickled: a requeued task starts its own

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.child = None
