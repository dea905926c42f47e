"""The grid's records: a run's outcome, the grid's result, and the event a display receives at each change.

These are the only shapes the grid hands to its callers (the CLI, ``opalctl demo``, the displays), so they are
defined here once. States: ``queued``, ``running`` and ``waiting`` (another process, another grid's run or a
plain ``opalctl run``, holds the run's folder; the grid takes what it leaves) while the grid works, then one final
state per run, read from the run's folder (grid/plan.py ``GridRun.outcome``):

- ``finished``: ran to its report in this grid (whatever its exit code: a stop that landed after the report);
- ``resumed``: was interrupted before, continued with ``--resume`` and finished;
- ``skipped``: finished without this grid running it: before the grid started, or by another process meanwhile
  (never run twice);
- ``failed``: ended with an error (its log says which); the other runs went on;
- ``interrupted``: stopped by a signal (its ``resume.pt`` stays; the same grid command resumes it), or never
  started because the grid was stopped.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

QUEUED, RUNNING, WAITING = "queued", "running", "waiting"
FINISHED, RESUMED, SKIPPED, FAILED, INTERRUPTED = "finished", "resumed", "skipped", "failed", "interrupted"
FINAL = (FINISHED, RESUMED, SKIPPED, FAILED, INTERRUPTED)
DONE_STATES = (FINISHED, RESUMED, SKIPPED)  # the final states of a run that needs nothing more

# what `opalctl run` exits with when a signal stopped it and left it resumable (docs/architecture.md)
SIGNAL_EXITS = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM", 128 + signal.SIGHUP: "SIGHUP"}


def final_state(exit_code: int, resumed: bool) -> str:
    """The state a child's exit code means: 0 finished, a signal's exit (or death by a signal) interrupted."""
    if exit_code == 0:
        return RESUMED if resumed else FINISHED
    if exit_code in SIGNAL_EXITS or exit_code < 0:
        return INTERRUPTED
    return FAILED


@dataclass
class RunOutcome:
    """What became of one run of the grid."""

    arm: str
    seed: int
    state: str
    run_dir: str
    exit_code: int | None = None
    log: str | None = None
    slurm: dict[str, Any] | None = None  # job id, array task id and node, for the Slurm executor

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "slurm" or value is not None}


@dataclass
class GridResult:
    """Every run's outcome in the grid's order; ``ok`` when each one finished (now or before)."""

    lock: str
    runs_dir: str
    executor: str
    jobs: int
    outcomes: list[RunOutcome] = field(default_factory=list)
    stopped_by: str | None = None  # the signal that stopped the grid, if one did
    wall_seconds: float = 0.0
    arms: list[str] | None = None  # the arms and seeds asked for (None: all of the lock's)
    seeds: list[int] | None = None

    @property
    def runs(self) -> list[dict[str, Any]]:
        return [outcome.to_json() for outcome in self.outcomes]

    @property
    def ok(self) -> bool:
        return bool(self.outcomes) and all(outcome.state in DONE_STATES for outcome in self.outcomes)

    def count(self, state: str) -> int:
        return sum(1 for outcome in self.outcomes if outcome.state == state)

    def to_json(self) -> dict[str, Any]:
        return {"lock": self.lock, "runs_dir": self.runs_dir, "executor": self.executor, "jobs": self.jobs,
                "ok": self.ok, "stopped_by": self.stopped_by, "wall_seconds": round(self.wall_seconds, 3),
                "runs": self.runs}


def event(arm: str, seed: int, state: str, *, fraction: float | None = None, updates: int | None = None,
          eta_seconds: float | None = None, **more: Any) -> dict[str, Any]:
    """The event a display receives when a run changes (its state, or its progress while it runs)."""
    return {"arm": arm, "seed": seed, "state": state, "fraction": fraction, "updates": updates,
            "eta_seconds": eta_seconds, **more}


def outcome_event(outcome: RunOutcome) -> dict[str, Any]:
    extra = {"run_dir": outcome.run_dir, "exit_code": outcome.exit_code, "log": outcome.log}
    if outcome.slurm is not None:
        extra["slurm"] = outcome.slurm
    return event(outcome.arm, outcome.seed, outcome.state, fraction=1.0 if outcome.state in DONE_STATES else None,
                 **extra)


def command_line(result: GridResult) -> str:
    """The ``opalctl grid`` command that continues this grid (the same selection, folder and executor)."""
    words = ["opalctl", "grid", str(result.lock)]
    words += [word for arm in result.arms or [] for word in ("--arm", arm)]
    words += [word for seed in result.seeds or [] for word in ("--seed", str(seed))]
    words += ["--runs-dir", str(result.runs_dir)]
    if result.executor != "local":
        words += ["--executor", result.executor]
    return " ".join(shlex.quote(word) for word in words)


def resume_hint(result: GridResult) -> str:
    """The sentence that says how to go on after the grid was stopped."""
    return f"every stopped run is resumable; run the same command again to continue: {command_line(result)}"
