"""``opalctl show RUN_DIR``: one run read back from its records (stages, promotions and their reasons)."""

from __future__ import annotations

import json
import shutil

import pytest

POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
          "nondecreasing": ["selection.correct"], "improve_any": ["selection.correct"]}


@pytest.fixture
def finished(project, tools):
    project.freeze(budget={"clock": "updates", "amount": 60}, arms={"adamw": tools.ADAMW}, selection=POLICY)
    project.run("adamw", 1)
    run_dir = project.run_dir("adamw", 1)
    stages = tools.stage_files(run_dir)
    assert any(s["promoted"] for s in stages) and not all(s["promoted"] for s in stages)
    assert max(len(s["decision"]["reasons"]) for s in stages) >= 2, "a stage refused for more than one reason"
    return run_dir, stages


def test_show_lists_every_stage_with_its_decision(finished, main_cli):
    run_dir, stages = finished
    code, out, err = main_cli(["show", run_dir])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "adamw seed 1 (finished)"
    header = lines[1].split()
    assert header[:3] == ["stage", "fraction", "update"] and header[-2:] == ["promoted", "reasons"]
    rows = lines[2:]
    assert len(rows) == len(stages)
    for row, stage in zip(rows, stages, strict=True):
        cells = row.split()
        assert cells[:3] == [str(stage["stage"]), f"{stage['fraction']:g}", str(stage["update"])]
        metrics = header[3:-2]
        assert [float(c) for c in cells[3:3 + len(metrics)]] == \
            [pytest.approx(stage["metrics"][m], rel=1e-3) for m in metrics]
        assert "selection.correct" in metrics and "retention.correct" in metrics
        assert cells[3 + len(metrics)] == ("yes" if stage["promoted"] else "no")
        for reason in stage["decision"]["reasons"]:
            assert reason in row
        if stage["promoted"]:
            assert row.rstrip().endswith("-")
    selected = max(s["stage"] for s in stages if s["promoted"])
    assert f"selected: stage {selected}" in err


def test_show_json_matches_the_records(finished, main_cli, tools):
    run_dir, stages = finished
    code, out, err = main_cli(["show", run_dir, "--json"])
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "finished" and shown["arm"] == "adamw" and shown["seed"] == 1
    assert [(s["stage"], s["update"], s["promoted"], s["reasons"], s["metrics"]) for s in shown["stages"]] == \
        [(s["stage"], s["update"], s["promoted"], s["decision"]["reasons"], s["metrics"]) for s in stages]
    assert shown["selected"] == tools.read(run_dir / "selected.json")
    assert shown["report"] == tools.read(run_dir / "report.json")
    assert not shown.get("decisions"), "an arm without an agent has no agent decisions"


def test_show_an_unfinished_run(finished, main_cli, tmp_path):
    run_dir, stages = finished
    copy = tmp_path / "copy" / "adamw" / "seed-1"
    shutil.copytree(run_dir, copy)
    for name in ("report.json", "selected.json", "last.json", "stage-03.json", "stage-04.json"):
        (copy / name).unlink()
    code, out, err = main_cli(["show", copy, "--json"])
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "unfinished" and shown["selected"] is None and shown["report"] is None
    assert [s["stage"] for s in shown["stages"]] == [1, 2]
    code, out, _ = main_cli(["show", copy])
    assert code == 0 and "(unfinished)" in out


def test_show_refuses_a_folder_that_is_not_a_run(project, main_cli, tmp_path):
    for folder in (project.folder, tmp_path / "absent"):
        code, out, err = main_cli(["show", folder])
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "is not a run folder" in lines[0] and str(folder) in lines[0]
