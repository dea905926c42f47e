"""``opalctl compare LOCK`` on real runs: five arms by two seeds of the digits task on the updates clock.

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

from tests.support.cli import call_cli

SEEDS = [1, 2]
METRICS = ["selection.correct", "retention.correct"]


@pytest.fixture(scope="module")
def grid(finished_runs):
    """The session's finished runs (tests/conftest.py): among its arms ``twin``, the baseline's twin, ties on every
    seed, ``still`` learns nothing and keeps the anchor on every seed, ``idle`` never ran. Read-only."""
    return finished_runs


def read(path):
    return json.loads(Path(path).read_text())


def selected_metric(run_dir: Path, metric: str):
    return read(run_dir / "selected.json")["metrics"][metric]


def unfinish(run_dir: Path) -> None:
    """Make a finished run look unfinished: none of its closing records (one that lost only report.json is
    damaged, and refused)."""
    for name in ("report.json", "last.json", "selected.json"):
        (run_dir / name).unlink()


def copy_runs(grid, tmp_path) -> Path:
    target = tmp_path / "runs"
    shutil.copytree(grid["runs"], target)
    return target


def test_compare_json_agrees_with_the_run_folders(grid):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["baseline"] == "adamw" and result["clock"] == "updates"
    assert result["metrics"] == {"selection.correct": "higher", "retention.correct": "higher",
                                 "development.correct": "higher", "development.loss": "lower",
                                 "retention.loss": "lower", "selection.loss": "lower", "train.loss": "lower"}
    assert result["lock_sha256"] == hashlib.sha256(grid["lock"].read_bytes()).hexdigest()
    rows = {row["arm"]: row for row in result["arms"]}
    assert list(rows) == ["adamw", "agent", "high", "still", "twin"], \
        "the lock's order; an arm without runs is left out"

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


def test_compare_with_another_baseline_pairs_against_it(grid):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--json", "--baseline", "high")
    assert code == 0, err
    result = json.loads(out)
    rows = {row["arm"]: row for row in result["arms"]}
    assert result["baseline"] == "high" and rows["high"]["paired"] == {} and rows["high"]["baseline"]
    code, out, _ = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    reverse = {row["arm"]: row for row in json.loads(out)["arms"]}["high"]["paired"]
    for metric in METRICS:
        pair = rows["adamw"]["paired"][metric]
        assert pair["differences"] == [-d for d in reverse[metric]["differences"]]
        assert (pair["wins"], pair["ties"], pair["losses"]) == \
            (reverse[metric]["losses"], reverse[metric]["ties"], reverse[metric]["wins"])


def test_compare_prints_a_table(grid):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"])
    assert code == 0, err
    assert "adamw (baseline)" in out and "\nhigh " in out and "paired by seed against adamw" in out
    assert not out.lstrip().startswith("{")


def test_compare_lists_unfinished_seeds(grid, tmp_path):
    runs = copy_runs(grid, tmp_path)
    unfinish(runs / grid["base"].name / "high" / "seed-2")
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 0, err
    high = {row["arm"]: row for row in json.loads(out)["arms"]}["high"]
    assert high["seeds"] == [1] and high["unfinished_seeds"] == [2]
    pair = high["paired"]["selection.correct"]
    assert pair["n"] == 1 and pair["unpaired"] == {"baseline": [2], "arm": []}


def test_compare_refuses_a_report_of_another_lock(grid, tmp_path):
    runs = copy_runs(grid, tmp_path)
    report_path = runs / grid["base"].name / "high" / "seed-1" / "report.json"
    report = read(report_path)
    report["lock_sha256"] = "f" * 64
    report_path.write_text(json.dumps(report))
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and str(report_path.parent) in lines[0] and "ffffffffffff" in lines[0]


@pytest.mark.parametrize("baseline, words", [("nope", "is not an arm"), ("idle", "has no finished runs")])
def test_compare_refuses_a_baseline_it_cannot_use(grid, baseline, words):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--baseline", baseline)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err and repr(baseline) in err


def test_compare_without_finished_runs_is_refused(grid, tmp_path):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", tmp_path / "empty")
    assert code == 2 and out == "" and "there are no runs" in err and len(err.strip().splitlines()) == 1
    runs = copy_runs(grid, tmp_path)
    for report in (runs / grid["base"].name).glob("*/seed-*/report.json"):
        unfinish(report.parent)
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs)
    assert code == 2 and out == "" and "no finished runs" in err


def test_compare_reads_a_report_that_holds_only_what_compare_needs(grid, tmp_path):
    from opalctl.compare.aggregate import REPORT_KEYS

    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--json")
    assert code == 0, err
    runs = copy_runs(grid, tmp_path)
    for path in (runs / grid["base"].name).glob("*/seed-*/report.json"):
        report = read(path)
        old = {key: report[key] for key in REPORT_KEYS}  # a report of an older opalctl: a subset, no format
        if report.get("agent"):
            old["agent"] = report["agent"]  # an agent arm's figures, which compare summarises where there are any
        old["stages"] = [{k: s[k] for k in ("stage", "metrics", "train_cpu_seconds", "train_wall_seconds")}
                         for s in report["stages"]]
        path.write_text(json.dumps(old))
    code, old_out, err = call_cli("compare", grid["lock"], "--runs-dir", runs, "--json")
    assert code == 0, err
    old_result, new_result = json.loads(old_out), json.loads(out)
    for old_row, new_row in zip(old_result["arms"], new_result["arms"], strict=True):
        # without the stages' decisions the all-anchor sentence cannot name a rule, and says only the fact
        if new_row["anchor_note"]:
            assert old_row["anchor_note"] == new_row["anchor_note"].split("; the rule")[0] + "."
        old_row["anchor_note"] = new_row["anchor_note"]
        # an older report has no kernel's count of the training process: nothing is said of its work outside
        assert old_row["outside_cpu_seconds"]["n"] == 0 and new_row["outside_cpu_seconds"]["n"] > 0
        old_row["outside_cpu_seconds"] = new_row["outside_cpu_seconds"]
        # nor what confinement its training process had: no note on it
        assert old_row["unconfined_note"] is None
        old_row["unconfined_note"] = new_row["unconfined_note"]
    assert {**old_result, "runs": None} == {**new_result, "runs": None}


def test_compare_refuses_a_report_that_lacks_what_it_needs_naming_the_file(grid, tmp_path):
    runs = copy_runs(grid, tmp_path)
    path = runs / grid["base"].name / "high" / "seed-1" / "report.json"
    report = read(path)
    del report["selected"]
    path.write_text(json.dumps(report))
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{path} lacks selected" in lines[0] and "internal error" not in lines[0]


def test_compare_reads_only_fields_the_formats_define():
    from dataclasses import fields

    from opalctl.compare.aggregate import AGENT_KEYS, REPORT_KEYS
    from opalctl.formats import AgentFigures, RunReport

    assert set(REPORT_KEYS) <= {f.name for f in fields(RunReport)}
    assert set(AGENT_KEYS) <= {f.name for f in fields(AgentFigures)}


# -- the wider compare -----------------------------------------------------------------------------------------

def _json(grid, *more, runs=None):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs or grid["runs"], "--json", *more)
    assert code == 0, err
    return json.loads(out), {row["arm"]: row for row in json.loads(out)["arms"]}


def _final_loss(run_dir: Path) -> float:
    """The mean loss of the last 16 updates, read here from the steps records with gzip and json."""
    import gzip

    with gzip.open(run_dir / "training" / "steps.jsonl.gz", "rt") as handle:
        losses = [json.loads(line)["loss"] for line in handle if line.strip()]
    return statistics.fmean(losses[-16:])


def test_compare_shows_every_metric_the_task_reports_and_the_final_training_loss(grid):
    result, rows = _json(grid)
    reported = [m for m in read(grid["base"] / "adamw" / "seed-1" / "report.json")["anchor_metrics"]
                if not m.endswith(".total")]
    assert set(result["metrics"]) == {*reported, "train.loss"} and "development.loss" in result["metrics"]
    assert result["primary"] == METRICS[0], "the policy's first metric is the primary one"
    for arm, row in rows.items():
        losses = {str(s): _final_loss(grid["base"] / arm / f"seed-{s}") for s in SEEDS}
        assert row["values"]["train.loss"] == pytest.approx(losses)
        assert row["metrics"]["train.loss"]["mean"] == pytest.approx(statistics.mean(losses.values()))
    pair = rows["high"]["paired"]["train.loss"]
    assert pair["differences"] == pytest.approx([_final_loss(grid["base"] / "high" / f"seed-{s}")
                                                 - _final_loss(grid["base"] / "adamw" / f"seed-{s}") for s in SEEDS])


@pytest.mark.parametrize("stage", ["last", "2"])
def test_compare_of_the_last_stage_or_stage_n_reads_that_stage(grid, stage):
    result, rows = _json(grid, "--stage", stage)
    assert result["stage"] == (stage if stage == "last" else int(stage))
    for arm, row in rows.items():
        for seed in SEEDS:
            stages = read(grid["base"] / arm / f"seed-{seed}" / "report.json")["stages"]
            record = stages[-1] if stage == "last" else read(grid["base"] / arm / f"seed-{seed}" / "stage-02.json")
            for metric in ("selection.correct", "development.loss"):
                assert row["values"][metric][str(seed)] == record["metrics"][metric]


def test_compare_refuses_a_stage_no_run_has(grid):
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--stage", "9")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "has no stage 9 (its stages: 1, 2, 3, 4)" in err
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--stage", "best")
    assert code == 2 and "--stage 'best'" in err


def test_metric_chooses_what_is_compared_and_an_unknown_one_is_refused(grid):
    result, rows = _json(grid, "--metric", "train.loss", "--metric", "selection.loss")
    assert result["metrics"] == {"train.loss": "lower", "selection.loss": "lower"}
    assert set(rows["high"]["paired"]) == {"train.loss", "selection.loss"}
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--metric", "selection.acc")
    assert code == 2 and out == "" and "--metric 'selection.acc' is not a metric" in err and "train.loss" in err


def test_csv_has_one_row_per_arm_and_metric_equal_to_the_json(grid):
    import csv
    import io

    result, rows = _json(grid)
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"], "--csv")
    assert code == 0, err
    table = list(csv.DictReader(io.StringIO(out)))
    assert sorted((r["arm"], r["metric"]) for r in table) == sorted((a, m) for a in rows for m in result["metrics"])
    assert [r["metric"] for r in table[:2]] == METRICS, "the policy's metrics first, as in the table"
    for line in table:
        row = rows[line["arm"]]
        assert float(line["mean"]) == row["metrics"][line["metric"]]["mean"]
        assert line["seed_values"] == " ".join(f"{s}:{v!r}" for s, v in row["values"][line["metric"]].items())
        pair = row["paired"].get(line["metric"])
        if pair is None:
            assert line["p_value"] == line["verdict"] == "" and line["arm"] == "adamw"
        else:
            assert float(line["p_value"]) == pair["p_value"] and line["verdict"] == pair["verdict"]
            assert float(line["ci_low"]) == pair["ci_low"] and line["interval_reliable"] == "False"
            for key in ("t_p_value", "t_ci_low", "t_ci_high", "d_z", "t_seeds_needed", "seeds_needed"):
                assert line[key] == ("" if pair[key] is None else str(pair[key])), key


def test_an_arm_that_kept_the_anchor_on_every_seed_gets_one_sentence_naming_the_rule_that_refused_most(grid):
    from collections import Counter

    _, rows = _json(grid)
    refused = Counter()
    stages = 0
    for seed in SEEDS:
        for record in read(grid["base"] / "still" / f"seed-{seed}" / "report.json")["stages"]:
            stages += 1
            refused.update({(c["rule"], c["metric"]) for c in record["decision"]["checks"] if not c["passed"]})
    (rule, metric), times = refused.most_common(1)[0]
    assert rule == "improve_any", "an arm that learns nothing never improves"
    assert rows["still"]["selected_anchor"] == 2
    assert rows["still"]["anchor_note"] == (
        f"still kept the anchor on every seed (2 of 2): no stage qualified, so its selected values are the "
        f"anchor's; the rule that refused most often was {rule} on {metric} ({times} of {stages} stages).")
    assert all(rows[arm]["anchor_note"] is None for arm in rows if rows[arm]["selected_anchor"] < 2)
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"])
    assert "anchor: " + rows["still"]["anchor_note"] in out.splitlines()


def test_verdicts_on_real_runs_say_tie_and_too_few_seeds(grid):
    _, rows = _json(grid)
    assert rows["twin"]["paired"]["selection.correct"]["verdict"] == \
        "twin vs adamw on selection.correct: identical on both seeds: no difference at all."
    high = rows["high"]["paired"]["selection.correct"]
    assert high["verdict"].startswith(
        f"high vs adamw on selection.correct: {high['mean_difference']:+.4g} (2 of 2 seeds better), exact p = 0.5: "
        f"the exact test cannot decide with 2 seeds (its smallest p is 0.5). ")
    if high["sd_difference"]:  # the t-test's figures, and the seeds each test needs for this effect
        assert f"(paired t p = {high['t_p_value']:.2g}, d_z = {high['d_z']:+.2g}, 95 % t-interval " in high["verdict"]
        assert high["verdict"].endswith(f"the t-test needs about {high['t_seeds_needed']} seeds, the exact test at "
                                        f"least {high['seeds_needed']}.")
        assert high["seeds_needed"] == max(6, high["t_seeds_needed"])
    else:
        assert high["verdict"].endswith("6 seeds that agree as these do would let the exact test decide.")
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"])
    lines = out.splitlines()
    assert "verdict: " + high["verdict"] in lines and "verdict: " + rows["twin"]["paired"]["selection.correct"][
        "verdict"] in lines, "piped, each verdict is one whole line"


def _terminal(monkeypatch, width=100):
    import io

    from rich.console import Console

    from opalctl import console

    screen = io.StringIO()
    monkeypatch.setattr(console, "rich_enabled", lambda stream=None, json_mode=False: not json_mode)
    monkeypatch.setattr(console, "_stdout_console",
                        lambda: Console(file=screen, force_terminal=True, color_system=None, width=width))
    return screen


def test_the_compare_table_stays_legible_at_100_columns(grid, monkeypatch):
    result, rows = _json(grid)
    screen = _terminal(monkeypatch)
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", grid["runs"])
    assert code == 0, err
    shown = screen.getvalue() + out
    lines = shown.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "…" not in shown, "no cell is cut"
    from opalctl.compare.labels import short_labels

    labels = short_labels(list(result["metrics"]))
    assert "dev.corr = development.correct" in " ".join(shown.split())
    for metric, label in labels.items():
        assert any(label in line for line in lines), metric
    verdict = rows["high"]["paired"]["selection.correct"]["verdict"]
    assert len(verdict) > 100 and "verdict: " + verdict in " ".join(shown.split()), "wrapped whole, not cut"
    from opalctl.compare.columns import TABLE, legend

    assert "columns: " + legend() in " ".join(shown.split()), "every column of the paired table defined"
    for column in TABLE:
        assert any(column.header in line for line in lines), column.header


def test_the_n1_and_n0_notes_are_in_the_table(grid, tmp_path):
    runs = copy_runs(grid, tmp_path)
    for arm, seed in (("adamw", 2), ("high", 2), ("twin", 1)):  # adamw {1}, high {1}: n=1; twin {2}: n=0
        unfinish(runs / grid["base"].name / arm / f"seed-{seed}")
    code, out, err = call_cli("compare", grid["lock"], "--runs-dir", runs)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    high = [r for r in rows if r[:2] == ["high", "sel.corr"]][0]
    twin = [r for r in rows if r[:2] == ["twin", "sel.corr"]][0]
    assert high[-1] == "n=1" and twin[-1] == "n=0" and twin[2:-1] == ["-"] * 4
    assert [r for r in rows if r[:2] == ["twin", "sel.corr"]][1][2:] == ["-"] * 4, "the effect sizes' part"
    assert "note: n=1: one seed says nothing about spread, so neither test can say anything" in out
    assert "note: n=0: no seed completed by both arms, so there is nothing to compare" in out
