"""The local executor against real ``opalctl run`` children: side by side, resumable, never running a run twice.

The grid is a real ``python -m opalctl grid`` process (its Ctrl-C is a real SIGINT) whose children are real
``opalctl run`` processes; every run is checked against an uninterrupted run of the same arm and seed on the
``updates`` clock (final weights, rows seen, stages, selection). Real runs are costly, so one test walks the
whole story: two arms start side by side while a third fails, Ctrl-C stops them in the middle, and the same
command finishes each of them once.
"""

from __future__ import annotations

import json

from tests.support import grids

ARMS = ("--arm", "adamw", "--arm", "cosine", "--arm", "spare", "--seed", "2", "--jobs", "2")


def run_folder(grid_project, runs, arm, seed):
    from opalctl.layout import LockRuns
    from opalctl.protocol.lock import read_lock

    return LockRuns.of(runs, read_lock(grid_project.lock)).run(arm, seed).root


def test_ctrl_c_stops_every_run_resumably_and_the_same_command_finishes_each_once(grid_project, tmp_path):
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    gate.mkdir()
    broken = run_folder(grid_project, runs, "spare", 2)
    (broken / "training").mkdir(parents=True)
    (broken / "training" / "resume.pt").write_bytes(b"not a checkpoint")  # this run cannot resume: it fails
    grid = grid_project.grid(*ARMS, runs=runs, gate=gate)
    references = {arm: grid_project.reference(arm, 2) for arm in ("adamw", "cosine")}  # while the runs start
    grids.wait_for(lambda: len(list(gate.glob("waiting-*"))) == 2 or grid.poll() is not None, 180,
                        "both runs to be held in the middle of their budget")
    grids.stop(grid)
    stdout, stderr = grid.communicate(timeout=120)
    assert grid.returncode == 130, stderr
    assert "grid stopped (SIGINT)" in stderr and "run the same command again to continue: opalctl grid" in stderr
    lines = grids.events(stdout)
    started = [e["arm"] for e in lines if e["event"] == "run" and e["state"] == "running"]
    assert started == ["adamw", "cosine"], "the arms of one seed start side by side, in the plan's order"
    assert {run["arm"]: run["state"] for run in lines[-1]["runs"]} == \
        {"adamw": "interrupted", "cosine": "interrupted", "spare": "interrupted"}
    for arm in ("adamw", "cosine"):
        folder = run_folder(grid_project, runs, arm, 2)
        assert (folder / "training" / "resume.pt").exists() and not (folder / "report.json").exists()

    (gate / "open").write_text("")
    again = grid_project.grid(*ARMS, runs=runs, gate=gate)
    stdout, stderr = again.communicate(timeout=240)
    assert again.returncode == 1, stderr
    final = grids.events(stdout)[-1]
    assert {run["arm"]: run["state"] for run in final["runs"]} == \
        {"adamw": "resumed", "cosine": "resumed", "spare": "failed"}, "a failed run stops no other"
    assert "failed: spare seed 2 (exit " in stderr and f"its output is in {broken / 'grid.log'}" in stderr
    assert (broken / "grid.log").read_text().count("--- opalctl grid") == 1
    for arm in ("adamw", "cosine"):
        folder = run_folder(grid_project, runs, arm, 2)
        report = json.loads((folder / "report.json").read_text())
        assert grids.same_run(report, references[arm]) == {}
        assert report["resumes"] == 1
        log = (folder / "grid.log").read_text()
        starts = [line for line in log.splitlines() if line.startswith("--- opalctl grid")]
        # the headers the grid writes, not the interrupted run's own "resume with: ... --resume" line
        assert len(starts) == 2 and sum("--resume" in line for line in starts) == 1, "started once, resumed once"
        assert f"opalctl run {arm} seed 2" in log
    assert final["compare"] is not None, final["compare_note"]
    assert [arm["arm"] for arm in final["compare"]["arms"]] == ["adamw", "cosine"]
