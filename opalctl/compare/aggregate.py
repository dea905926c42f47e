"""``opalctl compare LOCK``: the arms of one frozen protocol side by side, across seeds, paired by seed.

Only runs made from this very lock are read (their folder is named after the lock's digest, and each report
names the lock's sha256, which is checked), so a comparison can never mix protocols. The selected model of
each run (the last promoted stage, or the anchor when none qualified) is what is compared: that is the model the
pre-registered policy would hand over. Paired differences to the baseline are taken seed by seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.compare.statistics import paired, summary, time_to_reach
from opalctl.errors import BadInput
from opalctl.files import read_json


def _metric_directions(lock) -> dict[str, bool]:
    """The metrics the promotion policy names, each with True when higher is better."""
    from opalctl.tasks import load_task_class

    protocol = lock.protocol()
    selection = protocol.selection
    kinds = load_task_class(protocol.task.entry).metrics
    names: list[str] = []
    for name in list(selection.improve_any) + list(selection.nondecreasing) + list(selection.floors) + \
            list(selection.nonincreasing):
        if name not in names:
            names.append(name)
    directions = {}
    for name in names:
        kind = kinds.get(name.partition(".")[2], "higher")
        directions[name] = not (name in selection.nonincreasing or kind == "lower")
    return directions


def collect(lock, runs_dir: Path) -> tuple[Path, dict[str, dict[int, dict]], dict[str, list[int]]]:
    base = Path(runs_dir) / f"{lock.name}-{lock.sha12}"
    if not base.is_dir():
        raise BadInput(f"there are no runs of lock {lock.path} under {runs_dir} (looked for {base}); run "
                       f"`opalctl run {lock.path} --arm ARM --seed SEED` first")
    finished: dict[str, dict[int, dict]] = {}
    unfinished: dict[str, list[int]] = {}
    for arm in lock.resolved["arms"]:
        for folder in sorted((base / arm).glob("seed-*")):
            try:
                seed = int(folder.name.split("-", 1)[1])
            except ValueError:
                continue
            report_path = folder / "report.json"
            if not report_path.exists():
                unfinished.setdefault(arm, []).append(seed)
                continue
            report = read_json(report_path)
            if report.get("lock_sha256") != lock.sha256:
                raise BadInput(f"run {folder} was made from lock {str(report.get('lock_sha256'))[:12]}, not "
                               f"{lock.sha12} ({lock.path}); compare only runs of one lock")
            finished.setdefault(arm, {})[seed] = report
    if not finished:
        raise BadInput(f"no finished runs of lock {lock.path} under {base}; finish at least one run first")
    return base, finished, unfinished


def _curve(report: dict, metric: str, seconds_key: str) -> list[tuple[float, float]]:
    return [(stage[seconds_key], stage["metrics"][metric]) for stage in report["stages"] if metric in stage["metrics"]]


def compare(lock_path: str | Path, *, baseline: str | None = None, runs_dir=None,
            resamples: int = 10_000) -> dict[str, Any]:
    from opalctl.driver.run import runs_dir_default
    from opalctl.protocol.lock import read_lock

    lock = read_lock(Path(lock_path))
    runs_dir = runs_dir_default(runs_dir)
    base, finished, unfinished = collect(lock, runs_dir)
    arms = [arm for arm in lock.resolved["arms"] if arm in finished]
    if baseline is None:
        baseline = arms[0]
    elif baseline not in lock.resolved["arms"]:
        raise BadInput(f"--baseline {baseline!r} is not an arm of {lock.path} ({', '.join(lock.resolved['arms'])})")
    elif baseline not in finished:
        raise BadInput(f"--baseline {baseline!r} has no finished runs yet; run it first")
    directions = _metric_directions(lock)
    clock = lock.resolved["budget"]["clock"]
    seconds_key = "train_wall_seconds" if clock in ("wall", "gpu") else "train_cpu_seconds"
    primary = next(iter(directions), None)
    rows = []
    for arm in arms:
        reports = finished[arm]
        seeds = sorted(reports)
        entry: dict[str, Any] = {
            "arm": arm,
            "baseline": arm == baseline,
            "seeds": seeds,
            "unfinished_seeds": sorted(unfinished.get(arm, [])),
            "updates": summary([reports[s]["updates"] for s in seeds]),
            "train_cpu_seconds": summary([reports[s]["seconds"]["train_cpu"] for s in seeds]),
            "train_wall_seconds": summary([reports[s]["seconds"]["train_wall"] for s in seeds]),
            "budget_used": summary([reports[s]["budget"]["used"] for s in seeds]),
            "promoted_stages": summary([len(reports[s]["promoted_stages"]) for s in seeds]),
            "selected_anchor": sum(1 for s in seeds if reports[s]["selected"]["source"] == "anchor"),
            "metrics": {},
            "paired": {},
            "time_to_baseline": {},
            "agent": _agent_figures(reports),
        }
        for metric, higher in directions.items():
            values = {s: _selected_metric(reports[s], metric) for s in seeds}
            entry["metrics"][metric] = summary(values.values())
            if arm != baseline:
                base_values = {s: _selected_metric(finished[baseline][s], metric) for s in finished[baseline]}
                entry["paired"][metric] = paired(base_values, values, higher_is_better=higher,
                                                 resamples=resamples)
        if primary is not None:
            reached = []
            for s in seeds:
                if s not in finished[baseline]:
                    continue
                target = finished[baseline][s]["stages"][-1]["metrics"][primary]
                reached.append(time_to_reach(_curve(reports[s], primary, seconds_key), target,
                                             higher_is_better=directions[primary]))
            hits = [r for r in reached if r is not None]
            entry["time_to_baseline"] = {"metric": primary, "seconds": summary(hits), "reached": len(hits),
                                         "of": len(reached)}
        rows.append(entry)
    return {"lock": str(lock.path), "lock_sha256": lock.sha256, "runs": str(base), "baseline": baseline,
            "clock": clock, "metrics": {m: ("higher" if h else "lower") for m, h in directions.items()},
            "primary": primary, "arms": rows}


def _selected_metric(report: dict, metric: str) -> float:
    if report["selected"]["source"] == "anchor":
        return report["anchor_metrics"][metric]
    stage = next(s for s in report["stages"] if s["stage"] == report["selected"]["stage"])
    return stage["metrics"][metric]


def _agent_figures(reports: dict[int, dict]) -> dict[str, Any] | None:
    agents = [r["agent"] for r in reports.values() if r.get("agent")]
    if not agents:
        return None
    keys = ("decisions_asked", "decisions_applied", "decisions_reverted", "waiting_seconds", "cost_usd")
    return {key: summary([a.get(key, 0) or 0 for a in agents]) for key in keys}
