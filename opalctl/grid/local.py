"""The local executor: a bounded pool of ``opalctl run`` child processes on this machine.

Each run is ``python -m opalctl run LOCK --arm A --seed S [--resume]`` in a process of its own, in a session of
its own (a Ctrl-C at the terminal reaches the grid, which stops the children itself: grid/signals.py), with its
threads fixed from the lock's ``budget.threads`` (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; the run sets torch's
own count) and its output appended to ``grid.log`` in its run folder. At most ``jobs`` run at once, started in the
plan's order (grid/plan.py). Not submitit's local executor: it has no cap on how many run at once, and a time
limit of minutes by default.

Other processes may work on the same runs (a second grid on the lock, a plain ``opalctl run``): a run whose
folder's lock another process holds is ``waiting`` (it takes no slot) until the lock is free, and what it needs is
then read again from its folder (finished elsewhere: skipped). A child that ends is over when its folder's lock is
no longer its own (its evaluator and steps helper end after it), and its outcome is read from the folder: a child
refused because another process took the folder first waits for that process in the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opalctl.grid.plan import DONE, RESUME, GridPlan, GridRun
from opalctl.grid.progress import RunProgress
from opalctl.grid.records import FAILED, INTERRUPTED, RUNNING, SKIPPED, WAITING, RunOutcome, event, outcome_event
from opalctl.grid.signals import StopRequest
from opalctl.layout import FINISHED

POLL_SECONDS = 0.1  # how often the pool looks at its children
PROGRESS_SECONDS = 1.0  # how often it reads a running run's progress from its folder
GRACE_SECONDS = 60.0  # how long a child stopped with SIGTERM may take before it is killed (still resumable)
HELPERS_SECONDS = 60.0  # how long the grid waits for an ended child's evaluator and steps helper to let go

LOG_HEADER = "--- opalctl grid"  # the line the grid writes into a run's log before each start of it


def child_environment(threads: int, wave_size: int, executor: str, base: dict[str, str] | None = None) -> dict:
    """The environment of one run: its threads fixed, and what the run's machine watch reads of the grid
    (driver/sharing.py)."""
    env = dict(os.environ if base is None else base)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "OPALCTL_GRID_WAVE_SIZE": str(wave_size), "OPALCTL_GRID_EXECUTOR": executor})
    return env


def spawn_run(run: GridRun, lock_path, runs_dir, resumed: bool, env: dict[str, str],
              ignore: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start ``opalctl run`` for ``run`` in a session of its own, its output appended to its ``grid.log`` after
    a line that says when and how it was started; ``ignore``: signals the child starts with ignored."""
    args = run.argv(lock_path, runs_dir, resumed)
    run.run_dir.mkdir(parents=True, exist_ok=True)

    def ignore_signals() -> None:
        for signum in ignore:
            signal.signal(signum, signal.SIG_IGN)

    with open(run.log, "ab") as log:
        shown = " ".join(args[2:]).replace("torch.distributed.run", "torchrun", 1)  # after `python -m`
        log.write(f"{LOG_HEADER} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {shown}\n".encode())
        log.flush()
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=ignore_signals if ignore else None)


@dataclass
class Child:
    """One run's process while it lives."""

    run: GridRun
    process: subprocess.Popen
    resumed: bool
    progress: RunProgress
    state_at_start: str = ""  # its folder's state when it was started (RunLayout.state)
    exited_at: float | None = None  # when its process ended (its helpers may hold the folder a little longer)
    last_read: float = 0.0
    shown: tuple | None = None


REFUSALS_RETRIED = 3  # how often a run refused because its folder changed under it is decided again


class LocalPool:
    """Runs the plan's pending runs, at most ``jobs`` at a time; ``notify`` receives every event."""

    def __init__(self, plan: GridPlan, jobs: int, notify: Callable[[dict[str, Any]], None], stop: StopRequest,
                 grace_seconds: float = GRACE_SECONDS):
        self.plan, self.jobs, self.notify, self.stop = plan, jobs, notify, stop
        self.grace_seconds = grace_seconds
        self.active: list[Child] = []
        self.waiting: list[GridRun] = []  # runs whose folder another process holds
        self.retried: dict[GridRun, int] = {}
        self.outcomes: dict[GridRun, RunOutcome] = {}

    def run(self, pending: list[GridRun], resume: set[GridRun] | None = None) -> dict[GridRun, RunOutcome]:
        """``resume`` is not needed: what each run needs is read from its folder when it starts."""
        queue = deque(pending)
        env = child_environment(self.plan.threads, min(self.jobs, len(pending)), "local")
        try:
            while (queue or self.active or self.waiting) and not self.stop.requested:
                self._wake(queue)
                while queue and len(self.active) < self.jobs:
                    self._start(queue.popleft(), env)
                self._reap(queue)
                self._report_progress()
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            self.stop.request(signal.SIGINT)
        if self.active:
            self._stop_children()
        for run in [*self.waiting, *queue]:
            self._finish(run, RunOutcome(run.arm, run.seed, INTERRUPTED, str(run.run_dir), None, None))
        return self.outcomes

    def _wait(self, run: GridRun) -> None:
        self.waiting.append(run)
        self.notify(event(run.arm, run.seed, WAITING, run_dir=str(run.run_dir),
                          holders=sorted(run.layout.lock_holders() or [])))

    def _wake(self, queue: deque) -> None:
        """The waiting runs whose folder is free again go first in the queue."""
        for run in [run for run in self.waiting if not run.layout.held()]:
            self.waiting.remove(run)
            queue.appendleft(run)

    def _start(self, run: GridRun, env: dict[str, str]) -> None:
        """Start ``run`` as its folder says now: wait while another process holds it, skip it when finished."""
        layout = run.layout
        if layout.held():
            return self._wait(run)
        need = run.need()
        if need == DONE:
            return self._finish(run, RunOutcome(run.arm, run.seed, SKIPPED, str(run.run_dir), None, str(run.log)))
        resumed = need == RESUME
        try:
            process = spawn_run(run, self.plan.lock_path, self.plan.runs_dir, resumed, env)
        except OSError as error:  # its folder or log cannot be made: this run fails, the others go on
            return self._finish(run, RunOutcome(run.arm, run.seed, FAILED, str(run.run_dir), None,
                                                f"{run.log} could not be written ({error.strerror or error})"))
        self.active.append(Child(run, process, resumed, RunProgress(run.run_dir), layout.state))
        self.notify(event(run.arm, run.seed, RUNNING, resumed=resumed, run_dir=str(run.run_dir),
                          log=str(run.log)))

    def _reap(self, queue: deque) -> None:
        for child in list(self.active):
            code = child.process.poll()
            if code is None:
                continue
            child.exited_at = child.exited_at or time.monotonic()
            if own_helpers_hold(child) and time.monotonic() - child.exited_at < HELPERS_SECONDS:
                continue
            self.active.remove(child)
            run = child.run
            if run.refused(code) and run.layout.state != FINISHED:
                if run.layout.held():  # another process took the folder first: wait for it
                    self._wait(run)
                    continue
                if run.layout.state != child.state_at_start and self.retried.get(run, 0) < REFUSALS_RETRIED:
                    self.retried[run] = self.retried.get(run, 0) + 1  # another process changed it meanwhile
                    queue.appendleft(run)
                    continue
            self._finish(run, RunOutcome(run.arm, run.seed, run.outcome(code, child.resumed), str(run.run_dir),
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
                    if own_helpers_hold(child) and time.monotonic() < deadline:
                        continue
                    self.active.remove(child)
                    code = child.process.returncode
                    run = child.run
                    state = run.outcome(code, child.resumed)
                    state = INTERRUPTED if state == FAILED and code != 0 else state  # stopped, not broken
                    self._finish(run, RunOutcome(run.arm, run.seed, state, str(run.run_dir), code, str(run.log)))
            time.sleep(POLL_SECONDS)


def own_helpers_hold(child: Child) -> bool:
    """Whether the folder's lock is still held under the child's id: its evaluator and steps helper, which end
    after it, may still write (``RunLayout.lock_holders``; where the system does not say, any holder counts)."""
    layout = child.run.layout
    if not layout.held():
        return False
    holders = layout.lock_holders()
    return holders is None or not holders or child.process.pid in holders


def _signal(process: subprocess.Popen, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass
