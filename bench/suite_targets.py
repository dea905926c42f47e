"""Do the shipped targets still hold? The tuned baseline's time-to-target, re-measured at the full budget.

A target is fixed from the tuned baseline at its budget (docs/suite.md, docs/tasks.md): every seed reaches it
within the budget, none at its first stage. Re-measuring that takes long runs (about 150 CPU seconds in all, the
tasks' data and parents included), so it is a bench, not a unit test; the unit tests keep the behaviour at a tiny
budget (tests/suite/test_shipped_suite.py: the suite's per-task arm settings and target reach the lock, the
baseline's runs are deterministic and compare reads their time-to-target; tests/tasks/test_shapes_runs.py: the
template's target rule). The cases, each through the command line as a user types it:

- ``suite-illcond``: ``protocols/suite.yaml`` cut to its baseline, ``illcond`` seed 1 at its full budget
  (4,000 updates): recorded at 2,400.
- ``suite-modular``: the same cut, ``modular`` seed 3 for the first half of its budget (its baseline's schedule is
  constant, so on the ``updates`` clock the first 2,000 updates are those of the full run): recorded at 2,000.
- ``template-shapes``: ``opalctl init shapes --seeds 1`` and the template's ``adamw`` at its budget (3,000
  updates): recorded at 1,500.

For each: the baseline's time-to-target as ``opalctl compare --json`` reads it, its first stage's update and the
metric at every stage. It holds when the target is reached within the budget and not at the first stage; exit 1
when a case does not hold.

    python bench/suite_targets.py [--cases suite-illcond,template-shapes] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
# case -> (task, seed, the budget over the shipped one or None, the update recorded in the docs)
SUITE_CASES = {"suite-illcond": ("illcond", 1, None, 2400),
               "suite-modular": ("modular", 3, {"amount": 2000, "fractions": [0.5, 1.0]}, 2000)}
TEMPLATE_CASES = {"template-shapes": ("shapes", 1, None, 1500)}


def opalctl(*args, cwd: Path | None = None) -> dict:
    """``python -m opalctl ARGS --json`` as a user runs it; its last line of output, read as JSON."""
    done = subprocess.run([sys.executable, "-m", "opalctl", *map(str, args), "--json"], capture_output=True,
                          text=True, cwd=cwd, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"opalctl {' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr[-2000:]}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:  # a command that prints a line per event: its last line is the answer
        return json.loads(done.stdout.strip().splitlines()[-1])


def suite_lock(work: Path, task: str, seed: int, budget: dict | None) -> tuple[Path, str]:
    """The shipped suite cut to its baseline and ``task`` on ``seed`` (``budget`` over the task's), frozen by
    ``opalctl suite freeze``; (the task's lock, the baseline's name)."""
    suite = yaml.safe_load((REPO / "protocols" / "suite.yaml").read_text(encoding="utf-8"))
    baseline = suite["baseline"]
    spec = dict(suite["tasks"][task])
    spec["seeds"] = [seed]
    spec["budget"] = {**spec["budget"], **(budget or {})}
    tuned = {arm: settings for arm, settings in (spec.pop("arms", None) or {}).items() if arm == baseline}
    if tuned:
        spec["arms"] = tuned
    cut = {"name": "shipped", "seeds": [seed], "baseline": baseline, "arms": {baseline: suite["arms"][baseline]},
           "tasks": {task: spec}}
    path = work / "shipped.yaml"
    path.write_text(yaml.safe_dump(cut, sort_keys=False), encoding="utf-8")
    frozen = opalctl("suite", "freeze", path, cwd=work)
    return Path(frozen["folder"]) / frozen["tasks"][task]["lock"], baseline


def template_lock(work: Path, task: str, seed: int) -> tuple[Path, str]:
    """``opalctl init TASK --seeds SEED`` and ``opalctl freeze``; (the lock, ``adamw``)."""
    opalctl("init", task, "--dir", work, "--seeds", seed)
    return Path(opalctl("freeze", work / f"{task}.yaml")["lock"]), "adamw"


def measure(case: str, work: Path) -> dict:
    if case in SUITE_CASES:
        task, seed, budget, recorded = SUITE_CASES[case]
        lock, arm = suite_lock(work, task, seed, budget)
    else:
        task, seed, _, recorded = TEMPLATE_CASES[case]
        lock, arm = template_lock(work, task, seed)
    runs = work / "runs"
    opalctl("run", lock, "--arm", arm, "--seed", seed, "--runs-dir", runs, cwd=work)
    compared = opalctl("compare", lock, "--runs-dir", runs, "--baseline", arm)
    target = compared["target"]
    (row,) = [row for row in compared["arms"] if row["arm"] == arm]
    time = row["time_to_target"]["seeds"].get(str(seed))
    (folder,) = runs.glob(f"*/{arm}/seed-{seed}")
    stages = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("stage-*.json"))]
    report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    amount = float(report["updates"])
    first = stages[0]["update"]
    holds = time is not None and first < time <= amount
    return {"case": case, "task": task, "seed": seed, "arm": arm, "target": target, "budget": amount,
            "first_stage": first, "time_to_target": time, "recorded": recorded, "as_recorded": time == recorded,
            "holds": holds, "stages": [[s["update"], s["metrics"][target["metric"]]] for s in stages]}


def main() -> int:
    cases = list(SUITE_CASES) + list(TEMPLATE_CASES)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(cases), help=f"some of {', '.join(cases)}")
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    chosen = arguments.cases.split(",")
    unknown = [case for case in chosen if case not in cases]
    if unknown:
        parser.error(f"no case {', '.join(unknown)}; choose from {', '.join(cases)}")
    results = []
    for case in chosen:
        with tempfile.TemporaryDirectory(prefix=f"opalctl-{case}-") as work:
            result = measure(case, Path(work))
        results.append(result)
        if not arguments.json:
            target = result["target"]
            print(f"{case}: {target['metric']} {'>=' if target['direction'] == 'higher' else '<='} {target['value']} "
                  f"reached at {result['time_to_target']} of {result['budget']:g} updates (first stage "
                  f"{result['first_stage']}; recorded {result['recorded']}): "
                  f"{'holds' if result['holds'] else 'DOES NOT HOLD'}"
                  f"{'' if result['as_recorded'] else ', not as recorded'}", flush=True)
            print("  " + ", ".join(f"{update}: {value:.4g}" for update, value in result["stages"]), flush=True)
    if arguments.json:
        print(json.dumps(results, indent=2))
    return 0 if all(result["holds"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
