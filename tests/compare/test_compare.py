"""``opalctl compare LOCK`` on real runs: two arms by two seeds of the digits task on the updates clock.

The figures are checked against what this test reads itself from the run folders (each run's ``selected.json``
and ``report.json``), not against the aggregation code.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

SEEDS = [1, 2]
ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},
        "high": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}},
        "twin": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},  # the baseline's twin: it ties on every seed
        "idle": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}}  # never run
POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
          "improve_any": ["selection.correct"]}
METRICS = ["selection.correct", "retention.correct"]


def _template(request, tmp_path_factory) -> Path:
    try:
        shared = Path(request.getfixturevalue("digits_init_folder"))
        if all((shared / "parents" / "digits" / f"seed-{s}.pt").is_file() for s in SEEDS):
            return shared
    except pytest.FixtureLookupError:
        pass
    from opalctl.tasks.builtin import init

    folder = tmp_path_factory.mktemp("compare-digits") / "project"
    init("digits", folder, seeds=SEEDS)
    return folder


@pytest.fixture(scope="module")
def grid(request, tmp_path_factory):
    """A frozen protocol with three arms; two of them run on both seeds. Read-only for the tests."""
    from opalctl.driver.run import run
    from opalctl.protocol.freeze import freeze

    root = tmp_path_factory.mktemp("compare")
    project = root / "project"
    shutil.copytree(_template(request, tmp_path_factory), project)
    protocol = yaml.safe_load((project / "digits.yaml").read_text())
    protocol.update(budget={"clock": "updates", "amount": 60, "threads": 1}, arms=ARMS, selection=POLICY)
    (project / "digits.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False))
    lock = Path(freeze(project / "digits.yaml", force=True)["lock"])
    runs = root / "runs"
    for arm in ("adamw", "high", "twin"):
        for seed in SEEDS:
            run(lock, arm, seed, runs_dir=runs)
    base = runs / f"digits-{hashlib.sha256(lock.read_bytes()).hexdigest()[:12]}"
    return {"lock": lock, "runs": runs, "base": base, "root": root}


@pytest.fixture
def opalctl(capsys):
    """``opalctl(*args)`` -> (exit code, stdout, stderr), through ``opalctl.cli.main`` in this process."""
    from opalctl.cli import main

    def call(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return exit_info.value.code or 0, captured.out, captured.err

    return call


def read(path):
    return json.loads(Path(path).read_text())


def selected_metric(run_dir: Path, metric: str):
    return read(run_dir / "selected.json")["metrics"][metric]


def copy_runs(grid, tmp_path) -> Path:
    target = tmp_path / "runs"
    shutil.copytree(grid["runs"], target)
    return target


def test_compare_json_agrees_with_the_run_folders(grid, opalctl):
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["baseline"] == "adamw" and result["clock"] == "updates"
    assert result["metrics"] == {"selection.correct": "higher", "retention.correct": "higher",
                                 "development.correct": "higher", "development.loss": "lower",
                                 "retention.loss": "lower", "selection.loss": "lower", "train.loss": "lower"}
    assert result["lock_sha256"] == hashlib.sha256(grid["lock"].read_bytes()).hexdigest()
    rows = {row["arm"]: row for row in result["arms"]}
    assert list(rows) == ["adamw", "high", "twin"], "an arm without runs is left out"

    values = {arm: {seed: {m: selected_metric(grid["base"] / arm / f"seed-{seed}", m) for m in METRICS}
                    for seed in SEEDS} for arm in rows}
    for arm, row in rows.items():
        reports = {seed: read(grid["base"] / arm / f"seed-{seed}" / "report.json") for seed in SEEDS}
        assert row["seeds"] == SEEDS and row["unfinished_seeds"] == []
        assert row["baseline"] is (arm == "adamw")
        assert row["updates"] == {"mean": 60.0, "std": 0.0, "min": 60.0, "max": 60.0, "n": 2}
        promoted = [len(reports[s]["promoted_stages"]) for s in SEEDS]
        assert row["promoted_stages"]["mean"] == statistics.mean(promoted)
        assert row["selected_anchor"] == sum(reports[s]["selected"]["source"] == "anchor" for s in SEEDS)
        for metric in METRICS:
            per_seed = [values[arm][s][metric] for s in SEEDS]
            figure = row["metrics"][metric]
            assert figure["n"] == 2 and figure["mean"] == pytest.approx(statistics.mean(per_seed))
            assert figure["std"] == pytest.approx(statistics.stdev(per_seed))
            assert (figure["min"], figure["max"]) == (min(per_seed), max(per_seed))

    assert rows["adamw"]["paired"] == {}
    for metric in METRICS:
        pair = rows["high"]["paired"][metric]
        differences = [values["high"][s][metric] - values["adamw"][s][metric] for s in SEEDS]
        assert pair["seeds"] == SEEDS and pair["n"] == 2 and pair["differences"] == differences
        assert pair["mean_difference"] == pytest.approx(statistics.mean(differences))
        assert (pair["wins"], pair["ties"], pair["losses"]) == (sum(d > 0 for d in differences),
                                                                sum(d == 0 for d in differences),
                                                                sum(d < 0 for d in differences))
        assert min(differences) <= pair["ci_low"] <= pair["ci_high"] <= max(differences)
    # the high learning rate learns the new digits much faster: it wins on selection.correct on both seeds
    assert rows["high"]["paired"]["selection.correct"]["wins"] == 2
    # an arm identical to the baseline ties exactly, seed by seed
    for metric in METRICS:
        pair = rows["twin"]["paired"][metric]
        assert pair["differences"] == [0.0, 0.0] and (pair["wins"], pair["ties"], pair["losses"]) == (0, 2, 0)
        assert pair["mean_difference"] == pair["ci_low"] == pair["ci_high"] == 0.0


def test_compare_with_another_baseline_pairs_against_it(grid, opalctl):
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"], "--json", "--baseline", "high")
    assert code == 0, err
    result = json.loads(out)
    rows = {row["arm"]: row for row in result["arms"]}
    assert result["baseline"] == "high" and rows["high"]["paired"] == {} and rows["high"]["baseline"]
    code, out, _ = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    reverse = {row["arm"]: row for row in json.loads(out)["arms"]}["high"]["paired"]
    for metric in METRICS:
        pair = rows["adamw"]["paired"][metric]
        assert pair["differences"] == [-d for d in reverse[metric]["differences"]]
        assert (pair["wins"], pair["ties"], pair["losses"]) == \
            (reverse[metric]["losses"], reverse[metric]["ties"], reverse[metric]["wins"])


def test_compare_prints_a_table(grid, opalctl):
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"])
    assert code == 0, err
    assert "adamw (baseline)" in out and "\nhigh " in out and "paired by seed against adamw" in out
    assert not out.lstrip().startswith("{")


def test_compare_lists_unfinished_seeds(grid, opalctl, tmp_path):
    runs = copy_runs(grid, tmp_path)
    (runs / grid["base"].name / "high" / "seed-2" / "report.json").unlink()
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 0, err
    high = {row["arm"]: row for row in json.loads(out)["arms"]}["high"]
    assert high["seeds"] == [1] and high["unfinished_seeds"] == [2]
    pair = high["paired"]["selection.correct"]
    assert pair["n"] == 1 and pair["unpaired"] == {"baseline": [2], "arm": []}


def test_compare_refuses_a_report_of_another_lock(grid, opalctl, tmp_path):
    runs = copy_runs(grid, tmp_path)
    report_path = runs / grid["base"].name / "high" / "seed-1" / "report.json"
    report = read(report_path)
    report["lock_sha256"] = "f" * 64
    report_path.write_text(json.dumps(report))
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(report_path.parent) in lines[0] and "ffffffffffff" in lines[0]


@pytest.mark.parametrize("baseline, words", [("nope", "is not an arm"), ("idle", "has no finished runs")])
def test_compare_refuses_a_baseline_it_cannot_use(grid, opalctl, baseline, words):
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"], "--baseline", baseline)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err and repr(baseline) in err


def test_compare_without_finished_runs_is_refused(grid, opalctl, tmp_path):
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", tmp_path / "empty")
    assert code == 2 and out == "" and "there are no runs" in err and len(err.strip().splitlines()) == 1
    runs = copy_runs(grid, tmp_path)
    for report in (runs / grid["base"].name).glob("*/seed-*/report.json"):
        report.unlink()
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", runs)
    assert code == 2 and out == "" and "no finished runs" in err


def test_compare_reads_a_report_that_holds_only_what_compare_needs(grid, opalctl, tmp_path):
    from opalctl.compare.aggregate import REPORT_KEYS

    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    assert code == 0, err
    runs = copy_runs(grid, tmp_path)
    for path in (runs / grid["base"].name).glob("*/seed-*/report.json"):
        report = read(path)
        old = {key: report[key] for key in REPORT_KEYS}  # a report of an older opalctl: a subset, no format
        old["stages"] = [{k: s[k] for k in ("stage", "metrics", "train_cpu_seconds", "train_wall_seconds")}
                         for s in report["stages"]]
        path.write_text(json.dumps(old))
    code, old_out, err = opalctl("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 0, err
    assert {**json.loads(old_out), "runs": None} == {**json.loads(out), "runs": None}


def test_compare_refuses_a_report_that_lacks_what_it_needs_naming_the_file(grid, opalctl, tmp_path):
    runs = copy_runs(grid, tmp_path)
    path = runs / grid["base"].name / "high" / "seed-1" / "report.json"
    report = read(path)
    del report["selected"]
    path.write_text(json.dumps(report))
    code, out, err = opalctl("compare", grid["lock"], "--runs-dir", runs)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{path} lacks selected" in lines[0] and "internal error" not in lines[0]


def test_compare_reads_only_fields_the_formats_define():
    from dataclasses import fields

    from opalctl.compare.aggregate import AGENT_KEYS, REPORT_KEYS
    from opalctl.formats import AgentFigures, RunReport

    assert set(REPORT_KEYS) <= {f.name for f in fields(RunReport)}
    assert set(AGENT_KEYS) <= {f.name for f in fields(AgentFigures)}
