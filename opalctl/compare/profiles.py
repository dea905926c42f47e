"""Performance profiles over a suite of tasks (Dolan and Moré's, as AlgoPerf scores its submissions).

For arms A over tasks T with time-to-target t(a, task) (``math.inf`` when not reached: compare/target.py), the
ratio of an arm on a task is r = t / min over arms of t: 1 for the fastest arm, and for every arm that ties it
(an exact tie of times is a tie of ratios, both 1). An arm that did not reach the target has r = inf; on a task no
arm reached, every arm's r is inf (nobody is credited for it). The profile rho_a(tau) is the fraction of tasks with
r <= tau, a step function of tau from 1 to ``TAU_MAX`` (4, as AlgoPerf's r_max); a ratio above it counts as not
reached. The score is the profile's area over [1, TAU_MAX] divided by TAU_MAX - 1, so 1 means fastest on every
task and 0 never within a factor of 4: each task adds (TAU_MAX - r) / (TAU_MAX - 1) when r <= TAU_MAX, else 0,
and the score is their mean over tasks.

Pure: numbers in, numbers out. JSON never holds an infinity: a ratio that is one reads ``None`` there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TAU_MAX = 4.0


def ratios(times: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """task -> arm -> r. Every task must name the same arms, each time positive or ``math.inf``."""
    arms: list[str] | None = None
    out: dict[str, dict[str, float]] = {}
    for task, by_arm in times.items():
        if arms is None:
            arms = sorted(by_arm)
        elif sorted(by_arm) != arms:
            raise ValueError(f"task {task!r} names arms {sorted(by_arm)}, not {arms}; every task needs every arm")
        for arm, time in by_arm.items():
            if math.isnan(time) or time <= 0:
                raise ValueError(f"time-to-target {time!r} of arm {arm!r} on task {task!r} is not positive")
        best = min(by_arm.values())
        out[task] = {arm: math.inf if math.isinf(best) or math.isinf(time) else time / best
                     for arm, time in by_arm.items()}
    return out


def rho(arm_ratios: list[float], tau: float) -> float:
    """The fraction of tasks on which the arm's ratio is within ``tau`` (0 with no task)."""
    if not arm_ratios:
        return 0.0
    return sum(1 for r in arm_ratios if r <= tau and r <= TAU_MAX) / len(arm_ratios)


def score(arm_ratios: list[float]) -> float:
    """The profile's area over [1, TAU_MAX], normalised by TAU_MAX - 1 (exact: the profile is a step function)."""
    if not arm_ratios:
        return 0.0
    return sum((TAU_MAX - r) / (TAU_MAX - 1) for r in arm_ratios if r <= TAU_MAX) / len(arm_ratios)


def steps(arm_ratios: list[float]) -> list[tuple[float, float]]:
    """The profile as (tau, rho) at 1, at every ratio where it rises, and at TAU_MAX: what a figure draws as steps."""
    taus = sorted({1.0, TAU_MAX, *(r for r in arm_ratios if r <= TAU_MAX)})
    return [(tau, rho(arm_ratios, tau)) for tau in taus]


def profiles(times: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Every arm's ratios (per task), profile steps and score, as JSON: ``{"tau_max", "tasks", "arms": {arm:
    {"ratios": {task: r or None}, "steps": [[tau, rho], ...], "score"}}}``."""
    table = ratios(times)
    arms = sorted({arm for by_arm in table.values() for arm in by_arm})
    out: dict[str, Any] = {"tau_max": TAU_MAX, "tasks": list(table), "arms": {}}
    for arm in arms:
        mine = [table[task][arm] for task in table]
        out["arms"][arm] = {
            "ratios": {task: None if math.isinf(table[task][arm]) else table[task][arm] for task in table},
            "steps": [[tau, value] for tau, value in steps(mine)],
            "score": score(mine),
        }
    return out
