"""``opalctl suite run`` and ``status``: every task's grid (``opalctl.grid.run_grid``, local or Slurm), one task
after the other, each run in its own process. Resumable as a grid is: finished runs are skipped, interrupted ones
resumed; a stop signal stops the task in progress (its runs checkpoint) and the tasks after it are not started.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.grid import run_grid
from opalctl.grid.signals import StopRequest
from opalctl.grid.status import grid_status
from opalctl.opal.agents import registry
from opalctl.protocol.lock import read_lock
from opalctl.suite.lock import SUFFIX, SuiteLock, check_suite_file, read_suite_lock, suite_lock_path


def open_suite(target: str | Path, folder: str | Path | None = None) -> SuiteLock:
    """The suite lock of ``target``: a suite lock itself, or the suite file it was frozen from (then the lock in
    the suite's folder, ``--dir`` or its default, and the file unchanged since)."""
    from opalctl.suite.freeze import suite_folder
    from opalctl.suite.spec import load_suite

    target = Path(target)
    if target.name.endswith(SUFFIX):
        if folder is not None:
            raise BadInput(f"--dir names where a suite file's tasks go; {target} is a suite lock already, so leave "
                           f"--dir out")
        return read_suite_lock(target)
    suite, _ = load_suite(target)
    lock = read_suite_lock(suite_lock_path(suite_folder(target, suite.name, folder), suite.name))
    check_suite_file(lock, target)
    return lock


class TaskDisplay:
    """A grid's display within a suite: each change it shows names its task (the JSON lines say which grid)."""

    def __init__(self, task: str, inner: Callable[[dict[str, Any]], None]):
        self.task, self.inner = task, inner

    def __call__(self, change: dict[str, Any]) -> None:
        self.inner({**change, "task": self.task})

    def close(self) -> None:
        getattr(self.inner, "close", lambda: None)()


def run_suite(lock: SuiteLock, *, jobs: int | None = None, executor: str = "local", runs_dir=None, settings=None,
              display_for: Callable[[str], Any] | None = None,
              say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every task's grid in the suite's order; ``display_for(task)`` gives each grid its display."""
    refuse_unready(lock)
    results: dict[str, Any] = {}
    with StopRequest() as stop:
        for number, task in enumerate(lock.tasks, start=1):
            if stop.requested:
                break
            say(f"[{number}/{len(lock.tasks)}] task {task}: grid of {lock.lock_of(task)}")
            grid = run_grid(lock.lock_of(task), jobs=jobs, executor=executor, runs_dir=runs_dir,
                            display=display_for(task) if display_for else None, settings=settings, stop=stop)
            results[task] = grid
    return {"suite_lock": str(lock.path), "suite_sha256": lock.sha256, "stopped_by": stop.name,
            "tasks": {task: grid.to_json() for task, grid in results.items()},
            "not_started": [task for task in lock.tasks if task not in results],
            "ok": len(results) == len(lock.tasks) and all(grid.ok for grid in results.values())}


def refuse_unready(lock: SuiteLock) -> None:
    """An agent arm whose backend cannot answer here (its key unset, its binary missing) refused before any task
    starts: every task runs every arm, so its runs would fail on each task in turn."""
    for task in lock.tasks:
        if missing := registry.unready_arms(read_lock(lock.lock_of(task)).protocol()):
            raise BadInput(f"suite {lock.name}: {missing[0]}; provide it, or comment the arm out of the suite file "
                           f"and freeze it again")


def suite_status(lock: SuiteLock, *, runs_dir=None) -> dict[str, Any]:
    """Where every run of every task stands (``grid --status`` for each task's lock)."""
    tasks = {task: grid_status(lock.lock_of(task), runs_dir=runs_dir) for task in lock.tasks}
    return {"suite_lock": str(lock.path), "suite_sha256": lock.sha256, "tasks": tasks,
            "ok": all(status["ok"] for status in tasks.values())}
