"""``opalctl compare --csv``: one row per arm and metric, every figure of the table and of both paired tests, for a
spreadsheet or a plotting script. The paired columns are empty on the baseline's rows, and each is defined in
``columns.FIELDS``; the decision columns (``decisions_*``, summed over the arm's seeds, and ``acted_seeds``:
compare/decisions.py) are empty on a fixed arm's. Columns added later come after the older ones, so a script that
reads them by position still reads what it did."""

from __future__ import annotations

import csv
import sys
from typing import Any

from opalctl.compare.decisions import COUNTS

SUMMARY_COLUMNS = ("n", "mean", "std", "min", "max")
PAIRED_COLUMNS = ("mean_difference", "ci_low", "ci_high", "interval_reliable", "wins", "ties", "losses", "p_value",
                  "p_exact", "detectable_effect", "seeds_needed", "note", "verdict", "sd_difference", "d_z",
                  "t_statistic", "t_df", "t_p_value", "t_ci_low", "t_ci_high", "t_seeds_needed", "t_note")
DECISION_COLUMNS = (*(f"decisions_{key}" for key in COUNTS), "acted_seeds")
# the arm's time-to-target (compare/target.py), the same on each of its rows; empty where the protocol has no target
TARGET_COLUMNS = ("target", "time_to_target_seeds", "time_to_target_median", "time_to_target_reached")
COLUMNS = ("arm", "baseline", "stage", "metric", "direction", *SUMMARY_COLUMNS, "seed_values", *PAIRED_COLUMNS,
           *DECISION_COLUMNS, *TARGET_COLUMNS)


def csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for arm in result["arms"]:
        for metric, direction in result["metrics"].items():
            figure = arm["metrics"][metric]
            pair = arm["paired"].get(metric) or {}
            row = {"arm": arm["arm"], "baseline": result["baseline"], "stage": result["stage"], "metric": metric,
                   "direction": direction, **{key: figure[key] for key in SUMMARY_COLUMNS},
                   "seed_values": " ".join(f"{s}:{v!r}" for s, v in arm["values"][metric].items()),
                   **{key: pair.get(key) for key in PAIRED_COLUMNS}, **_decision_cells(arm.get("decisions")),
                   **_target_cells(result.get("target"), arm.get("time_to_target"))}
            rows.append(row)
    return rows


def _decision_cells(decisions: dict[str, Any] | None) -> dict[str, Any]:
    if decisions is None:  # a fixed arm: no decisions, not zero of them
        return dict.fromkeys(DECISION_COLUMNS)
    return {**{f"decisions_{key}": decisions["total"][key] for key in COUNTS},
            "acted_seeds": " ".join(map(str, decisions["acted_seeds"])) or "none"}


def _target_cells(target: dict[str, Any] | None, figure: dict[str, Any] | None) -> dict[str, Any]:
    if not target or figure is None:
        return dict.fromkeys(TARGET_COLUMNS)
    sign = ">=" if target["direction"] == "higher" else "<="
    return {"target": f"{target['metric']} {sign} {target['value']!r}",
            "time_to_target_seeds": " ".join(f"{s}:{'never' if t is None else repr(t)}" for s, t in figure["seeds"].items()),
            "time_to_target_median": "never" if figure["median"] is None else figure["median"],
            "time_to_target_reached": f"{figure['reached']}/{figure['of']}"}


def write_csv(result: dict[str, Any], stream=None) -> None:
    writer = csv.DictWriter(stream or sys.stdout, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(result):
        writer.writerow({key: "" if value is None else value for key, value in row.items()})
