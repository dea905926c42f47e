"""``grid`` on a lock of ``training.ranks: 2``: each run under real torchrun (gloo on CPU), on this machine and as
a Slurm task that asks for both ranks' CPUs. A tiny budget: two ranks on two cores cost twice one."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support import grids

UPDATES = 12


@pytest.fixture(scope="module")
def ranks_project(digits_init_folder, tmp_path_factory):
    project = grids.GridProject(digits_init_folder, tmp_path_factory.mktemp("ranks") / "project",
                                     updates=UPDATES, ranks=2, arms={"adamw": grids.ARMS["adamw"]})
    yield project
    import sys

    if project.task_path in sys.path:
        sys.path.remove(project.task_path)


def finished_under_torchrun(project, runs, stdout: str) -> dict:
    final = grids.events(stdout)[-1]
    assert [(run["arm"], run["state"]) for run in final["runs"]] == [("adamw", "finished")]
    folder = grids.run_folder(project, runs, "adamw", 1)
    report = json.loads((folder / "report.json").read_text())
    assert report["ranks"] == 2 and report["updates"] == UPDATES
    header = next(line for line in (folder / "grid.log").read_text().splitlines() if line.startswith("--- "))
    assert "torchrun --standalone --nproc-per-node 2 -m opalctl run" in header
    return report


def test_a_grid_runs_a_lock_of_two_ranks_under_torchrun(ranks_project, tmp_path):
    runs = tmp_path / "runs"
    grid = ranks_project.grid("--seed", "1", runs=runs)
    stdout, stderr = grid.communicate(timeout=300)
    assert grid.returncode == 0, stderr
    finished_under_torchrun(ranks_project, runs, stdout)


def test_a_slurm_grid_runs_a_lock_of_two_ranks_as_tasks_with_both_ranks_cpus(ranks_project, tmp_path):
    import subprocess

    if shutil.which("sbatch") is None:
        pytest.skip("needs a system component: Slurm (sbatch); ci/slurm/setup.sh sets one up")
    listed = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    if listed.returncode != 0 or not any(s.startswith(("idle", "mixed", "alloc")) for s in listed.stdout.split()):
        pytest.skip("needs a system component: a running Slurm (sinfo lists no usable node); run ci/slurm/setup.sh")
    runs = tmp_path / "runs"
    grid = ranks_project.grid("--seed", "1", "--executor", "slurm", runs=runs)
    stdout, stderr = grid.communicate(timeout=400)
    assert grid.returncode == 0, stderr
    report = finished_under_torchrun(ranks_project, runs, stdout)
    job = report["machine"]["slurm"]["job_id"]
    submission = next(runs.glob(f"*/.slurm/{job.split('_')[0]}/*_submission.sh")).read_text()
    assert "#SBATCH --cpus-per-task=2" in submission
