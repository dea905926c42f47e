"""The machine facts a run's report carries (driver/sharing.py) and compare's warning when the arms of one seed
trained under different concurrency (compare/concurrency.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from opalctl.compare.concurrency import concurrency_warnings
from opalctl.driver.sharing import MachineWatch, is_run_command, live_runs


def test_a_run_command_is_told_apart_from_the_other_opalctl_processes():
    assert is_run_command(["/usr/bin/python3", "-m", "opalctl", "run", "x.lock.json", "--arm", "a"])
    assert is_run_command(["/venv/bin/python", "/venv/bin/opalctl", "run", "x.lock.json"])
    assert not is_run_command(["python", "-m", "opalctl", "grid", "x.lock.json"])
    assert not is_run_command(["python", "-m", "opalctl.driver.evaluator", "run"])
    assert not is_run_command(["python", "-m", "opalctl"])


def test_the_watch_finds_a_live_run_process_of_this_machine():
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "opalctl", "run"])
    try:
        cmdline = Path(f"/proc/{neighbour.pid}/cmdline")
        while b"opalctl" not in cmdline.read_bytes():  # until the child has exec'd: before, it is a copy of us
            time.sleep(0.01)
        found = live_runs(own_training=os.getpid())
    finally:
        neighbour.kill()
        neighbour.wait()
    assert {neighbour.pid, os.getpid()} <= found


def fake_process(proc, pid, *words):
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cmdline").write_bytes(b"\0".join(w.encode() for w in words) + b"\0")


def test_the_watch_counts_the_runs_beside_its_own_at_every_sample(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, 10, "python", "-m", "opalctl", "run", "x.lock.json")  # this run's training process
    fake_process(proc, 11, "python", "-m", "opalctl.driver.evaluator", "x")
    watch = MachineWatch(environ={}, proc=proc, own_training=10)
    fake_process(proc, 12, "/venv/bin/python", "/venv/bin/opalctl", "run", "x.lock.json")
    watch.sample()
    figures = watch.to_json()
    assert figures["concurrent_runs"] == {"min": 1.0, "max": 2.0, "mean": 1.6667}
    assert figures["load"]["min"] >= 0 and figures["cores"] == os.cpu_count()
    assert figures["executor"] is None and figures["slurm"] is None and figures["wave_size"] is None


def test_without_a_process_table_the_watch_says_what_the_grid_started_side_by_side(tmp_path):
    environ = {"OPALCTL_GRID_WAVE_SIZE": "3", "OPALCTL_GRID_EXECUTOR": "slurm", "SLURM_JOB_ID": "41",
               "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "1", "SLURMD_NODENAME": "node7",
               "SLURM_RESTART_COUNT": "2"}
    figures = MachineWatch(environ=environ, proc=tmp_path / "no-proc").to_json()
    assert figures["concurrent_runs"] == {"min": 3.0, "max": 3.0, "mean": 3.0}
    assert figures["executor"] == "slurm" and figures["wave_size"] == 3
    assert figures["slurm"] == {"job_id": "41", "array_job_id": "40", "array_task_id": "1", "node": "node7",
                                "restarts": 2}


def write_report(base, arm, seed, machine, clock="cpu"):
    folder = base / arm / f"seed-{seed}"
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps({"arm": arm, "seed": seed, "machine": machine,
                                                    "budget": {"clock": clock}}))


def concurrency(mean):
    return {"concurrent_runs": {"min": mean, "max": mean, "mean": mean}, "load": None, "cores": 2,
            "executor": "local", "slurm": None}


def test_compare_warns_when_the_arms_of_a_seed_trained_under_different_concurrency(tmp_path):
    base = tmp_path / "runs" / "digits-abc"
    write_report(base, "adamw", 1, concurrency(2.0))
    write_report(base, "agent", 1, concurrency(1.0))
    write_report(base, "adamw", 2, concurrency(2.0))
    write_report(base, "agent", 2, concurrency(2.0))
    result = {"runs": str(base), "arms": [{"arm": "adamw", "seeds": [1, 2]}, {"arm": "agent", "seeds": [1, 2]}]}
    warnings = concurrency_warnings(result)
    assert len(warnings) == 1
    assert warnings[0].startswith("the arms of seed 1 trained under different concurrency (mean runs on the "
                                  "machine: adamw 2.0, agent 1.0)")


def test_reports_without_machine_facts_raise_no_warning(tmp_path):
    base = tmp_path / "runs" / "digits-abc"
    write_report(base, "adamw", 1, None)
    write_report(base, "agent", 1, {"concurrent_runs": None})
    write_report(base, "other", 1, concurrency(4.0))
    result = {"runs": str(base), "arms": [{"arm": a, "seeds": [1]} for a in ("adamw", "agent", "other")]}
    assert concurrency_warnings(result) == []


def test_runs_on_the_updates_clock_raise_no_warning_since_an_update_is_the_same_work_beside_a_neighbour(tmp_path):
    base = tmp_path / "runs" / "digits-abc"
    write_report(base, "adamw", 1, concurrency(2.0), clock="updates")
    write_report(base, "agent", 1, concurrency(1.0), clock="updates")
    result = {"runs": str(base), "arms": [{"arm": "adamw", "seeds": [1]}, {"arm": "agent", "seeds": [1]}]}
    assert concurrency_warnings(result) == []
