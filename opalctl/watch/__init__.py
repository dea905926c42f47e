"""``opalctl watch RUN_DIR | LOCK``: a live view of one run, or of every run of a lock, as it trains.

It reads the run folders and nothing else (watch/reader.py), so it watches a run started anywhere whose folder it
can read: a grid in another terminal, a Slurm job on a shared file system, a plain ``opalctl run``. It never
writes into a run folder and never takes a run's lock, so starting, stopping or Ctrl-C-ing it changes nothing for
the runs (Ctrl-C ends the view with exit 0: the view was asked to end, nothing was interrupted).

On a terminal the view redraws in place every ``--interval`` seconds (watch/render.py); piped, or with ``--json``,
it prints one JSON line per change (a run's new state, each tenth of a run's budget passed, a stage judged, a
decision made). Either way it ends by itself once every watched run is finished or failed; ``--once`` prints the
view as it stands (``--json``: one JSON document) and ends at once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.grid.plan import plan_grid
from opalctl.layout import RunLayout
from opalctl.watch.reader import FINAL, RunWatch
from opalctl.watch.render import display_for

INTERVAL_SECONDS = 1.5
WHAT_TO_GIVE = "give a run folder (runs/NAME-SHA12/ARM/seed-S) or a lock (NAME.lock.json, its runs under --runs-dir)"


@dataclass
class Watched:
    """What is watched: its name for the view, whether it is a lock's runs, and one ``RunWatch`` per run."""

    title: str
    lock: bool
    runs: list[RunWatch]

    def look(self) -> list[dict[str, Any]]:
        return [change for run in self.runs for change in run.look()]

    @property
    def ended(self) -> bool:
        return all(run.state in FINAL for run in self.runs)

    def view(self) -> dict[str, Any]:
        return {"target": self.title, "kind": "lock" if self.lock else "run", "runs": [run.view() for run in self.runs],
                "ended": self.ended}


def watched(target: str | os.PathLike, runs_dir: str | os.PathLike | None = None) -> Watched:
    """The runs ``target`` names: one run folder, or every (arm, seed) of a lock; else ``BadInput`` in one
    sentence."""
    path = Path(target)
    if not path.exists():
        raise BadInput(f"{path} does not exist; {WHAT_TO_GIVE}")
    if path.is_dir():
        layout = RunLayout.of(path)
        # a folder a run has started in, or one a grid made for it and whose run holds its lock or has a log
        if not (layout.is_run_folder() or (path.name.startswith("seed-") and
                                           (layout.folder_lock.exists() or layout.grid_log.exists()))):
            raise BadInput(f"{path} is a folder but not a run folder (it has no start.json); {WHAT_TO_GIVE}")
        number = path.name.removeprefix("seed-")
        seed = int(number) if number.isdigit() else None
        return Watched(str(path), False, [RunWatch(path.resolve().parent.name, seed, path)])

    try:
        plan = plan_grid(path, runs_dir=runs_dir)
    except BadInput:
        if path.name.endswith(".lock.json"):
            raise  # a lock, refused for a reason read_lock names
        raise BadInput(f"{path} is neither a run folder nor a lock; {WHAT_TO_GIVE}") from None
    base = plan.runs[0].run_dir.parent.parent if plan.runs else plan.runs_dir
    return Watched(str(base), True, [RunWatch(run.arm, run.seed, run.run_dir) for run in plan.runs])


def watch(target: str | os.PathLike, *, runs_dir: str | os.PathLike | None = None, interval: float = INTERVAL_SECONDS,
          once: bool = False, json_mode: bool = False, sleep=time.sleep) -> dict[str, Any] | None:
    """Watch ``target`` until every run has ended (or once, or until Ctrl-C); the view's last state when
    ``once`` and ``json_mode`` (the CLI prints it), else None (the view printed itself)."""
    subject = watched(target, runs_dir)
    changes = subject.look()
    if once and json_mode:
        return {**subject.view(), "changes": changes}
    display = display_for(subject, json_mode=json_mode, once=once)
    try:
        display.show(changes)
        while not once and not subject.ended:
            sleep(interval)
            display.show(subject.look())
    except KeyboardInterrupt:
        display.close(stopped=True)
        return None
    display.close(stopped=False)
    return None
