"""``opalctl grid LOCK --forecast``: the wall time of the grid's pending runs, before any starts.

One pilot per arm (driver/pilot.py: public inputs only, nothing written) forecasts that arm's run alone; the runs
that are left to do are then scheduled as the local pool schedules them, ``jobs`` at a time on this machine's
cores (driver/forecast.py's ``grid_forecast`` says how runs sharing the cores are modelled).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from opalctl.driver.forecast import grid_forecast
from opalctl.driver.pilot import pilot
from opalctl.grid.plan import DONE, default_jobs, plan_grid

PILOT_SECONDS = 2.0  # timed updates per arm: enough past the warm-up, short beside the grid


def machine_cores() -> int:
    """The cores this process may use, as the grid's default ``--jobs`` counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forecast_grid(lock_path, *, arms: list[str] | None = None, seeds: list[int] | None = None,
                  jobs: int | None = None, runs_dir=None, seconds: float = PILOT_SECONDS,
                  say: Callable[[str], None] = lambda text: None) -> dict[str, Any]:
    """Pilot each arm with runs left to do, then forecast the grid at ``jobs`` (default: the grid's)."""
    plan = plan_grid(lock_path, arms=arms, seeds=seeds, runs_dir=runs_dir)
    cores = machine_cores()
    jobs = jobs or default_jobs(plan.cpus_per_run, cores)
    pending = [run for run in plan.runs if run.need() != DONE]
    pilots: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(run.arm for run in pending):
        say(f"pilot {arm}")
        pilots[arm] = pilot(plan.lock_path, arm, seconds=seconds)
    runs = [(run.arm, run.seed, pilots[run.arm]["forecast"]["total_seconds"]) for run in pending]
    result = grid_forecast(runs, jobs, plan.cpus_per_run, cores)
    result["lock"] = str(plan.lock_path)
    result["finished_runs"] = len(plan.runs) - len(pending)
    result["arms"] = {arm: figures["forecast"] for arm, figures in pilots.items()}
    return result
