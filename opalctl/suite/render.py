"""How ``opalctl suite`` prints: freeze's locks, the summary's per-task tables, the scores and the statement."""

from __future__ import annotations

import json
import sys
from typing import Any

from opalctl import console
from opalctl.compare.render import target_time


def render_freeze(result: dict[str, Any]) -> None:
    console.pairs(f"opalctl suite freeze {result['suite']}", [
        ("suite lock", result["suite_lock"]), ("sha256", result["sha256"]), ("outcome", result["outcome"]),
        ("baseline", result["baseline"]), ("arms", ", ".join(result["arms"]))])
    console.table("tasks", ["task", "lock", "outcome", "seeds"],
                  [[task, entry["lock"], entry["outcome"], ", ".join(map(str, entry["seeds"]))]
                   for task, entry in result["tasks"].items()])
    for task, entry in result["tasks"].items():
        for warning in entry["warnings"]:
            console.message(f"warning: task {task}: {warning}")


def render_status(result: dict[str, Any]) -> None:
    rows = []
    for task, status in result["tasks"].items():
        counts = ", ".join(f"{count} {state}" for state, count in sorted(status["counts"].items()))
        rows.append([task, status["lock"], counts])
    console.table(f"opalctl suite status {result['suite_lock']}", ["task", "lock", "runs"], rows)


def render_summary(summary: dict[str, Any]) -> None:
    arms = summary["arms"]
    tuned = summary.get("tuned_per_task") or {}
    for task, entry in summary["tasks"].items():
        target = entry["target"]
        sign = ">=" if target["direction"] == "higher" else "<="
        rows = []
        for row in entry["compare"]["arms"]:
            figure = row.get("time_to_target")
            if figure is None:
                continue
            ratio = summary["profiles"]["arms"].get(row["arm"], {}).get("ratios", {}).get(task)
            marks = (["baseline"] if row["baseline"] else []) + (["this task's settings"]
                                                                 if task in tuned.get(row["arm"], []) else [])
            rows.append([row["arm"] + (f" ({', '.join(marks)})" if marks else ""),
                         " ".join(f"{s}:{target_time(t)}" for s, t in figure["seeds"].items()),
                         target_time(figure["median"]), f"{figure['reached']}/{figure['of']}",
                         "never" if ratio is None else f"{ratio:.2f}"])
        console.table(f"task {task}: time to {target['metric']} {sign} {target['value']:g} ({entry['clock']} "
                      f"clock)", ["arm", "per seed", "median", "reached", "ratio"], rows)
    rows = [[arm + (" (baseline)" if arm == summary["baseline"] else ""), f"{summary['scores'][arm]:.3f}",
             _range(list(summary["seed_scores"][arm].values()))] for arm in arms]
    console.table(f"opalctl suite {summary['name']}: performance profile scores (area up to tau "
                  f"{summary['profiles']['tau_max']:g})", ["arm", "score", "over seeds"], rows)
    for sentence in summary["statement"]:
        console.paragraph(sentence)
    for note in summary["notes"]:
        console.paragraph("note: " + note)


def _range(values: list[float]) -> str:
    return "-" if not values else f"{min(values):.2f} to {max(values):.2f}"


def print_run_end(result: dict[str, Any]) -> None:
    """The last line of ``suite run --json``, after each grid's JSON lines: the suite's result on one line."""
    sys.stdout.write(json.dumps({"event": "suite", **result}, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def render_run_end(result: dict[str, Any], suite_lock: str) -> None:
    """The end of ``suite run`` for people: each task's finished runs, and the next command when all finished."""
    for task, grid in result["tasks"].items():
        done = sum(1 for run in grid["runs"] if run["state"] in ("finished", "resumed", "skipped"))
        console.message(f"task {task}: {done} of {len(grid['runs'])} runs finished")
    if result["ok"]:
        console.message(f"next: opalctl suite summary {suite_lock}")
