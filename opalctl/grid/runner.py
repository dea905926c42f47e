"""``run_grid``: every selected run of a lock, each in its own process, on the local pool or on Slurm.

Finished runs are skipped (never run twice), interrupted ones resumed, new ones started; one failure does not
stop the others. The result lists every run's outcome; ``ok`` says whether each one finished. The display
receives one event per change (grid/records.py): the CLI's is ``live_display`` (grid/display.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from opalctl.errors import BadInput
from opalctl.grid.local import LocalPool
from opalctl.grid.plan import DONE, NEW, RESUME, GridPlan, GridRun, default_jobs, plan_grid
from opalctl.grid.records import QUEUED, SKIPPED, GridResult, RunOutcome, event, outcome_event
from opalctl.grid.settings import SlurmSettings
from opalctl.grid.signals import StopRequest
from opalctl.grid.slurm import SlurmArray

EXECUTORS = ("local", "slurm")


def run_grid(lock_path: str | os.PathLike, *, arms: list[str] | None = None, seeds: list[int] | None = None,
             jobs: int | None = None, executor: str = "local", runs_dir: str | os.PathLike | None = None,
             display: Callable[[dict[str, Any]], None] | None = None, settings=None,
             stop: StopRequest | None = None) -> GridResult:
    """Run the grid; ``settings`` are the Slurm executor's (grid/settings.py), ``stop`` a caller's own
    ``StopRequest`` (the grid makes one and installs its signal handlers otherwise)."""
    if executor not in EXECUTORS:
        raise BadInput(f"--executor {executor!r} is not one of {', '.join(EXECUTORS)}; choose one")
    if executor == "local" and settings is not None and settings != type(settings)():
        raise BadInput("Slurm settings (--slurm-config, --partition, --account, --time-limit, --sbatch) were given "
                       "with --executor local; add --executor slurm or leave them out")
    if jobs is not None and jobs < 1:
        raise BadInput(f"--jobs {jobs} must be at least 1")
    plan = plan_grid(lock_path, arms=arms, seeds=seeds, runs_dir=runs_dir)
    jobs = jobs or default_jobs(plan.cpus_per_run)
    notify = display or (lambda change: None)
    started = time.monotonic()
    result = GridResult(lock=str(plan.lock_path), runs_dir=str(plan.runs_dir), executor=executor, jobs=jobs,
                        arms=list(arms) if arms else None, seeds=list(seeds) if seeds else None)
    needs = {run: run.need() for run in plan.runs}
    pending = [run for run in plan.runs if needs[run] != DONE]
    resume = {run for run in pending if needs[run] == RESUME}
    outcomes: dict[GridRun, RunOutcome] = {}
    for run in plan.runs:
        if needs[run] == DONE:
            outcomes[run] = RunOutcome(run.arm, run.seed, SKIPPED, str(run.run_dir), None, str(run.log))
            notify(outcome_event(outcomes[run]))
        else:
            notify(event(run.arm, run.seed, QUEUED, resumed=needs[run] != NEW, run_dir=str(run.run_dir)))
    own_stop = stop is None
    stop = stop or StopRequest()
    try:
        if own_stop:
            stop.__enter__()
        if pending:
            outcomes.update(_execute(executor, plan, jobs, pending, resume, notify, stop, settings))
    finally:
        if own_stop:
            stop.__exit__(None, None, None)
        close = getattr(display, "close", None)
        if close is not None:
            close()
    result.outcomes = [outcomes[run] for run in plan.runs]
    result.stopped_by = stop.name
    result.wall_seconds = time.monotonic() - started
    return result


def _execute(executor: str, plan: GridPlan, jobs: int, pending: list[GridRun], resume: set[GridRun], notify,
             stop: StopRequest, settings) -> dict[GridRun, RunOutcome]:
    if executor == "local":
        return LocalPool(plan, jobs, notify, stop).run(pending, resume)

    return SlurmArray(plan, jobs, notify, stop, settings or SlurmSettings()).run(pending, resume)
