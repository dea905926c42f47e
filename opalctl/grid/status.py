"""``opalctl grid LOCK --status``: where every run of the grid stands, read back from the run folders (and, for
runs the Slurm executor submitted, from Slurm itself).

A run is ``finished`` (its report), ``running`` (a process holds its folder's lock), ``interrupted`` (a resume
checkpoint, nobody running it: the grid resumes it), ``failed`` (its last start ended without leaving anything to
resume; its log says why) or ``not started``. Nothing is written.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from opalctl import console
from opalctl.grid.plan import DONE, NEW, GridRun, plan_grid
from opalctl.grid.progress import RunProgress

LOCK_MARKER = ".running"  # the file a run holds locked while it trains (driver/run.py)


def grid_status(lock_path: str | os.PathLike, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                runs_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    plan = plan_grid(lock_path, arms=arms, seeds=seeds, runs_dir=runs_dir)
    runs = [run_status(run) for run in plan.runs]
    counts: dict[str, int] = {}
    for entry in runs:
        counts[entry["state"]] = counts.get(entry["state"], 0) + 1
    return {"lock": str(plan.lock_path), "runs_dir": str(plan.runs_dir), "runs": runs, "counts": counts,
            "ok": all(entry["state"] == "finished" for entry in runs)}


def run_status(run: GridRun) -> dict[str, Any]:
    need = run.need()
    entry: dict[str, Any] = {"arm": run.arm, "seed": run.seed, "run_dir": str(run.run_dir),
                             "log": str(run.log) if run.log.exists() else None}
    if need == DONE:
        return {**entry, "state": "finished", "fraction": 1.0}
    if held(run.run_dir / LOCK_MARKER):
        state = "running"
    elif need == NEW:
        state = "failed" if run.log.exists() else "not started"
    else:
        state = "interrupted"
    figures = RunProgress(run.run_dir).read() if need != NEW or state == "running" else {}
    return {**entry, "state": state, "fraction": figures.get("fraction"), "updates": figures.get("updates")}


def held(marker: Path) -> bool:
    """Whether a process holds ``marker`` locked now (tried without waiting, released at once)."""
    try:
        handle = open(marker, "rb")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


def render_status(result: dict[str, Any]) -> None:
    rows = []
    for entry in result["runs"]:
        fraction = entry.get("fraction")
        slurm = entry.get("slurm") or {}
        job = f"{slurm.get('job_id', '')} {slurm.get('state', '')}".strip()
        rows.append([entry["arm"], entry["seed"], entry["state"],
                     "-" if fraction is None else f"{100 * fraction:.1f} %", entry.get("updates"), job or "-"])
    console.table(f"opalctl grid {result['lock']} --status", ["arm", "seed", "state", "progress", "updates",
                                                              "slurm job"], rows)
    console.message(", ".join(f"{count} {state}" for state, count in sorted(result["counts"].items())))
