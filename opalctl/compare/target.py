"""Time-to-target: the budget a run had been charged when one of its stages first reached the protocol's
``target`` (``protocol/schema.py``'s ``Target``), or "not reached" (an infinite time, as AlgoPerf counts it).

What is read, and why: only the evaluator's stage records (``stages`` of ``report.json``, each a
``StageRecord``) and the lock. A stage's time is its fraction of the arm's budget on the protocol's clock
(``budget.amount x budget_multiplier x fraction``, all from the lock), not the ``budget_used`` figure the training
process sent with the stage: that process runs an agent arm's code, which could state any figure
(docs/architecture.md, "Why who writes a record matters more than its digest"). The stage is reached when the
meter has charged at least that fraction, so the time is the budget the run was entitled to by then, exact on the
``updates`` clock and within one update's charge on the others.

Which model is judged: each stage's *candidate* (that stage's checkpoint, evaluated by the evaluator), whether or
not promotion took it. Time-to-target measures how fast training got there; promotion is a separate, pre-registered
policy that compare reports on its own. A stage whose value was not finite (``null``) never reaches the target.

A time is a float here, ``math.inf`` when not reached; in JSON it is a number or ``null`` ("not reached"), never
an infinity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opalctl.compare.statistics import paired
from opalctl.tasks import load_task_class

NOT_REACHED = "not reached"


@dataclass(frozen=True)
class TargetRule:
    """The protocol's target with its direction (the task's kind of the metric)."""

    metric: str
    value: float
    higher: bool

    @classmethod
    def of(cls, lock) -> TargetRule | None:
        """The lock's target, or None when its protocol names none."""
        target = lock.resolved.get("target")
        if not target:
            return None
        kinds = load_task_class(lock.resolved["task"]["entry"]).metrics
        return cls(target["metric"], float(target["value"]), kinds.get(target["metric"].partition(".")[2]) != "lower")

    def reached(self, value: Any) -> bool:
        if value is None or not math.isfinite(float(value)):
            return False
        return float(value) >= self.value if self.higher else float(value) <= self.value

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "direction": "higher" if self.higher else "lower"}


def arm_budget(amount: float, arm: dict[str, Any]) -> float:
    """An arm's whole budget on the protocol's clock: the lock's ``budget.amount`` times the arm's multiplier."""
    return float(amount) * float(arm.get("budget_multiplier", 1.0))


def time_to_target(stages: list[dict[str, Any]], rule: TargetRule, budget: float) -> float:
    """The budget charged at the first stage whose candidate reached the target, or ``math.inf``."""
    for stage in stages:
        if rule.reached(stage["metrics"].get(rule.metric)):
            return float(stage["fraction"]) * budget
    return math.inf


def median(times: list[float]) -> float:
    """The median of ``times`` (infinite ones included, so more than half not reached is not reached); inf when
    empty."""
    if not times:
        return math.inf
    ordered = sorted(times)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    low, high = ordered[middle - 1], ordered[middle]
    return math.inf if math.isinf(high) else (low + high) / 2


def shown(time: float) -> float | None:
    """A time as JSON holds it: the number, or None for not reached."""
    return None if math.isinf(time) else time


def arm_times(rule: TargetRule, reports: Mapping[int, dict[str, Any]], budget: float) -> dict[int, float]:
    """seed -> time-to-target of one arm's finished runs."""
    return {seed: time_to_target(reports[seed]["stages"], rule, budget) for seed in sorted(reports)}


def arm_figure(times: Mapping[int, float], baseline: Mapping[int, float] | None, *, resamples: int,
               what: str) -> dict[str, Any]:
    """One arm's time-to-target figures: per seed, the median, how many seeds reached it and, against the
    baseline's (None for the baseline itself), the paired statistics on the seeds both reached (lower is better)
    with wins, ties and losses over every paired seed, a not-reached time counted as infinite (reaching beats not
    reaching; neither reaching is a tie)."""
    out: dict[str, Any] = {
        "seeds": {str(seed): shown(t) for seed, t in sorted(times.items())},
        "median": shown(median(list(times.values()))),
        "reached": sum(1 for t in times.values() if not math.isinf(t)),
        "of": len(times),
        "paired": None,
    }
    if baseline is None:
        return out
    common = sorted(set(times) & set(baseline))
    both = [s for s in common if not math.isinf(times[s]) and not math.isinf(baseline[s])]
    figure = paired({s: baseline[s] for s in both}, {s: times[s] for s in both}, higher_is_better=False,
                    resamples=resamples, what=what)
    figure["all_seeds"] = {
        "seeds": common,
        "wins": sum(1 for s in common if times[s] < baseline[s]),
        "ties": sum(1 for s in common if times[s] == baseline[s]),
        "losses": sum(1 for s in common if times[s] > baseline[s]),
    }
    figure["left_out"] = [s for s in common if s not in both]
    out["paired"] = figure
    return out
