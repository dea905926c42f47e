"""The shipped suite (``protocols/suite.yaml``) as it makes its tasks, at a tiny budget: the suite's target and its
per-task tuning of the baseline reach each task's lock, an ``illcond`` run of the baseline at the suite's settings is
deterministic (one run in this process, one in a fresh process, the same digests), and ``compare`` reads the
baseline's time-to-target from the run's stage records against the suite's target.

The suite file is the shipped one, its tasks, targets, baseline and per-task arm settings read from it, so editing
it re-checks them here; only the budget is cut (``illcond``: 100 updates, two stages) and ``modular``'s model made
small (nothing of it runs here; its lock carries the suite's tuning of the baseline for that task). That the tuned
baseline reaches each target within the full budget and not at its first stage is a long run's figure:
``bench/suite_targets.py`` re-measures it (``make bench``; docs/suite.md and bench/README.md hold the figures).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.support.cli import call_cli, run_cli
from tests.support.files import REPO

SEED = 1
UPDATES = 100
# modular's model and parent made small: its lock is frozen, never run
TINY_MODULAR = {"modulus": 23, "width": 32, "heads": 4, "parent_updates": 50, "parent_batch": 128}


def shipped() -> dict:
    return yaml.safe_load((REPO / "protocols" / "suite.yaml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def baseline_runs(tmp_path_factory):
    """The shipped suite cut to its baseline, ``illcond`` (at ``UPDATES``) and ``modular`` (small) on one seed,
    frozen, and the baseline's ``illcond`` run made twice: in this process and in a fresh one."""
    from opalctl.driver.run import run

    suite = shipped()
    baseline = suite["baseline"]
    cut = {"name": "shipped", "seeds": [SEED], "baseline": baseline, "arms": {baseline: suite["arms"][baseline]},
           "tasks": {}}
    for task in ("illcond", "modular"):
        spec = dict(suite["tasks"][task])
        tuned = {arm: settings for arm, settings in (spec.pop("arms", None) or {}).items() if arm == baseline}
        if tuned:
            spec["arms"] = tuned
        cut["tasks"][task] = spec
    cut["tasks"]["illcond"]["budget"] = {**cut["tasks"]["illcond"]["budget"], "amount": UPDATES,
                                         "fractions": [0.5, 1.0]}
    cut["tasks"]["modular"]["config"] = {**(cut["tasks"]["modular"].get("config") or {}), **TINY_MODULAR}
    folder = tmp_path_factory.mktemp("shipped")
    path = folder / "shipped.yaml"
    path.write_text(yaml.safe_dump(cut, sort_keys=False), encoding="utf-8")
    frozen = call_cli("suite", "freeze", path, "--json")
    assert frozen.code == 0, frozen.output
    locks = {task: Path(frozen.json()["folder"]) / entry["lock"] for task, entry in frozen.json()["tasks"].items()}
    run(locks["illcond"], baseline, SEED, runs_dir=folder / "runs")
    again = run_cli("run", locks["illcond"], "--arm", baseline, "--seed", SEED, "--runs-dir", folder / "again",
                    "--json", cwd=folder)
    assert again.code == 0, again.output
    return {"suite": suite, "folder": folder, "locks": locks, "runs": folder / "runs", "again": folder / "again"}


def run_folder(runs: Path, arm: str, task: str) -> Path:
    (found,) = runs.glob(f"shipped-{task}-*/{arm}/seed-{SEED}")
    return found


def stages(folder: Path) -> list[dict]:
    return [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("stage-*.json"))]


@pytest.mark.parametrize("task", ["illcond", "modular"])
def test_the_suites_target_and_its_tuning_of_the_baseline_reach_the_tasks_lock(baseline_runs, task):
    from opalctl.protocol.lock import read_lock

    suite = baseline_runs["suite"]
    baseline = suite["baseline"]
    resolved = read_lock(baseline_runs["locks"][task]).resolved
    assert resolved["target"] == suite["tasks"][task]["target"]
    # the baseline's settings on this task: its own where the suite tunes it per task (modular), else the suite's
    tuned = (suite["tasks"][task].get("arms") or {}).get(baseline)
    assert (tuned is not None) == (task == "modular"), "the shipped suite tunes the baseline on modular alone"
    expected = (tuned or suite["arms"][baseline])["optimizer"]
    assert resolved["arms"][baseline]["optimizer"] == {**resolved["arms"][baseline]["optimizer"], **expected}
    assert resolved["budget"]["clock"] == suite["tasks"][task]["budget"]["clock"] == "updates"


def test_an_illcond_run_at_the_suites_settings_is_deterministic(baseline_runs):
    baseline = baseline_runs["suite"]["baseline"]
    first = run_folder(baseline_runs["runs"], baseline, "illcond")
    second = run_folder(baseline_runs["again"], baseline, "illcond")
    one, two = (json.loads((f / "report.json").read_text(encoding="utf-8")) for f in (first, second))
    assert one["updates"] == two["updates"] == UPDATES
    assert one["rows_digest"] == two["rows_digest"]
    assert one["final_model_sha256"] == two["final_model_sha256"]
    assert [s["update"] for s in stages(first)] == [UPDATES // 2, UPDATES]
    assert [(s["metrics"], s["checkpoint"]["model_sha256"]) for s in stages(first)] == \
        [(s["metrics"], s["checkpoint"]["model_sha256"]) for s in stages(second)]


def test_compare_reads_the_baselines_time_to_target_from_its_stages(baseline_runs):
    from opalctl.compare.aggregate import compare

    suite = baseline_runs["suite"]
    baseline = suite["baseline"]
    target = suite["tasks"]["illcond"]["target"]
    result = compare(baseline_runs["locks"]["illcond"], runs_dir=baseline_runs["runs"], baseline=baseline,
                     resamples=100)
    assert result["target"] == {**target, "direction": "lower"}  # a loss-like metric: lower reaches it
    (row,) = [row for row in result["arms"] if row["arm"] == baseline]
    records = stages(run_folder(baseline_runs["runs"], baseline, "illcond"))
    values = [s["metrics"][target["metric"]] for s in records]
    assert all(math.isfinite(value) for value in values)
    reached = [s["update"] for s, value in zip(records, values) if value <= target["value"]]
    assert row["time_to_target"]["seeds"][str(SEED)] == (reached[0] if reached else None)
    assert row["time_to_target"]["reached"] == (1 if reached else 0)
