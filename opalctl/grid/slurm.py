"""The Slurm executor: the grid's pending runs as one job array through submitit, watched until every task ends.

One array, ``array_parallelism`` = ``--jobs``, ``cpus_per_task`` = the lock's ``budget.threads``, and an explicit
time limit: the pilot's forecast of the slowest arm's run (its whole wall time, driver/forecast.py) times a
margin, plus some minutes to spare, never submitit's default of a few minutes. Each task is
``grid/slurm_task.py``'s ``SlurmRunTask``, which runs ``opalctl run`` as the local executor does and, when Slurm
warns of the time limit or of a preemption (submitit's signal), stops the run cleanly and is requeued: the next
start continues with ``--resume``. The array's job ids go to ``.slurm/jobs.json`` under the lock's runs folder,
where ``opalctl grid LOCK --status`` reads them back; every run's ``report.json`` names its job and node itself
(driver/sharing.py). Settings come from flags or a small YAML file (grid/settings.py), never from the protocol.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opalctl import console
from opalctl.driver.pilot import pilot
from opalctl.errors import OpalctlError
from opalctl.files import atomic_write_json, read_plain
from opalctl.formats import RECORD_MAX_BYTES
from opalctl.grid.plan import DONE, RESUME, GridPlan, GridRun
from opalctl.grid.progress import RunProgress
from opalctl.grid.records import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    RESUMED,
    RUNNING,
    SKIPPED,
    RunOutcome,
    event,
    outcome_event,
)
from opalctl.grid.settings import SlurmSettings
from opalctl.grid.signals import StopRequest

OUTSIDE_BUDGET_SECONDS = 120  # to spare beside the forecast run: a requeued start's start-up again
MIN_TIME_LIMIT_MINUTES = 5  # submitit warns 90 s before the limit: leave a run time to train after a requeue
POLL_SECONDS = 1.0
GONE_SECONDS = 15.0  # how long a task may be missing from squeue, with no result, before it counts as ended


class SlurmUnavailable(OpalctlError):
    """Slurm (or submitit) is not there to run the grid on."""


def slurm_folder(plan: GridPlan) -> Path:
    """Where the array's submitit files and ``jobs.json`` live: beside the lock's run folders."""
    first = plan.runs[0].run_dir
    return first.parent.parent / ".slurm"


def jobs_file(plan: GridPlan) -> Path:
    """The grid's Slurm jobs (``jobs.json`` in ``slurm_folder``): which array holds which run."""
    return slurm_folder(plan) / "jobs.json"


def time_limit_minutes(projected_seconds: float, margin: float) -> int:
    """The time limit of one task: the projection times the margin, plus what a run spends outside its budget."""
    return max(MIN_TIME_LIMIT_MINUTES, math.ceil((projected_seconds * margin + OUTSIDE_BUDGET_SECONDS) / 60))


def projected_seconds(plan: GridPlan, say: Callable[[str], None] = lambda text: None) -> float:
    """The longest wall time any arm's run of the plan is forecast to take, from a pilot of each arm (public inputs
    only, nothing written; driver/forecast.py)."""
    longest = 0.0
    for arm in plan.arms:
        figures = pilot(plan.lock_path, arm, steps=24, seconds=0)  # short: the limit has its margin
        seconds = figures["forecast"]["total_seconds"]
        say(f"pilot {arm}: {figures['projected_updates']:.0f} updates projected, a run of {seconds:.1f} s "
            f"forecast")
        longest = max(longest, seconds)
    return longest


def squeue(array_job_id: str) -> dict[str, tuple[str, str]] | None:
    """``job_id -> (state, node)`` of every task of the array Slurm still lists, or None if squeue failed."""
    try:
        listed = subprocess.run(["squeue", "--noheader", "--array", "--jobs", array_job_id, "--format", "%i|%T|%N"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if listed.returncode != 0:
        return {} if "Invalid job id" in listed.stderr else None
    states = {}
    for line in listed.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            states[parts[0]] = (parts[1], parts[2])
    return states


def recorded_jobs(plan: GridPlan) -> dict[tuple[str, int], dict[str, Any]]:
    """(arm, seed) -> the Slurm job the grid last submitted for that run, with its state if Slurm lists it."""
    path = jobs_file(plan) if plan.runs else None
    if path is None or not path.exists():
        return {}
    try:
        record = json.loads(read_plain(path, RECORD_MAX_BYTES))
    except (OSError, ValueError):
        return {}
    states = squeue(str(record.get("array_job_id"))) or {}
    found = {}
    for entry in record.get("runs", []):
        state, node = states.get(entry["job_id"], ("ended", ""))
        found[entry["arm"], int(entry["seed"])] = {"job_id": entry["job_id"], "state": state.lower(),
                                                   "node": node or None}
    return found


class SlurmArray:
    """Submits the pending runs as one array and reports each task's progress and end, like the local pool."""

    def __init__(self, plan: GridPlan, jobs: int, notify: Callable[[dict[str, Any]], None], stop: StopRequest,
                 settings: SlurmSettings, say: Callable[[str], None] | None = None):
        self.plan, self.jobs, self.notify, self.stop, self.settings = plan, jobs, notify, stop, settings

        self.say = say or console.message

    def executor(self, count: int):
        try:
            import submitit
        except ImportError:
            raise SlurmUnavailable("the Slurm executor needs submitit; install it with `pip install submitit`, or "
                                   "use --executor local") from None
        settings = self.settings
        minutes = settings.time_limit_minutes or time_limit_minutes(projected_seconds(self.plan, self.say),
                                                                    settings.time_margin)
        executor = submitit.SlurmExecutor(folder=slurm_folder(self.plan) / "%j",
                                          max_num_timeout=settings.max_requeues)
        parameters = {"job_name": f"opalctl-grid-{self.plan.lock_path.stem}", "array_parallelism": self.jobs,
                      "cpus_per_task": self.plan.cpus_per_run, "ntasks_per_node": 1, "nodes": 1, "time": minutes,
                      "additional_parameters": dict(settings.sbatch)}
        if settings.partition:
            parameters["partition"] = settings.partition
        if settings.account:
            parameters["account"] = settings.account
        executor.update_parameters(**parameters)
        ranks = f" ({self.plan.ranks} ranks of {self.plan.threads})" if self.plan.ranks > 1 else ""
        self.say(f"submitting {count} run(s) as one Slurm array: {self.jobs} at a time, {self.plan.cpus_per_run} "
                 f"CPU(s){ranks} and {minutes} min each")
        return executor, minutes

    def submit(self, pending: list[GridRun]):
        from opalctl.grid.slurm_task import SlurmRunTask

        if not _has_sbatch():
            raise SlurmUnavailable("sbatch is not on this machine's PATH; run the grid where Slurm is installed "
                                   "(ci/slurm/setup.sh sets up a single-node Slurm), or use --executor local")
        executor, minutes = self.executor(len(pending))
        wave = min(self.jobs, len(pending))
        with executor.batch():
            jobs = [executor.submit(SlurmRunTask(), str(self.plan.lock_path), str(self.plan.runs_dir), run.arm,
                                    run.seed, self.plan.threads, wave, self.plan.ranks) for run in pending]
        array = jobs[0].job_id.split("_")[0]
        atomic_write_json(jobs_file(self.plan), {
            "array_job_id": array, "time_limit_minutes": minutes, "lock": str(self.plan.lock_path),
            "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "runs": [{"arm": run.arm, "seed": run.seed, "job_id": job.job_id} for run, job in zip(pending, jobs)]})
        return array, dict(zip(pending, jobs))

    def run(self, pending: list[GridRun], resume: set[GridRun]) -> dict[GridRun, RunOutcome]:
        array, jobs = self.submit(pending)
        watch = ArrayWatch(array, jobs, resume, self.notify)
        try:
            while not watch.finished() and not self.stop.requested:
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            self.stop.request()
        if not watch.finished():
            self.say(f"cancelling Slurm array {array}: each run gets SIGTERM and stays resumable")
            subprocess.run(["scancel", array], capture_output=True, timeout=60)
            deadline = time.monotonic() + 120
            while not watch.finished(cancelled=True) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
        return watch.outcomes


class ArrayWatch:
    """What the grid knows of each task of an array: its state in Slurm, its progress, its outcome."""

    def __init__(self, array: str, jobs: dict[GridRun, Any], resume: set[GridRun], notify):
        self.array, self.jobs, self.resume, self.notify = array, jobs, resume, notify
        self.outcomes: dict[GridRun, RunOutcome] = {}
        self.progress = {run: RunProgress(run.run_dir) for run in jobs}
        self.shown: dict[GridRun, tuple] = {}
        self.missing_since: dict[GridRun, float] = {}

    def finished(self, cancelled: bool = False) -> bool:
        states = squeue(self.array)
        for run, job in self.jobs.items():
            if run not in self.outcomes:
                self._look(run, job, states, cancelled)
        return len(self.outcomes) == len(self.jobs)

    def _look(self, run: GridRun, job, states, cancelled: bool) -> None:
        if job.paths.result_pickle.exists():
            return self._end(run, self._result(run, job))
        listed = None if states is None else states.get(job.job_id)
        if listed is None and states is not None:
            since = self.missing_since.setdefault(run, time.monotonic())
            if cancelled or time.monotonic() - since > GONE_SECONDS:
                return self._end(run, self._from_folder(run, job, cancelled))
            return None
        self.missing_since.pop(run, None)
        if listed is not None and listed[0] == "RUNNING":
            figures = self.progress[run].read()
            shown = (RUNNING, figures["fraction"], figures["updates"])
            if shown != self.shown.get(run):
                self.shown[run] = shown
                self.notify(event(run.arm, run.seed, RUNNING, resumed=run in self.resume, run_dir=str(run.run_dir),
                                  slurm={"job_id": job.job_id, "node": listed[1]}, **figures))
        return None

    def _result(self, run: GridRun, job) -> RunOutcome:
        try:
            answer = job.result()
        except Exception:  # submitit raises whatever ended the task (or its refusal to requeue it again)
            outcome = self._from_folder(run, job, False)
            if outcome.state == FAILED:
                outcome.log = str(job.paths.stderr)  # submitit's own log of the task says why
            return outcome
        code = None if answer.get("exit_code") is None else int(answer["exit_code"])
        # the task's own word that it ran nothing (the run had finished without it), else the folder's state
        state = SKIPPED if answer.get("skipped") else run.outcome(code, bool(answer["resumed"]))
        return RunOutcome(run.arm, run.seed, state, str(run.run_dir), code, str(run.log),
                          {"job_id": job.job_id, "node": answer.get("node"), "restarts": answer.get("restarts")})

    def _from_folder(self, run: GridRun, job, cancelled: bool) -> RunOutcome:
        """A task that ended without a result (cancelled, killed at its limit): its folder says what is left; one
        the grid cancelled before it started is interrupted, not failed."""
        need = run.need()
        if need == DONE:
            state = RESUMED if run in self.resume else FINISHED
        else:
            state = INTERRUPTED if need == RESUME or cancelled else FAILED
        return RunOutcome(run.arm, run.seed, state, str(run.run_dir), None, str(run.log), {"job_id": job.job_id})

    def _end(self, run: GridRun, outcome: RunOutcome) -> None:
        self.outcomes[run] = outcome
        self.notify(outcome_event(outcome))


def _has_sbatch() -> bool:
    return shutil.which("sbatch") is not None
