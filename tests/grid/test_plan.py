"""The grid's plan, progress and status, on folders made by the test (no run is started here)."""

from __future__ import annotations

import gzip
import json

import pytest

from opalctl.errors import BadInput
from opalctl.grid import run_grid
from opalctl.grid.plan import default_jobs, ordered, plan_grid
from opalctl.grid.progress import RunProgress, StepsTail
from opalctl.grid.status import grid_status
from tests import support
from tests.support import grids


def test_the_arms_of_each_seed_are_next_to_each_other_and_each_arm_starts_a_wave_first_in_turn():
    assert ordered(["a", "b", "c"], [1, 2, 3, 4]) == [
        ("a", 1), ("b", 1), ("c", 1),
        ("b", 2), ("c", 2), ("a", 2),
        ("c", 3), ("a", 3), ("b", 3),
        ("a", 4), ("b", 4), ("c", 4)]


def test_jobs_default_to_the_cores_divided_by_the_threads_of_a_run_and_never_to_zero():
    assert default_jobs(1, cores=2) == 2
    assert default_jobs(2, cores=8) == 4
    assert default_jobs(3, cores=2) == 1


def test_an_arm_or_seed_the_lock_lacks_is_refused_naming_the_lock(grid_project):
    with pytest.raises(BadInput, match=r"arm nope is not in lock .*digits\.lock\.json"):
        plan_grid(grid_project.lock, arms=["nope"])
    with pytest.raises(BadInput, match=r"seed 9 is not in lock"):
        plan_grid(grid_project.lock, seeds=[9])


def test_finished_runs_are_skipped_without_starting_anything_and_interrupted_ones_are_resumed(grid_project,
                                                                                               tmp_path):
    plan = plan_grid(grid_project.lock, seeds=[1], runs_dir=tmp_path / "runs")
    for run in plan.runs:
        (run.run_dir / "training").mkdir(parents=True)
        (run.run_dir / "report.json").write_text("{}")
    before = support.tree(tmp_path / "runs")
    seen = []
    result = run_grid(grid_project.lock, seeds=[1], runs_dir=tmp_path / "runs", display=seen.append)
    assert result.ok and {run["state"] for run in result.runs} == {"skipped"}
    assert [e["state"] for e in seen] == ["skipped"] * len(plan.runs)
    assert support.tree(tmp_path / "runs") == before, "nothing was started, written or run twice"
    (plan.runs[0].run_dir / "report.json").unlink()
    (plan.runs[0].run_dir / "training" / "resume.pt").write_bytes(b"")
    assert plan.runs[0].need() == "resume"
    assert plan.runs[0].command(plan.lock_path, plan.runs_dir, True)[-1] == "--resume"


def test_slurm_settings_with_the_local_executor_are_refused(grid_project, tmp_path):
    from opalctl.grid.settings import load_settings

    with pytest.raises(BadInput, match="with --executor local"):
        run_grid(grid_project.lock, runs_dir=tmp_path, settings=load_settings(partition="cpu"))


def steps_line(update, used):
    return json.dumps({"update": update, "used": used}).encode() + b"\n"


def test_progress_reads_the_last_whole_line_of_a_growing_steps_file(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "training").mkdir(parents=True)
    (run_dir / "start.json").write_text(json.dumps({"budget": {"total": 100}}))
    now = [0.0]
    progress = RunProgress(run_dir, clock=lambda: now[0])
    assert progress.read() == {"fraction": None, "updates": None, "eta_seconds": None}
    steps = run_dir / "training" / "steps.jsonl.gz"
    first = gzip.compress(b"".join(steps_line(u, u) for u in range(1, 11)))
    second = gzip.compress(b"".join(steps_line(u, u) for u in range(11, 31)))
    steps.write_bytes(first + second[: len(second) // 2])  # the second member is still being written
    partly = progress.read()
    assert 10 <= partly["updates"] < 30 and partly["fraction"] == partly["updates"] / 100
    assert partly["eta_seconds"] is None, "no rate is known from one look"
    now[0] = 10.0
    steps.write_bytes(first + second)
    rate = (0.3 - partly["fraction"]) / 10.0
    assert progress.read() == {"fraction": 0.3, "updates": 30, "eta_seconds": pytest.approx(0.7 / rate)}
    steps.write_bytes(first)  # a resume cut the file back to its last checkpoint
    assert progress.read()["updates"] == 10


def test_a_steps_file_that_is_not_gzip_gives_no_figure_rather_than_a_wrong_one(tmp_path):
    path = tmp_path / "steps.jsonl.gz"
    path.write_bytes(b"not gzip at all\n")
    assert StepsTail(path).read() is None


def test_status_tells_finished_running_interrupted_and_unstarted_runs_apart(grid_project, tmp_path):
    plan = plan_grid(grid_project.lock, seeds=[1], runs_dir=tmp_path / "runs")
    finished, running, interrupted = plan.runs
    for run in plan.runs:
        (run.run_dir / "training").mkdir(parents=True)
    (finished.run_dir / "report.json").write_text("{}")
    (interrupted.run_dir / "training" / "resume.pt").write_bytes(b"")
    (running.run_dir / "start.json").write_text(json.dumps({"budget": {"total": 10}}))
    (running.run_dir / "training" / "resume.pt").write_bytes(b"")
    with grids.HeldFolder(running.run_dir):  # the folder's lock, held by a live process as a run holds it
        result = grid_status(grid_project.lock, seeds=[1, 2], runs_dir=tmp_path / "runs")
    states = {(r["arm"], r["seed"]): r["state"] for r in result["runs"]}
    assert states[finished.arm, 1] == "finished" and states[running.arm, 1] == "running"
    assert states[interrupted.arm, 1] == "interrupted"
    assert {states[arm, 2] for arm in plan.arms} == {"not started"}
    assert result["ok"] is False and result["counts"]["not started"] == 3
    again = grid_status(grid_project.lock, seeds=[1], runs_dir=tmp_path / "runs")
    assert {r["arm"]: r["state"] for r in again["runs"]}[running.arm] == "interrupted", "the lock was released"


@pytest.mark.parametrize("files, code, resumed, state", [
    (["report.json"], 143, False, "finished"),  # a SIGTERM that landed after the report: finished all the same
    (["report.json"], 143, True, "resumed"),
    (["report.json"], 2, False, "skipped"),  # refused: another process had finished it
    (["report.json"], None, False, "finished"),  # a Slurm task that ended without a result
    (["start.json", "training/resume.pt"], 143, False, "interrupted"),
    (["start.json", "training/resume.pt"], 1, False, "failed"),
    (["start.json", "training/resume.pt"], 0, False, "failed"),  # no report: never finished, whatever the code
])
def test_a_runs_outcome_is_read_from_its_folder_not_from_the_exit_code_alone(grid_project, tmp_path, files, code,
                                                                               resumed, state):
    run = plan_grid(grid_project.lock, seeds=[1], runs_dir=tmp_path / "runs").runs[0]
    for name in files:
        (run.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run.run_dir / name).write_bytes(b"{}")
    assert run.outcome(code, resumed) == state


def test_runs_only_interrupted_are_not_called_failed_in_the_advice(capsys):
    from opalctl.grid.records import GridResult, RunOutcome
    from opalctl.grid.summary import advise

    result = GridResult(lock="x/digits.lock.json", runs_dir="runs", executor="local", jobs=2,
                        outcomes=[RunOutcome("adamw", 1, "interrupted", "r", 143), RunOutcome("b", 1, "finished", "r")])
    advise(result)
    said = capsys.readouterr().err
    assert "failed" not in said and "fixing the cause" not in said
    assert "1 run(s) interrupted; every stopped run is resumable; run the same command again" in said
    result.outcomes.append(RunOutcome("c", 1, "failed", "r", 1, "r/grid.log"))
    advise(result)
    assert "1 run(s) failed and 1 interrupted; after fixing the cause" in capsys.readouterr().err
