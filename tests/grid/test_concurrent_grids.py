"""Two grids and a plain ``opalctl run`` on the same runs of one lock, each a real process: every run trains once,
and each of them says the truth about every run (``waiting`` while another process holds a run's folder, then
``skipped`` for what another process finished), never ``failed``; ``grid --status`` says ``running`` meanwhile.

The runs are held in the middle of their budget by the gated task (tests/grid/conftest.py) until the test opens
the gate, so the order of events is fixed: the plain run holds adamw, the first grid holds cosine, and the second
grid finds both held.
"""

from __future__ import annotations

import json

from tests.support import grids

SELECTION = ("--arm", "adamw", "--arm", "cosine", "--seed", "1", "--jobs", "2")


def test_two_grids_and_a_run_on_one_lock_train_each_run_once_and_say_so(grid_project, tmp_path):
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    gate.mkdir()
    plain = grid_project.run("adamw", 1, runs=runs, gate=gate)
    first = second = None
    try:
        grids.wait_for(lambda: len(list(gate.glob("waiting-*"))) == 1 or plain.poll() is not None, 180,
                            "the plain run to be held in the middle of its budget")
        first = grids.Lines(grid_project.grid(*SELECTION, runs=runs, gate=gate))
        first.wait(lambda lines: grids.states(lines) == {"adamw": "waiting", "cosine": "running"}, 60,
                   "the first grid to wait for adamw and start cosine")
        grids.wait_for(lambda: len(list(gate.glob("waiting-*"))) == 2, 180, "cosine to be held")
        second = grids.Lines(grid_project.grid(*SELECTION, runs=runs, gate=gate))
        second.wait(lambda lines: grids.states(lines) == {"adamw": "waiting", "cosine": "waiting"}, 60,
                    "the second grid to wait for both runs")
        status = grid_project.status(*SELECTION[:-2], runs=runs)
        assert {r["arm"]: r["state"] for r in status["runs"]} == {"adamw": "running", "cosine": "running"}
        assert all(r["fraction"] and 0 < r["fraction"] < 1 for r in status["runs"]), status
        (gate / "open").write_text("")
        assert plain.wait(timeout=240) == 0, plain.stdout.read()
        code_first, lines_first, err_first = first.finish(240)
        code_second, lines_second, err_second = second.finish(240)
    finally:
        for process in (plain, first and first.process, second and second.process):
            if process is not None:
                grids.stop(process)
    assert code_first == 0, err_first
    assert code_second == 0, err_second
    assert {r["arm"]: r["state"] for r in lines_first[-1]["runs"]} == {"adamw": "skipped", "cosine": "finished"}
    assert {r["arm"]: r["state"] for r in lines_second[-1]["runs"]} == {"adamw": "skipped", "cosine": "skipped"}
    assert "failed" not in err_first + err_second
    for arm, started_by_grids in (("adamw", 0), ("cosine", 1)):
        folder = grids.run_folder(grid_project, runs, arm, 1)
        report = json.loads((folder / "report.json").read_text())
        assert report["resumes"] == 0 and report["updates"] == grids.UPDATES, "trained once, whole"
        log = folder / "grid.log"
        starts = log.read_text().count("--- opalctl grid") if log.exists() else 0
        assert starts == started_by_grids, "no grid started a run another process held"
