"""``opalctl grid LOCK --status``: where every run of the grid stands, read back from the run folders (and, for
runs the Slurm executor submitted, from Slurm itself).

A run is ``finished`` (its report), ``running`` (a process holds its folder's lock: the run, or its evaluator
and steps helper while they end), ``interrupted`` (a resume
checkpoint, nobody running it: the grid resumes it), ``failed`` (its last start ended without leaving anything to
resume; its log says why), ``starting`` (a grid spawned it, its log holds only the grid's header, and it has not
taken its folder yet: for a second or two, not a failure) or ``not started``. A finished run of an agent arm says what its agent did (``agent``:
acted, only kept, never answered; compare/decisions.py). Nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opalctl import console
from opalctl.compare.decisions import DecisionTally
from opalctl.errors import OpalctlError
from opalctl.files import read_plain
from opalctl.grid.local import LOG_HEADER
from opalctl.grid.plan import GridRun, plan_grid
from opalctl.grid.progress import RunProgress
from opalctl.grid.slurm import recorded_jobs
from opalctl.layout import FINISHED, NEW, RUNNING, RunLayout


def grid_status(lock_path: str | os.PathLike, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                runs_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    plan = plan_grid(lock_path, arms=arms, seeds=seeds, runs_dir=runs_dir)
    jobs = recorded_jobs(plan)
    runs = [{**run_status(run), **({"slurm": jobs[run.arm, run.seed]} if (run.arm, run.seed) in jobs else {})}
            for run in plan.runs]
    counts: dict[str, int] = {}
    for entry in runs:
        counts[entry["state"]] = counts.get(entry["state"], 0) + 1
    return {"lock": str(plan.lock_path), "runs_dir": str(plan.runs_dir), "runs": runs, "counts": counts,
            "ok": all(entry["state"] == "finished" for entry in runs)}


def run_status(run: GridRun) -> dict[str, Any]:
    """Where ``run`` stands, from its folder's state as another process sees it now (``RunLayout.live_state``)."""
    state = run.layout.live_state
    entry: dict[str, Any] = {"arm": run.arm, "seed": run.seed, "run_dir": str(run.run_dir),
                             "log": str(run.log) if run.log.exists() else None}
    if state == FINISHED:
        return {**entry, "state": "finished", "fraction": 1.0, "agent": _agent_word(run)}
    shown = state_word(run.layout, state)
    figures = RunProgress(run.run_dir).read() if state != NEW else {}
    return {**entry, "state": shown, "fraction": figures.get("fraction"), "updates": figures.get("updates")}


LOG_LIMIT = 1 << 16  # a run's log read to tell a run the grid is starting from one that failed


def state_word(layout: RunLayout, live_state: str) -> str:
    """``live_state`` of the run in ``layout`` as the grid says it: finished, running, interrupted, failed (a grid
    started it and nothing came of it: its log and no start record), starting (its log holds only the grid's header:
    spawned, not yet holding its folder) or not started (module docstring)."""
    if live_state == FINISHED:
        return "finished"
    if live_state == RUNNING:
        return "running"
    if live_state == NEW:
        if not layout.grid_log.exists():
            return "not started"
        return "starting" if _only_the_grids_header(layout.grid_log) else "failed"
    return "interrupted"


def _only_the_grids_header(log: Path) -> bool:
    """Whether the run's log holds nothing but the lines the grid writes before each start (no word of the run's
    own yet: a run that fails before its start record says why there)."""
    try:
        text = read_plain(log, LOG_LIMIT).decode(errors="replace")
    except OSError:  # gone, or grown past the limit: more than headers
        return False
    return all(line.startswith(LOG_HEADER) for line in text.splitlines() if line.strip())


def _agent_word(run: GridRun) -> str | None:
    """What the agent of a finished run did (compare/decisions.py): None for a fixed arm's run."""
    try:
        tally = DecisionTally.read(run.run_dir)
    except OpalctlError:  # a damaged record: `opalctl verify` names it
        return "records unreadable"
    return None if tally is None else tally.word


def render_status(result: dict[str, Any]) -> None:
    rows = []
    for entry in result["runs"]:
        fraction = entry.get("fraction")
        slurm = entry.get("slurm") or {}
        job = f"{slurm.get('job_id', '')} {slurm.get('state', '')}".strip()
        agent = entry.get("agent")
        rows.append([entry["arm"], entry["seed"], entry["state"] + (f" (agent {agent})" if agent else ""),
                     "-" if fraction is None else f"{100 * fraction:.1f} %", entry.get("updates"), job or "-"])
    console.table(f"opalctl grid {result['lock']} --status", ["arm", "seed", "state", "progress", "updates",
                                                              "slurm job"], rows)
    console.message(", ".join(f"{count} {state}" for state, count in sorted(result["counts"].items())))
