"""``opalctl compare LOCK``: the arms of one frozen protocol side by side, across seeds, paired by seed.

Only runs made from this very lock are read (their folder is named after the lock's digest, and each report
names the lock's sha256, which is checked), so a comparison can never mix protocols. The selected model of
each run (the last promoted stage, or the anchor when none qualified) is what is compared: that is the model the
pre-registered policy would hand over. Paired differences to the baseline are taken seed by seed.

A report is read tolerantly: only the keys compare needs (``REPORT_KEYS``, and in each stage its ``metrics`` and
seconds) must be there, so reports written before ``opalctl.formats.RunReport`` held every field still compare;
a report that lacks one of those is refused as damaged, naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.compare.statistics import paired, summary, time_to_reach
from opalctl.driver.budget import clock_spec
from opalctl.errors import BadInput
from opalctl.files import read_json
from opalctl.formats import RecordDamaged

# the fields of a RunReport that compare reads (a test checks they are RunReport's)
REPORT_KEYS = ("lock_sha256", "updates", "seconds", "budget", "promoted_stages", "selected", "stages",
               "anchor_metrics")
# the agent figures compare summarises across seeds (fields of AgentFigures)
AGENT_KEYS = ("decisions_asked", "decisions_applied", "decisions_reverted", "waiting_seconds", "cost_usd")


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
            report = read_report(report_path)
            if report.get("lock_sha256") != lock.sha256:
                raise BadInput(f"run {folder} was made from lock {str(report.get('lock_sha256'))[:12]}, not "
                               f"{lock.sha12} ({lock.path}); compare only runs of one lock")
            finished.setdefault(arm, {})[seed] = report
    if not finished:
        raise BadInput(f"no finished runs of lock {lock.path} under {base}; finish at least one run first")
    return base, finished, unfinished


def read_report(path: Path) -> dict[str, Any]:
    """A run's ``report.json``, with at least the keys compare reads (``RecordDamaged`` naming the file if not)."""
    try:
        report = read_json(path)
    except ValueError:
        raise RecordDamaged(f"{path} is not JSON; the record is damaged (run the arm again)") from None
    if not isinstance(report, dict):
        raise RecordDamaged(f"{path} is not a JSON object; the record is damaged (run the arm again)")
    missing = [key for key in REPORT_KEYS if key not in report]
    if missing:
        raise RecordDamaged(f"{path} lacks {', '.join(missing)}; the record is damaged (run the arm again)")
    return report


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
    baseline = _baseline(lock, baseline, arms, finished)
    directions = _metric_directions(lock)
    clock = lock.resolved["budget"]["clock"]
    seconds_key = clock_spec(clock).compare_seconds
    primary = next(iter(directions), None)
    rows = []
    for arm in arms:
        entry = _arm_row(arm, baseline, finished, unfinished)
        for metric, higher in directions.items():
            values = {s: _selected_metric(finished[arm][s], metric) for s in entry["seeds"]}
            entry["metrics"][metric] = summary(values.values(), what=f"the selected {metric} of arm {arm}")
            if arm != baseline:
                base_values = {s: _selected_metric(finished[baseline][s], metric) for s in finished[baseline]}
                entry["paired"][metric] = paired(base_values, values, higher_is_better=higher, resamples=resamples,
                                                 what=f"selected {metric} (arm {arm}, baseline {baseline})")
        if primary is not None:
            entry["time_to_baseline"] = _time_to_baseline(finished[arm], finished[baseline], primary,
                                                          directions[primary], seconds_key)
        rows.append(entry)
    return {"lock": str(lock.path), "lock_sha256": lock.sha256, "runs": str(base), "baseline": baseline,
            "clock": clock, "seconds_key": seconds_key,
            "metrics": {m: ("higher" if h else "lower") for m, h in directions.items()},
            "primary": primary, "arms": rows}


def _baseline(lock, baseline: str | None, arms: list[str], finished: dict[str, dict[int, dict]]) -> str:
    """The arm the others are paired against: the one asked for, or the first arm with finished runs."""
    if baseline is None:
        return arms[0]
    if baseline not in lock.resolved["arms"]:
        raise BadInput(f"--baseline {baseline!r} is not an arm of {lock.path} ({', '.join(lock.resolved['arms'])})")
    if baseline not in finished:
        raise BadInput(f"--baseline {baseline!r} has no finished runs yet; run it first")
    return baseline


def _arm_row(arm: str, baseline: str, finished: dict[str, dict[int, dict]],
             unfinished: dict[str, list[int]]) -> dict[str, Any]:
    """One arm's figures that need no metric; ``metrics``, ``paired`` and ``time_to_baseline`` are filled after."""
    reports = finished[arm]
    seeds = sorted(reports)
    return {
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


def _time_to_baseline(reports: dict[int, dict], baseline_reports: dict[int, dict], primary: str, higher: bool,
                      seconds_key: str) -> dict[str, Any]:
    """How long the arm took, seed by seed, to reach the baseline's final value of the primary metric."""
    reached = []
    for seed in sorted(reports):
        if seed not in baseline_reports:
            continue
        target = baseline_reports[seed]["stages"][-1]["metrics"][primary]
        reached.append(time_to_reach(_curve(reports[seed], primary, seconds_key), target, higher_is_better=higher))
    hits = [r for r in reached if r is not None]
    return {"metric": primary, "seconds": summary(hits), "reached": len(hits), "of": len(reached)}


def _selected_metric(report: dict, metric: str) -> float:
    if report["selected"]["source"] == "anchor":
        return report["anchor_metrics"][metric]
    stage = next(s for s in report["stages"] if s["stage"] == report["selected"]["stage"])
    return stage["metrics"][metric]


def _agent_figures(reports: dict[int, dict]) -> dict[str, Any] | None:
    agents = [r["agent"] for r in reports.values() if r.get("agent")]
    if not agents:
        return None
    return {key: summary([a.get(key, 0) or 0 for a in agents]) for key in AGENT_KEYS}
