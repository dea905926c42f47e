"""Does the pilot's forecast hold? The forecast against real runs, on digits and pylm, on the cpu and updates clocks.

For each case the task's shipped protocol (``opalctl init``) gets a small budget on the case's clock, two arms
(``adamw``, ``adamw-cosine``) and one seed, and is frozen; then, through the command line as a user types it:

1. ``opalctl pilot LOCK --arm adamw --json``: the projected updates and the forecast wall time of one run;
2. ``opalctl run LOCK --arm adamw --seed 1``, timed from outside (the whole process, start to exit);
3. ``opalctl grid LOCK --forecast --jobs 2 --json``, then ``opalctl grid LOCK --jobs 2`` in a runs folder of its
   own, timed the same way.

Reported per case: forecast and actual updates (the cpu clock's projection; the updates clock's is exact), one
run's wall seconds and the grid's, and the error of each (forecast / actual - 1); the target is within 25 %. The
load average before and after each case is printed beside it: on a shared machine the wall times follow the load,
which no forecast knows in advance. One command, about 5 minutes on a quiet 2-core machine:

    python bench/forecast.py [--cases digits-cpu,pylm-updates] [--out forecast.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# case -> (task, budget): small budgets, so that a run takes well under a minute on a quiet machine
CASES = {
    "digits-cpu": ("digits", {"clock": "cpu", "amount": 10}),
    "digits-updates": ("digits", {"clock": "updates", "amount": 8000}),
    "pylm-cpu": ("pylm", {"clock": "cpu", "amount": 8}),
    "pylm-updates": ("pylm", {"clock": "updates", "amount": 400}),
}
ARMS = ("adamw", "adamw-cosine")
TARGET = 0.25


def opalctl(*args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m opalctl ARGS`` as a user runs it; returns the process and its wall seconds, start to exit."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "opalctl", *args], capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"opalctl {' '.join(args)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return done, seconds


def prepare(work: Path, task: str, budget: dict) -> Path:
    """The task's shipped protocol with the case's budget, two arms and one seed, frozen; returns the lock."""
    import yaml

    opalctl("init", task, "--dir", str(work), "--seeds", "1")
    path = work / f"{task}.yaml"
    protocol = yaml.safe_load(path.read_text())
    protocol["budget"].update(budget)
    protocol["arms"] = {name: protocol["arms"][name] for name in ARMS}
    protocol["seeds"] = [1]
    path.write_text(yaml.safe_dump(protocol, sort_keys=False))
    opalctl("freeze", str(path))
    return work / f"{task}.lock.json"


def error(forecast: float, actual: float) -> float:
    return forecast / actual - 1.0 if actual else float("nan")


def measure(name: str, work: Path) -> dict:
    task, budget = CASES[name]
    load_before = os.getloadavg()[0]
    lock = prepare(work, task, budget)
    pilot = json.loads(opalctl("pilot", str(lock), "--arm", ARMS[0], "--json")[0].stdout)
    _, run_seconds = opalctl("run", str(lock), "--arm", ARMS[0], "--seed", "1", "--runs-dir", str(work / "runs"),
                             "--json")
    report = json.loads((next((work / "runs").glob(f"*/{ARMS[0]}/seed-1/report.json"))).read_text())
    grid_runs = str(work / "grid-runs")
    grid_forecast = json.loads(opalctl("grid", str(lock), "--forecast", "--jobs", "2", "--runs-dir", grid_runs,
                                       "--json")[0].stdout)
    _, grid_seconds = opalctl("grid", str(lock), "--jobs", "2", "--runs-dir", grid_runs, "--json")
    forecast = pilot["forecast"]
    return {
        "case": name, "task": task, "budget": budget,
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "updates": {"forecast": pilot["projected_updates"], "actual": report["updates"],
                    "error": error(pilot["projected_updates"], report["updates"])},
        "run_seconds": {"forecast": forecast["total_seconds"], "actual": run_seconds,
                        "error": error(forecast["total_seconds"], run_seconds)},
        "grid_seconds": {"forecast": grid_forecast["seconds"], "actual": grid_seconds,
                         "error": error(grid_forecast["seconds"], grid_seconds), "runs": len(grid_forecast["runs"]),
                         "jobs": 2},
        "forecast_components": forecast["components"],
        "actual_seconds": report["seconds"],
        "pilot": {key: pilot[key] for key in ("cpu_seconds_per_update", "wall_seconds_per_update", "steps",
                                               "warmup", "timings")},
    }


def table(results: list[dict]) -> str:
    rows = [f"{'case':<15} {'load':>9} {'updates fc/act':>17} {'err':>6} {'run s fc/act':>13} {'err':>6} "
            f"{'grid s fc/act':>14} {'err':>6}"]
    for r in results:
        u, s, g = r["updates"], r["run_seconds"], r["grid_seconds"]
        rows.append(f"{r['case']:<15} {r['load_before']:>4.1f}-{r['load_after']:<4.1f} "
                    f"{u['forecast']:>8.0f}/{u['actual']:<8} {u['error']:>+6.0%} "
                    f"{s['forecast']:>6.1f}/{s['actual']:<6.1f} {s['error']:>+6.0%} "
                    f"{g['forecast']:>6.1f}/{g['actual']:<7.1f} {g['error']:>+6.0%}")
    held = sum(abs(r[key]["error"]) <= TARGET for r in results for key in ("updates", "run_seconds", "grid_seconds"))
    rows.append(f"within {TARGET:.0%}: {held} of {3 * len(results)} figures")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", default="forecast.json", help="where the JSON of every figure is written")
    args = parser.parse_args()
    names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
    results = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="opalctl-forecast-") as scratch:
        for name in names:
            print(f"== {name}", file=sys.stderr, flush=True)
            results.append(measure(name, Path(scratch) / name))
            print(table(results[-1:]).splitlines()[1], file=sys.stderr, flush=True)
    summary = {"cases": results, "seconds": time.perf_counter() - started, "target": TARGET,
               "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(table(results))
    print(f"total {summary['seconds']:.0f} s; figures in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
