"""``opalctl show RUN_DIR``: one run read back from its records (stages, promotions and their reasons)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests import support
from tests.support.cli import call_cli

POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
          "nondecreasing": ["selection.correct"], "improve_any": ["selection.correct"]}


@pytest.fixture(scope="module")
def finished(made_project):
    """One finished run for the module's tests, read-only (a test that changes it copies the folder first)."""
    project = made_project("show-finished")
    project.freeze(budget={"clock": "updates", "amount": 60}, arms={"adamw": support.ADAMW}, selection=POLICY)
    project.run("adamw", 1)
    run_dir = project.run_dir("adamw", 1)
    stages = support.stage_files(run_dir)
    assert any(s["promoted"] for s in stages) and not all(s["promoted"] for s in stages)
    assert max(len(s["decision"]["reasons"]) for s in stages) >= 2, "a stage refused for more than one reason"
    return run_dir, stages


def test_show_lists_every_stage_with_its_decision(finished):
    from opalctl.compare.labels import short_labels

    run_dir, stages = finished
    code, out, err = call_cli("show", run_dir)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "adamw seed 1 (finished)"
    header = lines[1].split()
    assert header[:3] == ["stage", "frac", "update"] and header[-2:] == ["promoted", "refused"]
    rows = lines[2:2 + len(stages)]
    labels = short_labels(sorted(m for m in stages[0]["metrics"] if not m.endswith(".total")))
    assert header[3:-2] == list(labels.values())
    assert "sel.corr = selection.correct" in out and "ret.corr = retention.correct" in out
    for row, stage in zip(rows, stages, strict=True):
        cells = row.split()
        assert cells[:3] == [str(stage["stage"]), f"{stage['fraction']:g}", str(stage["update"])]
        assert [float(c) for c in cells[3:3 + len(labels)]] == \
            [pytest.approx(stage["metrics"][m], rel=1e-3) for m in labels]
        assert cells[3 + len(labels)] == ("yes" if stage["promoted"] else "no")
        failed = list(dict.fromkeys(c["rule"] for c in stage["decision"]["checks"] if not c["passed"]))
        assert " ".join(cells[4 + len(labels):]) == (", ".join(failed) or "-")
    selected = max(s["stage"] for s in stages if s["promoted"])
    assert lines[-1] == f"selected: stage {selected}", "selected is data: on stdout, so `show RUN > file` keeps it"
    assert "selected" not in err and "--reasons" in err


def test_show_prints_every_reason_in_full_with_reasons(finished):
    run_dir, stages = finished
    code, out, err = call_cli("show", run_dir, "--reasons")
    assert code == 0, err
    lines = out.splitlines()
    for stage in stages:
        for reason in stage["decision"]["reasons"]:
            assert f"stage {stage['stage']}: {reason}" in lines
    assert "--reasons" not in err


def test_show_json_matches_the_records(finished):
    run_dir, stages = finished
    code, out, err = call_cli("show", run_dir, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "finished" and shown["arm"] == "adamw" and shown["seed"] == 1
    assert [(s["stage"], s["update"], s["promoted"], s["reasons"], s["metrics"]) for s in shown["stages"]] == \
        [(s["stage"], s["update"], s["promoted"], s["decision"]["reasons"], s["metrics"]) for s in stages]
    assert shown["selected"] == support.read(run_dir / "selected.json")
    assert shown["report"] == support.read(run_dir / "report.json")
    assert not shown.get("decisions"), "an arm without an agent has no agent decisions"


def test_show_an_unfinished_run(finished, tmp_path):
    run_dir, stages = finished
    copy = tmp_path / "copy" / "adamw" / "seed-1"
    shutil.copytree(run_dir, copy)
    for name in ("report.json", "selected.json", "last.json", "stage-03.json", "stage-04.json"):
        (copy / name).unlink()
    code, out, err = call_cli("show", copy, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "unfinished" and shown["selected"] is None and shown["report"] is None
    assert [s["stage"] for s in shown["stages"]] == [1, 2]
    code, out, _ = call_cli("show", copy)
    assert code == 0 and "(unfinished)" in out


def test_show_refuses_a_folder_that_is_not_a_run(project, tmp_path):
    for folder in (project.folder, tmp_path / "absent"):
        code, out, err = call_cli("show", folder)
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "is not a run folder" in lines[0] and str(folder) in lines[0]


def _events(path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")


REQUESTED = '{"kind": "requested", "decision": 1, "update": 10, "reason": "scheduled"}\n'
APPLIED = ('{"kind": "applied", "decision": 1, "update": 10, "version": 2, "rationale": "r", "seconds": 1.5, '
           '"files": ["updater.py"], "diff": {"updater.py": {"added": 3, "removed": 1}}}\n')


def test_show_reads_agent_decisions_and_skips_a_last_line_cut_short(tmp_path):
    from opalctl.driver.show import agent_decisions

    path = tmp_path / "opal" / "events.jsonl"
    # the torn last line here is valid JSON but not an object: the old reader crashed on it
    for torn in ('{"kind": "requested", "decis', "3"):
        _events(path, [REQUESTED, APPLIED, '{"kind": "reverted", "version": 2, "update": 30, "message": "m"}\n',
                       torn])
        [decision] = agent_decisions(path)
        assert decision["outcome"] == "applied" and decision["answered_at"] == 10 and decision["seconds"] == 1.5
        assert decision["reverted_at"] == 30 and decision["revert_reason"] == "m"


def test_show_refuses_an_events_file_damaged_in_the_middle_naming_file_and_line(tmp_path):
    from opalctl.driver.show import agent_decisions
    from opalctl.formats import RecordDamaged

    path = tmp_path / "opal" / "events.jsonl"
    _events(path, [REQUESTED, "not json at all\n", APPLIED])
    with pytest.raises(RecordDamaged, match="line 2 is not JSON") as caught:
        agent_decisions(path)
    assert str(path) in caught.value.message


def test_show_refuses_a_stage_file_that_lacks_a_field_naming_it(finished, tmp_path):
    run_dir, _stages = finished
    copy = tmp_path / "copy" / "adamw" / "seed-1"
    shutil.copytree(run_dir, copy)
    stage = json.loads((copy / "stage-02.json").read_text())
    del stage["decision"]
    (copy / "stage-02.json").write_text(json.dumps(stage))
    code, out, err = call_cli("show", copy)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "stage-02.json lacks decision" in lines[0] and "internal error" not in lines[0]


@pytest.fixture
def agent_run(finished_runs):
    """The session's finished heuristic agent run (read only: ``show`` without ``--html`` writes nothing)."""
    return finished_runs["base"] / "agent" / "seed-1"


def test_show_prints_the_rationale_whole_when_piped_and_cut_to_fit_on_a_terminal(agent_run, monkeypatch):
    import io

    from rich.console import Console

    from opalctl import console

    code, out, err = call_cli("show", agent_run, "--json")
    texts = [d.get("summary") or d.get("rationale") for d in json.loads(out)["decisions"]]
    assert max(len(t) for t in texts) > 100, "the heuristic's summaries are long enough to be cut"
    code, out, err = call_cli("show", agent_run)
    assert code == 0, err
    for text in texts:
        assert any(line.rstrip().endswith(text) for line in out.splitlines()), "piped: whole"
    screen = io.StringIO()
    monkeypatch.setattr(console, "rich_enabled", lambda stream=None, json_mode=False: not json_mode)
    monkeypatch.setattr(console, "_stdout_console",
                        lambda: Console(file=screen, force_terminal=True, color_system=None, width=100))
    code, out, err = call_cli("show", agent_run)
    shown = screen.getvalue() + out
    assert code == 0 and max(len(line) for line in shown.splitlines()) <= 100
    assert "selection.correct" in " ".join(shown.split()) and "pipe" not in out
    assert "the rationale is printed whole" in err
