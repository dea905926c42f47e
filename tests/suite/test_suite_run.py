"""``opalctl suite`` end to end on a tiny suite (digits and a small pylm, two arms, two seeds, the ``updates`` clock):
frozen, run through the grids, run again (every run skipped), summarised, its page written; every time-to-target
checked against the evaluator's stage records and the lock, the scores against the profiles of the medians, and
``compare`` and ``report`` of a task showing the time-to-target."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from opalctl.compare.profiles import profiles
from tests.support.cli import call_cli, run_cli
from tests.support.files import sha256_of

SUITE = {
    "name": "tiny", "seeds": [1, 2], "baseline": "adamw",
    "arms": {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-2, "weight_decay": 0.01}},
             "slow": {"optimizer": {"name": "AdamW", "lr": 1.0e-4, "weight_decay": 0.01}}},
    "tasks": {
        "digits": {"builtin": "digits", "budget": {"clock": "updates", "amount": 40},
                   "target": {"metric": "selection.loss", "value": 1.0}},
        "pylm": {"builtin": "pylm", "budget": {"clock": "updates", "amount": 24},
                 "config": {"layers": 1, "width": 16, "heads": 2, "context": 16, "parent_updates": 20,
                            "eval_windows": 8, "train_bytes": 20000},
                 "overrides": {"training": {"batch_size": 8}},
                 "target": {"metric": "selection.bits_per_byte", "value": 6.84}},
    },
}


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("suite")
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(SUITE, sort_keys=False), encoding="utf-8")
    runs = folder / "runs"
    # the grids' run in a child, as a user types it; the rest in this process (no child is what they are about)
    frozen = call_cli("suite", "freeze", path, "--json")
    assert frozen.code == 0, frozen.output
    ran = run_cli("suite", "run", path, "--jobs", "2", "--runs-dir", runs, "--json", cwd=folder, timeout=1200)
    assert ran.code == 0, ran.output
    again = call_cli("suite", "run", path, "--runs-dir", runs, "--json")
    assert again.code == 0, again.output
    summary = call_cli("suite", "summary", path, "--runs-dir", runs, "--json", "--html", folder / "page")
    assert summary.code == 0, summary.output
    return {"folder": folder, "runs": runs, "frozen": frozen.json(), "ran": json.loads(ran.stdout.splitlines()[-1]),
            "again": json.loads(again.stdout.splitlines()[-1]), "summary": summary.json()}


def test_the_suite_lock_names_each_task_lock_by_digest(suite_run):
    frozen = suite_run["frozen"]
    lock = json.loads(Path(frozen["suite_lock"]).read_text())
    assert sha256_of(Path(frozen["suite_lock"])) == frozen["sha256"]
    for task in ("digits", "pylm"):
        task_lock = Path(frozen["suite_lock"]).parent / lock["tasks"][task]["lock"]
        assert sha256_of(task_lock) == lock["tasks"][task]["sha256"]
        resolved = json.loads(task_lock.read_text())["protocol"]
        assert resolved["name"] == f"tiny-{task}" and resolved["budget"]["clock"] == "updates"
        assert resolved["target"]["metric"] == SUITE["tasks"][task]["target"]["metric"]
        assert list(resolved["arms"]) == ["adamw", "slow"]
        assert call_cli("verify", task_lock).code == 0


def test_every_run_finished_and_a_second_run_skips_them(suite_run):
    for grid in suite_run["ran"]["tasks"].values():
        assert [run["state"] for run in grid["runs"]] == ["finished"] * 4
    for grid in suite_run["again"]["tasks"].values():
        assert [run["state"] for run in grid["runs"]] == ["skipped"] * 4


def expected_time(report: dict, target: dict, higher: bool, amount: float) -> float:
    for stage in report["stages"]:
        value = stage["metrics"].get(target["metric"])
        if value is not None and (value >= target["value"] if higher else value <= target["value"]):
            return stage["fraction"] * amount
    return math.inf


def test_times_are_the_stage_records_and_the_scores_the_profiles_of_their_medians(suite_run):
    summary = suite_run["summary"]
    medians = {}
    for task, entry in summary["tasks"].items():
        target = SUITE["tasks"][task]["target"]
        amount = SUITE["tasks"][task]["budget"]["amount"]
        medians[task] = {}
        for row in entry["compare"]["arms"]:
            times = []
            for seed in (1, 2):
                report = json.loads((Path(entry["compare"]["runs"]) / row["arm"] / f"seed-{seed}" /
                                     "report.json").read_text())
                time = expected_time(report, target, False, amount)
                times.append(time)
                assert row["time_to_target"]["seeds"][str(seed)] == (None if math.isinf(time) else time)
            median = math.inf if math.isinf(max(times)) else sum(times) / 2  # of two seeds, not reached counts inf
            medians[task][row["arm"]] = median
            assert entry["times"][row["arm"]] == (None if math.isinf(median) else median)
        # the tuned baseline reaches its target on every seed
        assert entry["compare"]["arms"][0]["arm"] == "adamw"
        assert entry["compare"]["arms"][0]["time_to_target"]["reached"] == 2
    expected = profiles(medians)
    for arm in ("adamw", "slow"):
        assert summary["scores"][arm] == pytest.approx(expected["arms"][arm]["score"])
        assert summary["profiles"]["arms"][arm]["steps"] == expected["arms"][arm]["steps"]
    assert summary["scores"]["adamw"] > summary["scores"]["slow"]
    assert set(summary["seed_scores"]["adamw"]) == {"1", "2"}
    assert any("cannot say more" in sentence for sentence in summary["statement"])


def test_compare_of_a_task_shows_time_to_target_with_the_paired_figures(suite_run):
    lock = suite_run["summary"]["tasks"]["digits"]["lock"]
    shown = call_cli("compare", lock, "--runs-dir", suite_run["runs"])
    assert shown.code == 0, shown.output
    assert "time to target selection.loss <= 1" in shown.stdout
    as_json = call_cli("compare", lock, "--runs-dir", suite_run["runs"], "--json").json()
    assert as_json["target"] == {"metric": "selection.loss", "value": 1.0, "direction": "lower"}
    slow = next(row for row in as_json["arms"] if row["arm"] == "slow")
    pair = slow["time_to_target"]["paired"]
    assert sum(pair["all_seeds"][key] for key in ("wins", "ties", "losses")) == 2
    assert pair["n"] + len(pair["left_out"]) == 2
    table = call_cli("compare", lock, "--runs-dir", suite_run["runs"], "--csv")
    rows = list(csv.DictReader(io.StringIO(table.stdout)))
    adamw = [row for row in rows if row["arm"] == "adamw"]
    expected = as_json["arms"][0]["time_to_target"]
    assert {row["time_to_target_median"] for row in adamw} == {repr(expected["median"])}
    assert {row["target"] for row in rows} == {"selection.loss <= 1.0"}


def test_the_pages_show_the_profiles_and_every_task(suite_run):
    page = Path(suite_run["summary"]["page"]).read_text()
    assert 'data-figure="profiles"' in page and "<svg" in page
    for task in ("digits", "pylm"):
        assert f'id="task-{task}"' in page
    for arm, score in suite_run["summary"]["scores"].items():
        assert re.search(rf'data-arm="{arm}" data-field="score" data-value="{re.escape(repr(score))}"', page)
    assert "default-src 'none'" in page
    lock = suite_run["summary"]["tasks"]["pylm"]["lock"]
    report = call_cli("report", lock, "--runs-dir", suite_run["runs"], "--out", suite_run["folder"] / "pylm-page")
    assert report.code == 0, report.output
    assert "Time to target: selection.bits_per_byte" in (suite_run["folder"] / "pylm-page" / "report.html").read_text()
    written = call_cli("suite", "report", suite_run["frozen"]["suite_lock"], "--runs-dir", suite_run["runs"], "--json")
    assert written.code == 0 and Path(written.json()["page"]).is_file()
