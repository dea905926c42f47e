"""What changed in a run folder since the last look, read from its files alone: state, progress, loss, stages,
decisions.

Every figure comes from a reader that already exists: the state from the folder (``RunLayout.state``, worded as
``grid --status`` words it: grid/status.py ``state_word``, ``starting`` for a run whose log holds only the
grid's header: spawned, its folder not taken yet, not failed), the budget used and the ETA from the steps file read
incrementally (grid/progress.py ``RunProgress``, which also keeps the last lines for the loss curve), each stage
from its record (formats.py ``StageRecord``, told as ``show`` tells it: driver/show.py ``stage_row``) and each
decision as ``show`` reads it (driver/show.py ``agent_decisions``: the training process's events and the agent
host's record of each answer). Nothing is written, and the folder's lock is never taken: whether a process holds
it is read from ``/proc/locks`` (``RunLayout.lock_holders``), then asked of the file system as a POSIX lock
(``posix_lock_seen``: what NFS makes of a run's flock held on another node), and only where ``/proc/locks`` does
not say is it tried without waiting (``RunLayout.held``), as ``live_state`` does.

A record that cannot be read yet (a stage record being written, an events line cut short) is simply read again
at the next look; one that stays unreadable is named in ``problem`` and the rest of the view goes on.
"""

from __future__ import annotations

import fcntl
import math
import os
import struct
from pathlib import Path
from typing import Any

from opalctl.driver.show import agent_decisions, stage_row
from opalctl.errors import OpalctlError
from opalctl.formats import StageRecord, read_record
from opalctl.grid.progress import RunProgress
from opalctl.grid.status import state_word
from opalctl.layout import RUNNING, RunLayout

KEPT_LINES = 400  # the steps lines kept for the loss curve: the recent training, not the whole run
PROGRESS_STEPS = 10  # a progress change each time a running run passes the next tenth of its budget
FINAL = ("finished", "failed")  # the states a run does not leave by itself (interrupted may be resumed)


def observed_state(layout: RunLayout) -> str:
    """Where the run stands as a watcher sees it, in ``grid --status``'s words (module docstring)."""
    holders = layout.lock_holders()
    held = bool(holders) if holders is not None else layout.held()
    held = held or posix_lock_seen(layout.folder_lock)
    return state_word(layout, RUNNING if held else layout.state)


def posix_lock_seen(path: Path) -> bool:
    """Whether a process holds a POSIX lock on ``path``, asked without taking one (``F_GETLK``). An NFS client
    makes a run's flock a POSIX lock on the server, which ``/proc/locks`` here does not list when the run holds it
    from another node (a Slurm job on a shared file system); on a local file system no run takes one."""
    flock = struct.Struct("hhqqi4x")  # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, flock.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        return flock.unpack(answer)[0] != fcntl.F_UNLCK
    except OSError:  # not a file a lock can be asked about: no run holds it
        return False
    finally:
        os.close(fd)


class RunWatch:
    """One run folder, looked at again and again: ``look()`` returns what changed since the last look (each a
    dict with ``event``: ``state``, ``progress``, ``stage``, ``decision``); ``view()`` where it stands now."""

    def __init__(self, arm: str, seed: int | None, run_dir: Path):
        self.arm, self.seed, self.run_dir = arm, seed, Path(run_dir)
        self.layout = RunLayout.of(self.run_dir)
        self.progress = RunProgress(self.run_dir, keep=KEPT_LINES)
        self.state: str | None = None
        self.figures: dict[str, Any] = {"fraction": None, "updates": None, "eta_seconds": None}
        self.tenths = 0
        self.stages: dict[int, dict[str, Any]] = {}
        self.decisions: dict[int, dict[str, Any]] = {}
        self.problem: str | None = None
        self._decisions_read: tuple | None = None  # what the decision records looked like when last read

    @property
    def label(self) -> str:
        return self.arm if self.seed is None else f"{self.arm} seed {self.seed}"

    def look(self) -> list[dict[str, Any]]:
        """What changed since the last look, in the order it happened: a run that starts says so first, one that
        ends says so last (after its last stage)."""
        self.problem = None
        state = observed_state(self.layout)
        changes: list[dict[str, Any]] = []
        new_state = state != self.state
        self.state = state
        if new_state and state not in FINAL:
            changes.append(self._change("state"))
        self.figures = self.progress.read()
        fraction = self.figures["fraction"]
        if state == "running" and fraction is not None and int(fraction * PROGRESS_STEPS) > self.tenths:
            self.tenths = int(fraction * PROGRESS_STEPS)
            changes.append(self._change("progress"))
        changes += self._new_stages() + self._new_decisions()
        if new_state and state in FINAL:
            changes.append(self._change("state"))
        return changes

    def _change(self, event: str, **fields: Any) -> dict[str, Any]:
        head = {"event": event, "arm": self.arm, "seed": self.seed, "run_dir": str(self.run_dir)}
        if event in ("state", "progress"):
            head.update(state=self.state, **self.figures)
        return {**head, **fields}

    def _new_stages(self) -> list[dict[str, Any]]:
        changes = []
        for path in self.layout.stage_records():
            number = int(path.stem.removeprefix("stage-"))
            if number in self.stages:
                continue
            try:
                stage = stage_row(read_record(path, StageRecord))
            except OpalctlError as error:  # being written now, or damaged: look again next time
                self.problem = error.message
                break
            self.stages[number] = stage
            changes.append(self._change("stage", **stage))
        return changes

    def _new_decisions(self) -> list[dict[str, Any]]:
        events, folder = self.layout.events, self.layout.decisions
        signature = (_stamp(events), _stamp(folder), tuple(_stamp(path) for path in sorted(folder.glob("[0-9]*"))))
        if signature == self._decisions_read:
            return []
        try:
            entries = agent_decisions(events, folder) or []
        except OpalctlError as error:
            self.problem = error.message
            return []
        self._decisions_read = signature
        changes = []
        for entry in entries:
            told = decision_told(entry)
            before = self.decisions.get(entry["decision"])
            self.decisions[entry["decision"]] = told
            if told["outcome"] != "pending" and (before is None or _moment(before) != _moment(told)):
                changes.append(self._change("decision", **told))
        return changes

    def view(self) -> dict[str, Any]:
        """Where the run stands now: state, progress, the last loss and learning rates, the loss curve's recent
        values, every stage and decision read so far."""
        recent = list(self.progress.tail.recent)
        last = recent[-1] if recent else {}
        return {"arm": self.arm, "seed": self.seed, "run_dir": str(self.run_dir), "state": self.state,
                **self.figures, "loss": _number(last.get("loss")), "lrs": last.get("lrs"),
                "recent_losses": [_number(line.get("loss")) for line in recent],
                "stages": [self.stages[n] for n in sorted(self.stages)],
                "decisions": [self.decisions[n] for n in sorted(self.decisions)], "problem": self.problem}


def decision_told(entry: dict[str, Any]) -> dict[str, Any]:
    """A decision as the watch tells it: ``show``'s entry, and ``said``: the agent's summary line (a heuristic's
    names its rule), else its rationale's first line, else the failure."""
    said = entry.get("summary") or entry.get("rationale") or entry.get("message") or ""
    kept = ("decision", "asked_at", "reason", "outcome", "answered_at", "rationale", "summary", "message",
            "reverted_at", "revert_reason", "files", "seconds", "cost_usd")
    return {**{key: entry.get(key) for key in kept}, "said": str(said).strip().splitlines()[0] if said else ""}


def _moment(told: dict[str, Any]) -> tuple:
    return told["outcome"], told.get("reverted_at")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return status.st_size, status.st_mtime_ns


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
