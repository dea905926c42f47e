"""The local executor: a bounded pool of ``opalctl run`` child processes on this machine.

Each run is ``python -m opalctl run LOCK --arm A --seed S [--resume]`` in a process of its own, in a session of
its own (a Ctrl-C at the terminal reaches the grid, which stops the children itself: grid/signals.py), with its
threads fixed from the lock's ``budget.threads`` (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; the run sets torch's
own count) and its output appended to ``grid.log`` in its run folder. At most ``jobs`` run at once, started in the
plan's order (grid/plan.py). Not submitit's local executor: it has no cap on how many run at once, and a time
limit of minutes by default.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opalctl.grid.plan import GridPlan, GridRun
from opalctl.grid.progress import RunProgress
from opalctl.grid.records import INTERRUPTED, RUNNING, RunOutcome, event, final_state, outcome_event
from opalctl.grid.signals import StopRequest

POLL_SECONDS = 0.1  # how often the pool looks at its children
PROGRESS_SECONDS = 1.0  # how often it reads a running run's progress from its folder
GRACE_SECONDS = 60.0  # how long a child stopped with SIGTERM may take before it is killed (still resumable)


def child_environment(threads: int, wave_size: int, executor: str, base: dict[str, str] | None = None) -> dict:
    """The environment of one run: its threads fixed, and what the run's machine watch reads of the grid
    (driver/sharing.py)."""
    env = dict(os.environ if base is None else base)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "OPALCTL_GRID_WAVE_SIZE": str(wave_size), "OPALCTL_GRID_EXECUTOR": executor})
    return env


@dataclass
class Child:
    """One run's process while it lives."""

    run: GridRun
    process: subprocess.Popen
    resumed: bool
    progress: RunProgress
    last_read: float = 0.0
    shown: tuple | None = None


class LocalPool:
    """Runs the plan's pending runs, at most ``jobs`` at a time; ``notify`` receives every event."""

    def __init__(self, plan: GridPlan, jobs: int, notify: Callable[[dict[str, Any]], None], stop: StopRequest,
                 grace_seconds: float = GRACE_SECONDS):
        self.plan, self.jobs, self.notify, self.stop = plan, jobs, notify, stop
        self.grace_seconds = grace_seconds
        self.active: list[Child] = []
        self.outcomes: dict[GridRun, RunOutcome] = {}

    def run(self, pending: list[GridRun], resume: set[GridRun]) -> dict[GridRun, RunOutcome]:
        queue = deque(pending)
        env = child_environment(self.plan.threads, min(self.jobs, len(pending)), "local")
        try:
            while (queue or self.active) and not self.stop.requested:
                while queue and len(self.active) < self.jobs:
                    run = queue.popleft()
                    self._start(run, run in resume, env)
                self._reap()
                self._report_progress()
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            self.stop.request(signal.SIGINT)
        if self.active:
            self._stop_children()
        for run in queue:
            self._finish(run, RunOutcome(run.arm, run.seed, INTERRUPTED, str(run.run_dir), None, None))
        return self.outcomes

    def _start(self, run: GridRun, resumed: bool, env: dict[str, str]) -> None:
        args = run.command(self.plan.lock_path, self.plan.runs_dir, resumed)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        with open(run.log, "ab") as log:
            log.write(f"--- opalctl grid {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: opalctl "
                      f"{' '.join(args)}\n".encode())
            log.flush()
            process = subprocess.Popen([sys.executable, "-m", "opalctl", *args], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.active.append(Child(run, process, resumed, RunProgress(run.run_dir)))
        self.notify(event(run.arm, run.seed, RUNNING, resumed=resumed, run_dir=str(run.run_dir),
                          log=str(run.log)))

    def _reap(self) -> None:
        for child in list(self.active):
            code = child.process.poll()
            if code is None:
                continue
            self.active.remove(child)
            run = child.run
            self._finish(run, RunOutcome(run.arm, run.seed, final_state(code, child.resumed), str(run.run_dir),
                                         code, str(run.log)))

    def _finish(self, run: GridRun, outcome: RunOutcome) -> None:
        self.outcomes[run] = outcome
        self.notify(outcome_event(outcome))

    def _report_progress(self) -> None:
        now = time.monotonic()
        for child in self.active:
            if now - child.last_read < PROGRESS_SECONDS:
                continue
            child.last_read = now
            figures = child.progress.read()
            shown = (figures["fraction"], figures["updates"])
            if figures["fraction"] is not None and shown != child.shown:
                child.shown = shown
                self.notify(event(child.run.arm, child.run.seed, RUNNING, resumed=child.resumed, **figures))

    def _stop_children(self) -> None:
        """SIGTERM to every child (each leaves its run resumable), then wait; SIGKILL only after the grace."""
        for child in self.active:
            _signal(child.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while self.active:
            for child in list(self.active):
                if child.process.poll() is not None or time.monotonic() >= deadline:
                    if child.process.poll() is None:
                        _signal(child.process, signal.SIGKILL)  # a resume checkpoint on disk is still whole
                        child.process.wait()
                    self.active.remove(child)
                    code = child.process.returncode
                    state = final_state(code, child.resumed) if code == 0 else INTERRUPTED
                    run = child.run
                    self._finish(run, RunOutcome(run.arm, run.seed, state, str(run.run_dir), code, str(run.log)))
            time.sleep(POLL_SECONDS)


def _signal(process: subprocess.Popen, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass
