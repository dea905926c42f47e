"""The Slurm executor against a real Slurm (ci/slurm/setup.sh makes a single-node one; CI runs it first).

The grid submits one job array through submitit; one task is then preempted the way Slurm does it (submitit's
signal, SIGUSR2, sent with ``scancel --signal``): the task stops its run cleanly, submitit requeues it, and its
next start continues with ``--resume`` to the digests of an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.support import grids

pytestmark = pytest.mark.skipif(shutil.which("sbatch") is None,
                                reason="needs a system component: Slurm (sbatch); ci/slurm/setup.sh sets one up")


def slurm_up() -> bool:
    listed = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    return listed.returncode == 0 and any(s.startswith(("idle", "mixed", "alloc")) for s in listed.stdout.split())


def test_a_preempted_slurm_task_is_requeued_and_resumes_to_the_uninterrupted_digests(grid_project, tmp_path):
    if not slurm_up():
        pytest.skip("needs a system component: a running Slurm (sinfo lists no usable node); run ci/slurm/setup.sh")
    runs, gate = tmp_path / "runs", tmp_path / "gate"
    gate.mkdir()
    grid = grid_project.grid("--arm", "adamw", "--arm", "cosine", "--seed", "1", "--jobs", "2",
                             "--executor", "slurm", runs=runs, gate=gate)
    try:
        reference = grid_project.reference("adamw", 1)  # in this process while the array starts
        grids.wait_for(lambda: len(list(gate.glob("waiting-*"))) == 2 or grid.poll() is not None, 180,
                            "both tasks to be held in the middle of their budget")
        assert grid.poll() is None, grid.communicate()[1]
        jobs = json.loads(next(runs.glob("*/.slurm/jobs.json")).read_text())
        assert jobs["time_limit_minutes"] >= 5, "an explicit limit from the pilot's projection, not submitit's"
        preempted = next(entry for entry in jobs["runs"] if entry["arm"] == "adamw")
        subprocess.run(["scancel", "--signal=USR2", preempted["job_id"]], check=True, timeout=30)
        folder = runs / next(runs.iterdir()).name / "adamw" / "seed-1"
        # the requeued task resumes after the update where it was held, so it finishes without the gate
        grids.wait_for(lambda: (folder / "report.json").exists() or grid.poll() is not None, 180,
                            "the preempted task to be requeued and finish")
        (gate / "open").write_text("")
        stdout, stderr = grid.communicate(timeout=240)
    finally:
        grids.stop(grid)
    assert grid.returncode == 0, stderr
    final = grids.events(stdout)[-1]
    states = {run["arm"]: run for run in final["runs"]}
    assert states["adamw"]["state"] == "resumed" and states["cosine"]["state"] == "finished"
    # Slurm may deliver the signal to the restarted task once more; each start then stops and resumes cleanly
    assert states["adamw"]["slurm"]["job_id"] == preempted["job_id"] and states["adamw"]["slurm"]["restarts"] >= 1
    report = json.loads((folder / "report.json").read_text())
    assert grids.same_run(report, reference) == {}
    assert report["resumes"] >= 1
    log = (folder / "grid.log").read_text()
    starts = [line for line in log.splitlines() if line.startswith("--- opalctl grid")]
    resumes = sum("--resume" in line for line in starts)  # the headers, not the run's own "resume with" line
    assert resumes >= 1 and len(starts) == 1 + resumes, "started once, every later start a resume"

    status = grid_project.status("--arm", "adamw", "--arm", "cosine", "--seed", "1", runs=runs)
    assert {(r["arm"], r["state"]) for r in status["runs"]} == {("adamw", "finished"), ("cosine", "finished")}
    assert {r["slurm"]["job_id"] for r in status["runs"]} == {entry["job_id"] for entry in jobs["runs"]}


def test_a_slurm_grid_rerun_while_the_old_array_runs_reports_what_it_did_not_run_as_skipped(grid_project,
                                                                                            tmp_path):
    if not slurm_up():
        pytest.skip("needs a system component: a running Slurm (sinfo lists no usable node); run ci/slurm/setup.sh")
    import signal

    runs, gate = tmp_path / "runs", tmp_path / "gate"
    gate.mkdir()
    selection = ("--arm", "adamw", "--arm", "cosine", "--seed", "2", "--jobs", "2", "--executor", "slurm")
    old = grid_project.grid(*selection, runs=runs, gate=gate)
    again = None
    try:
        grids.wait_for(lambda: len(list(gate.glob("waiting-*"))) == 2 or old.poll() is not None, 180,
                            "both tasks of the first array to be held in the middle of their budget")
        assert old.poll() is None, old.communicate()[1]
        first_array = json.loads(next(runs.glob("*/.slurm/jobs.json")).read_text())["array_job_id"]
        old.send_signal(signal.SIGKILL)  # the grid is gone (a closed terminal); its array runs on
        old.communicate(timeout=30)
        again = grids.Lines(grid_project.grid(*selection, runs=runs, gate=gate))
        grids.wait_for(lambda: json.loads(next(runs.glob("*/.slurm/jobs.json")).read_text())["array_job_id"]
                            != first_array, 180, "the second grid to submit its array")
        (gate / "open").write_text("")
        code, lines, stderr = again.finish(300)
    finally:
        grids.stop(old)
        if again is not None:
            grids.stop(again.process)
    assert code == 0, stderr
    final = lines[-1]
    assert {run["arm"]: run["state"] for run in final["runs"]} == {"adamw": "skipped", "cosine": "skipped"}, \
        "the first array's tasks ran them; the second grid ran nothing"
    for arm in ("adamw", "cosine"):
        folder = grids.run_folder(grid_project, runs, arm, 2)
        report = json.loads((folder / "report.json").read_text())
        assert report["resumes"] == 0 and report["machine"]["slurm"]["array_job_id"] == first_array
        assert (folder / "grid.log").read_text().count("--- opalctl grid") == 1, "trained once"
