"""``opalctl suite summary``: each task's comparison (``compare``, against the suite's baseline, with its
time-to-target), the performance profile and score of every arm across tasks (compare/profiles.py), each arm's
score on one seed at a time, and what the scores can and cannot say with the seeds at hand (``statement``),
naming every arm whose settings a task replaces (``tuned_per_task``: tuned per task, as AlgoPerf's external tuning
tunes per workload).

An arm's time on a task is its median time-to-target over that task's finished seeds (compare/target.py: more than
half not reached is not reached); an arm with no finished run on a task counts as not reached there, and the
summary says so. Nothing is written.
"""

from __future__ import annotations

import math
from typing import Any

from opalctl.compare.aggregate import compare
from opalctl.compare.profiles import TAU_MAX, profiles
from opalctl.compare.significance import ALPHA, TEST_MIN_SEEDS
from opalctl.errors import BadInput
from opalctl.protocol.lock import read_lock
from opalctl.suite.lock import SuiteLock
from opalctl.suite.spec import tuned_per_task


def _time(value: float | None) -> float:
    return math.inf if value is None else float(value)


def summarise(lock: SuiteLock, *, runs_dir=None, resamples: int = 10_000) -> dict[str, Any]:
    arms = list(lock.data["arms"])
    tasks: dict[str, Any] = {}
    medians: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    for task in lock.tasks:
        task_lock = lock.lock_of(task)
        try:
            result = compare(task_lock, runs_dir=runs_dir, baseline=lock.baseline, resamples=resamples)
        except BadInput as error:
            raise BadInput(f"task {task} of suite {lock.name} cannot be summarised yet ({error.message.rstrip('.')});"
                           f" run the suite first (`opalctl suite run {lock.path}`)") from None
        rows = {row["arm"]: row for row in result["arms"] if not row.get("post_hoc")}
        medians[task] = {}
        for arm in arms:
            row = rows.get(arm)
            if row is None or row.get("time_to_target") is None:
                medians[task][arm] = math.inf
                notes.append(f"task {task}: arm {arm} has no finished run, so it counts as not reaching the target")
                continue
            medians[task][arm] = _time(row["time_to_target"]["median"])
            if row["unfinished_seeds"]:
                notes.append(f"task {task}: arm {arm}'s time is the median of {len(row['seeds'])} finished seeds "
                             f"({len(row['unfinished_seeds'])} unfinished)")
        tasks[task] = {"lock": str(task_lock), "target": result["target"], "clock": result["clock"],
                       "fractions": list(read_lock(task_lock).resolved["budget"]["fractions"]),
                       "times": {arm: None if math.isinf(t) else t for arm, t in medians[task].items()},
                       "compare": result}
    profile = profiles(medians)
    seeds, seed_scores = _seed_scores(tasks, arms)
    summary = {"suite_lock": str(lock.path), "suite_sha256": lock.sha256, "name": lock.name,
               "baseline": lock.baseline, "arms": arms, "tasks": tasks, "profiles": profile,
               "scores": {arm: profile["arms"][arm]["score"] for arm in arms},
               "seeds": seeds, "seed_scores": seed_scores, "notes": notes,
               "tuned_per_task": tuned_per_task((lock.data.get("suite") or {}).get("tasks") or {})}
    summary["statement"] = statement(summary)
    return summary


def _seed_scores(tasks: dict[str, Any], arms: list[str]) -> tuple[list[int], dict[str, dict[str, float]]]:
    """Each arm's score on one seed at a time (seed s's time on every task), over the seeds every task has."""
    common: set[int] | None = None
    for entry in tasks.values():
        seeds = {int(s) for row in entry["compare"]["arms"] for s in row["seeds"]}
        common = seeds if common is None else common & seeds
    seeds = sorted(common or [])
    scores: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for seed in seeds:
        times = {}
        for task, entry in tasks.items():
            rows = {row["arm"]: row for row in entry["compare"]["arms"] if not row.get("post_hoc")}
            times[task] = {arm: _time(((rows.get(arm) or {}).get("time_to_target") or {"seeds": {}})["seeds"]
                                      .get(str(seed))) for arm in arms}
        for arm, figure in profiles(times)["arms"].items():
            scores[arm][str(seed)] = figure["score"]
    return seeds, scores


def statement(summary: dict[str, Any]) -> list[str]:
    """What the scores can and cannot say with the seeds at hand, in sentences."""
    tasks, arms = summary["tasks"], summary["arms"]
    seeds_per_task = sorted({len(row["seeds"]) for entry in tasks.values() for row in entry["compare"]["arms"]})
    seeds_text = (f"{seeds_per_task[0]}" if len(seeds_per_task) == 1
                  else f"{seeds_per_task[0]} to {seeds_per_task[-1]}")
    fractions = sorted({fraction for entry in tasks.values() for fraction in entry["fractions"]})
    out = [f"Each score is the area under the arm's performance profile over {len(tasks)} task"
           f"{'s' if len(tasks) != 1 else ''} (tau from 1 to {TAU_MAX:g}, scaled so 1 is fastest everywhere and 0 "
           f"never within a factor of {TAU_MAX:g}), from its median time-to-target over {seeds_text} seed(s) per "
           f"task: it ranks the arms by how often and by how much each came close to the fastest arm on these "
           f"tasks, at these budgets and targets.",
           f"It cannot say more: it is no test (a median hides the spread over seeds), each task moves it by at most "
           f"1/{len(tasks)}, it says nothing of tasks outside the suite, and times are read only at the stages "
           f"({', '.join(f'{f:g}' for f in fractions)} of the budget), so two arms that reach the target between "
           f"the same two stages tie."]
    ranges = {arm: list(summary["seed_scores"][arm].values()) for arm in arms}
    if summary["seeds"] and len(summary["seeds"]) > 1:
        spans = "; ".join(f"{arm} {min(v):.2f} to {max(v):.2f}" for arm, v in ranges.items() if v)
        order = sorted(arms, key=lambda arm: -summary["scores"][arm])
        overlapping = [f"{a} and {b}" for a, b in zip(order, order[1:])
                       if ranges[a] and ranges[b] and min(ranges[a]) <= max(ranges[b])]
        out.append(f"Scored one seed at a time (seeds {', '.join(map(str, summary['seeds']))} on every task), the "
                   f"scores range: {spans}. "
                   + (f"Where neighbours' ranges overlap ({'; '.join(overlapping)}), these seeds do not order them."
                      if overlapping else "No neighbours' ranges overlap on these seeds, which is still no test."))
    else:
        out.append("With one seed per task there is no spread at all to set a score against: the ranking may be "
                   "that seed's alone.")
    for arm, where in (summary.get("tuned_per_task") or {}).items():
        out.append(f"Arm {arm} runs with its own settings on {', '.join(where)} (the suite file's tasks.TASK.arms), "
                   f"its suite settings elsewhere: it is tuned per task, as AlgoPerf's external tuning tunes a "
                   f"submission per workload, so its score is that of a per-task tuning, against arms whose "
                   f"settings are the same on every task.")
    claims = []
    for task, entry in tasks.items():
        for row in entry["compare"]["arms"]:
            pair = (row.get("time_to_target") or {}).get("paired")
            if pair and pair["p_value"] is not None and pair["p_value"] < ALPHA:
                claims.append(f"{row['arm']} on {task} ({pair['mean_difference']:+g})")
    if claims:
        out.append(f"Against {summary['baseline']}, time-to-target differs by the exact sign-flip test (p < "
                   f"{ALPHA:g}, on the seeds both reached) for: {', '.join(claims)}.")
    else:
        out.append(f"No arm's time-to-target differs from {summary['baseline']}'s on any task by the exact sign-flip "
                   f"test at p < {ALPHA:g}; that needs at least {TEST_MIN_SEEDS} seeds that both reached the target.")
    return out

