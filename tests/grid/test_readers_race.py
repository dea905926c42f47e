"""Readers beside writers: ``verify --runs`` during a grid, ``show`` and ``verify`` during a run's close.

The races are made deterministic: a folder just made by a grid is built by hand and its lock held by a helper
process (as ``opalctl run`` holds it), and the close is interleaved with a reader's reads by doing the close's
writes (last.json, selected.json, report.json, then the resume checkpoint removed, in the run's order:
driver/closing.py, driver/run.py) at every point between two of the reader's record reads.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support import grids
from tests.support.cli import call_cli


@pytest.fixture(scope="module")
def finished_copy(grid_project):
    """A finished run of adamw on seed 1 (the module's reference run): its lock's runs folder and its run folder."""
    grid_project.reference("adamw", 1)
    base = next((grid_project.folder.parent / "reference").iterdir())
    return base, base / "adamw" / "seed-1"


def test_verify_runs_during_a_grid_calls_a_folder_just_made_running_not_an_error(grid_project, finished_copy, tmp_path):
    runs = tmp_path / "runs"
    base, _ = finished_copy
    shutil.copytree(base, runs / base.name)
    just_made = grids.run_folder(grid_project, runs, "cosine", 1)
    just_made.mkdir(parents=True)
    (just_made / "grid.log").write_text("--- opalctl grid: opalctl run ...\n")  # what the grid makes first
    with grids.HeldFolder(just_made):  # its `opalctl run`, before its first record
        held = call_cli("verify", str(grid_project.lock), "--runs", "--runs-dir", str(runs))
        shown = call_cli("show", str(just_made))
    assert shown.code == 1 and shown.stderr.count("\n") == 1, shown.stderr
    assert f"{just_made} is a run that has not started yet (a process holds its folder" in shown.stderr
    assert held.code == 0, held.stderr
    assert "ok: 1 run folder(s)" in held.stdout
    assert f"note: {just_made}: running, not yet started" in held.stderr and "not a run folder" not in held.stderr
    refused = call_cli("verify", str(grid_project.lock), "--runs", "--runs-dir", str(runs), "--json")
    assert refused.code == 0, refused.stderr
    import json

    result = json.loads(refused.stdout)
    assert result["not_started"] == [{"run_dir": str(just_made), "state": "not started"}]


def closing_steps(run_dir):
    """The close of the run in ``run_dir`` undone (its records taken away, its resume checkpoint back), and the
    writes that redo it, in the run's order."""
    saved = {name: (run_dir / name).read_bytes() for name in ("last.json", "selected.json", "report.json")}
    for name in saved:
        (run_dir / name).unlink()
    resume = run_dir / "training" / "resume.pt"
    shutil.copyfile(run_dir / "training" / "stage-02.pt", resume)

    def write(name):
        return lambda: (run_dir / name).write_bytes(saved[name])

    return [write("last.json"), write("selected.json"), write("report.json"), lambda: resume.unlink()]


def read_during_close(monkeypatch, run_dir, reader, at: int, stepwise: bool):
    """``reader(run_dir)`` while the close runs: every remaining write done before the reader's ``at``-th record
    read (or one write before each read from there on, ``stepwise``)."""
    from opalctl.verify import folder as verify

    steps = closing_steps(run_dir)
    real, reads = verify._record, [0]

    def record(*args, **kwargs):
        if reads[0] >= at:
            while steps:
                steps.pop(0)()
                if stepwise:
                    break
        reads[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "_record", record)
    try:
        return reader(run_dir), reads[0]
    finally:
        monkeypatch.setattr(verify, "_record", real)


@pytest.mark.parametrize("stepwise", [False, True], ids=["close-at-once", "close-step-by-step"])
def test_show_and_verify_during_the_close_see_a_run_unfinished_or_finished_never_damaged(finished_copy, tmp_path,
                                                                                          monkeypatch, stepwise):
    from opalctl.driver.show import show
    from opalctl.verify.command import verify_run

    base, run = finished_copy
    at, seen = 0, set()
    while True:
        copy = tmp_path / f"{at}" / base.name
        shutil.copytree(base, copy)
        folder = copy / "adamw" / "seed-1"
        shown, reads = read_during_close(monkeypatch, folder, show, at, stepwise)
        seen.add(shown["status"])
        shutil.rmtree(copy)
        shutil.copytree(base, copy)
        verified, _ = read_during_close(monkeypatch, folder, verify_run, at, stepwise)
        assert verified["ok"], verified["findings"]
        if at > reads:
            break
        at += 1
    # at once, the close lands before the reads (finished) and after them (unfinished); step by step (which reads
    # consistently on main already), whatever it lands between, the run is one of the two, never damaged
    assert seen == {"unfinished", "finished"} if not stepwise else seen <= {"unfinished", "finished"}
