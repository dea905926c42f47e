"""How long a run and a grid of runs will take on the wall clock, from what the pilot measured.

The budget clock charges training only; the wall clock of a run also holds what is never charged: the run's and
the evaluator's processes starting (an interpreter, torch, the lock's records hashed, the splits read, the anchor
evaluated), the loop's own work between updates, each stage's checkpoint and evaluation, the resume checkpoints,
an agent arm's waiting for its agent, and the close. ``RunForecast`` adds those parts up for one run; ``grid_wall``
schedules a grid's runs the way the local pool does (grid/local.py: in the plan's order, each as soon as one of
``jobs`` slots is free) and slows the runs that share the machine by a simple rule: while ``k`` runs of ``c`` cores
each train on a machine of ``cores`` cores, each goes at ``1 / max(1, k * c / cores)`` of its own speed (the cores
are shared evenly; nothing else is modelled). Everything here is arithmetic on figures; the pilot measures them
(driver/pilot.py), and bench/forecast.py measures the forecast against real runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Which parts of one run the forecast adds up, in the order a run spends them (the keys of ``components``).
PARTS = ("start", "training", "between_updates", "stages", "checkpoints", "agent_waiting", "close")


@dataclass(frozen=True)
class RunForecast:
    """One run's wall seconds, part by part, and the sentences that say what was assumed.

    ``start``: the processes starting until the first update; ``training``: the charged updates' wall time;
    ``between_updates``: the loop's own work between them; ``stages``: each stage's checkpoint and evaluation;
    ``checkpoints``: the resume checkpoints; ``agent_waiting``: training waiting for an agent's answers (typical
    figure); ``close``: the report and the processes ending.
    """

    updates: float
    start: float
    training: float
    between_updates: float
    stages: float
    checkpoints: float
    agent_waiting: float
    close: float
    assumptions: tuple[str, ...] = field(default=())

    @property
    def components(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in PARTS}

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["assumptions"] = list(self.assumptions)
        data["components"] = self.components
        data["total_seconds"] = self.total
        return data


def slowdown(running: int, cpus_per_run: int, cores: int) -> float:
    """How much slower each of ``running`` runs of ``cpus_per_run`` cores goes on ``cores`` cores than alone: the
    cores shared evenly once the runs ask for more than there are."""
    return max(1.0, running * max(1, cpus_per_run) / max(1, cores))


def grid_wall(durations: list[float], jobs: int, cpus_per_run: int, cores: int) -> dict[str, Any]:
    """The wall seconds of a grid whose runs would take ``durations`` seconds each alone, started in that order
    with at most ``jobs`` at once, each slowed by ``slowdown`` while others run beside it.

    Returns ``seconds`` (the grid's end), ``finish`` (each run's end, in the given order), ``at_once`` (the most
    runs at once) and ``slowdown`` (the slowdown while that many run)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    queue = list(enumerate(durations))
    queue.reverse()
    remaining: dict[int, float] = {}  # run index -> its seconds of work left, at its own speed alone
    finish = [0.0] * len(durations)
    now = 0.0
    while queue or remaining:
        while queue and len(remaining) < jobs:
            index, seconds = queue.pop()
            remaining[index] = max(0.0, float(seconds))
        rate = 1.0 / slowdown(len(remaining), cpus_per_run, cores)
        # the next run to end ends after its work left at the shared rate; the others progress as much meanwhile
        index = min(remaining, key=lambda i: (remaining[i], i))
        step = remaining[index] / rate
        now += step
        for other in remaining:
            remaining[other] -= step * rate
        finish[index] = now
        del remaining[index]
    at_once = min(jobs, len(durations)) if durations else 0
    return {"seconds": now, "finish": finish, "at_once": at_once,
            "slowdown": slowdown(at_once, cpus_per_run, cores) if at_once else 1.0}


def grid_forecast(runs: list[tuple[str, int, float]], jobs: int, cpus_per_run: int, cores: int) -> dict[str, Any]:
    """The grid's forecast: ``runs`` (arm, seed, its run's forecast seconds alone) in the plan's order, on ``jobs``
    slots."""
    scheduled = grid_wall([seconds for _, _, seconds in runs], jobs, cpus_per_run, cores)
    at_once, factor = scheduled["at_once"], scheduled["slowdown"]
    assumptions = [
        f"{len(runs)} run(s) started in the grid's order, at most {jobs} at once, each as soon as a slot is free",
        f"{cores} core(s), {cpus_per_run} per run (budget.threads x training.ranks): {at_once} run(s) at once "
        + (f"share the cores, each {factor:.3g}x slower than alone" if factor > 1 else "each have their own cores"),
        "each run's forecast is for the machine as loaded as it was while the pilot measured",
    ]
    if factor > 1:
        assumptions.append("runs that share cores also spend more CPU time per update than alone (caches, "
                           "switching; about 30 % at 2.5x on the 2-core machine of bench/README.md), which a cpu "
                           "clock charges: they then make fewer updates, not a longer run")
    return {"jobs": jobs, "cores": cores, "cpus_per_run": cpus_per_run, "seconds": scheduled["seconds"],
            "at_once": at_once, "slowdown": factor,
            "runs": [{"arm": arm, "seed": seed, "seconds": seconds, "ends_at": end}
                     for (arm, seed, seconds), end in zip(runs, scheduled["finish"], strict=True)],
            "assumptions": assumptions}


def duration_words(seconds: float) -> str:
    """A duration for a person: ``42 s``, ``3.5 min``, ``2.1 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def run_lines(forecast: dict[str, Any]) -> list[str]:
    """A run's forecast (``RunForecast.to_json``) for a person: the total, its parts, then what was assumed."""
    parts = ", ".join(f"{name.replace('_', ' ')} {duration_words(seconds)}"
                      for name, seconds in forecast["components"].items() if seconds)
    return [f"one run: {duration_words(forecast['total_seconds'])} of wall time ({parts})",
            *(f"  assumed: {line}" for line in forecast["assumptions"])]


def grid_lines(forecast: dict[str, Any]) -> list[str]:
    """A grid's forecast (``grid_forecast``) for a person."""
    arms: dict[str, float] = {}
    for run in forecast["runs"]:
        arms.setdefault(run["arm"], run["seconds"])
    each = ", ".join(f"{arm} {duration_words(seconds)}" for arm, seconds in arms.items())
    return [f"grid: {duration_words(forecast['seconds'])} of wall time for {len(forecast['runs'])} run(s) at "
            f"--jobs {forecast['jobs']} (one run alone: {each})",
            *(f"  assumed: {line}" for line in forecast["assumptions"])]
