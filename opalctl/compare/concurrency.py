"""Whether the arms of one seed trained under the same concurrency, from each report's ``machine`` record.

A CPU-second beside a neighbour buys less than one alone (driver/sharing.py, docs/grid.md), so two arms of a seed
that trained with different numbers of runs on the machine were not at equal compute, whatever the clock says.
Reports without a ``machine`` record (older runs, or a record without ``concurrent_runs``) are passed over: the
warning speaks only of what was measured. Runs on the ``updates`` clock are passed over too: an update is the same
work alone or beside a neighbour, so their arms are at equal compute whatever shared the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.formats import REPORT_MAX_BYTES, RecordDamaged, read_record
from opalctl.layout import RunLayout

DIFFERENCE = 0.5  # mean concurrent runs that differ by this much or more are different conditions


def mean_concurrency(report: dict[str, Any]) -> float | None:
    machine = report.get("machine")
    figures = machine.get("concurrent_runs") if isinstance(machine, dict) else None
    mean = figures.get("mean") if isinstance(figures, dict) else None
    return float(mean) if isinstance(mean, (int, float)) else None


def _on_updates_clock(report: dict[str, Any]) -> bool:
    budget = report.get("budget")
    return isinstance(budget, dict) and budget.get("clock") == "updates"


def seed_concurrency(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """seed -> arm -> the mean number of runs on the machine while that arm trained on that seed."""
    base = Path(result["runs"])
    found: dict[int, dict[str, float]] = {}
    for arm in result["arms"]:
        for seed in arm["seeds"]:
            try:
                report = read_record(RunLayout(base / arm["arm"] / f"seed-{seed}").report, limit=REPORT_MAX_BYTES)
            except RecordDamaged:
                continue
            if not isinstance(report, dict) or _on_updates_clock(report):
                continue
            mean = mean_concurrency(report)
            if mean is not None:
                found.setdefault(int(seed), {})[arm["arm"]] = mean
    return found


def concurrency_warnings(result: dict[str, Any]) -> list[str]:
    """One sentence per seed whose arms trained under different concurrency."""
    sentences = []
    for seed, arms in sorted(seed_concurrency(result).items()):
        if len(arms) < 2 or max(arms.values()) - min(arms.values()) < DIFFERENCE:
            continue
        shown = ", ".join(f"{arm} {mean:.1f}" for arm, mean in arms.items())
        sentences.append(f"the arms of seed {seed} trained under different concurrency (mean runs on the machine: "
                         f"{shown}); a CPU-second beside a neighbour buys less than one alone, so they were not at "
                         f"equal compute: run them side by side with `opalctl grid` (docs/grid.md)")
    return sentences
