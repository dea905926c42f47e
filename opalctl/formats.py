"""Every record that crosses a module or a process boundary, defined once: its fields, its version, to and from JSON.

A run writes its results as files, and other commands (``show``, ``compare``, ``replay``, ``--resume``) and other
processes (the steps helper) read them back. Each of those records is described here and nowhere else:

- ``Event``: the kinds of line in an agent run's ``opal/events.jsonl`` (the only kinds a writer may use);
- ``StepRow`` and ``step_line``: one update as the training loop keeps it, and its line in ``steps.jsonl.gz``;
- ``StageRecord``: ``stage-NN.json``, and each entry of ``report.json``'s ``stages``;
- ``AgentFigures``: what an agent optimizer reports at its end (``report.json``'s ``agent``, the ``end`` event);
- ``TrainingFacts``: what the training process tells the evaluator at a run's close (driver/evaluator.py);
- ``RunReport``: ``report.json``;
- ``read_jsonl``: the one reader of a ``.jsonl`` file, tolerant of a last line cut short by a crash.

Records carry ``format`` (``FORMAT_VERSION``); a record written before versioning has none and is read as
version 1. ``from_json`` refuses a record that lacks a field, in one sentence naming the record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

from opalctl.errors import OpalctlError

FORMAT_VERSION = 1


class RecordDamaged(OpalctlError):
    """A record on disk cannot be read as what it should be (exit 1); the sentence names the file."""


# --------------------------------------------------------------------------------------------------------------
# events of the agent optimizer

class Event:
    """The kinds of event in ``events.jsonl``. ``OpalRecords.event`` refuses any other kind."""

    START = "start"
    RESUMED = "resumed"
    END = "end"
    # a decision: asked, then exactly one outcome
    REQUESTED = "requested"
    APPLIED = "applied"
    KEPT = "kept"
    LOAD_FAILED = "load_failed"
    DECISION_FAILED = "decision_failed"
    LATE = "late"
    SKIPPED = "skipped"
    ABANDONED = "abandoned"
    # the programs while they run
    TRIAL_PASSED = "trial_passed"
    REVERTED = "reverted"
    FAILED_STEP = "failed_step"
    ANALYSIS_FAILED = "analysis_failed"
    WAKE = "wake"
    AUDIT = "audit"
    # what the caller tells the optimizer
    DEV_REPORT = "dev_report"
    EVAL_INTEGRITY = "eval_integrity"
    LOG = "log"

    # what became of an asked decision (each ends one ``requested``)
    OUTCOMES = (APPLIED, KEPT, LOAD_FAILED, DECISION_FAILED, LATE)
    # outcomes whose answer the agent gave (their ``seconds`` say how long an answer takes)
    ANSWERED = (APPLIED, KEPT, LOAD_FAILED)
    ALL = frozenset({START, RESUMED, END, REQUESTED, APPLIED, KEPT, LOAD_FAILED, DECISION_FAILED, LATE, SKIPPED,
                     ABANDONED, TRIAL_PASSED, REVERTED, FAILED_STEP, ANALYSIS_FAILED, WAKE, AUDIT, DEV_REPORT,
                     EVAL_INTEGRITY, LOG})


# --------------------------------------------------------------------------------------------------------------
# the per-update row

class StepRow(NamedTuple):
    """One update as the training loop keeps it until the steps helper writes it.

    ``loss`` is a number, or a detached scalar tensor read later with the others; ``ids`` are the batch's row
    ids (an array that must not change until it is sent). The loop appends plain tuples in this order."""

    update: int
    charge: float
    used: float
    wall: float
    loss: Any
    ids: Any


STEP_LINE_KEYS = ("charge", "cpu", "loss", "rows", "seen", "update", "used", "wall")


def step_line(update: int, charge: float, used: float, wall: float, loss: float, rows: str, seen: str,
              cpu_charges: bool) -> str:
    """One line of ``steps.jsonl.gz`` (no newline): sorted keys, no spaces. ``cpu`` is the charge under the cpu
    clock and null under the others. Formatted by hand, since the helper formats one per update; a non-finite
    loss (rare) goes through ``step_line_plain``, which gives the same bytes for finite values (tested)."""
    if loss - loss != 0.0:
        return step_line_plain(update, charge, used, wall, loss, rows, seen, cpu_charges)
    return (f'{{"charge":{charge!r},"cpu":{repr(charge) if cpu_charges else "null"},"loss":{loss!r},'
            f'"rows":"{rows}","seen":"{seen}","update":{update},"used":{used!r},"wall":{wall!r}}}')


def step_line_plain(update: int, charge: float, used: float, wall: float, loss: float, rows: str, seen: str,
                    cpu_charges: bool) -> str:
    """The plain twin of ``step_line``: the same line through ``json.dumps``."""
    return json.dumps({"charge": charge, "cpu": charge if cpu_charges else None, "loss": loss, "rows": rows,
                       "seen": seen, "update": update, "used": used, "wall": wall},
                      separators=(",", ":"), allow_nan=True, sort_keys=True)


# --------------------------------------------------------------------------------------------------------------
# records as dataclasses

def _from_json(cls, data: Any, what: str):
    """``cls`` from a JSON object, refusing a missing field or another format in one sentence naming ``what``."""
    if not isinstance(data, dict):
        raise RecordDamaged(f"{what} is not a JSON object; the record is damaged")
    version = data.get("format", 1)
    if version != FORMAT_VERSION:
        raise RecordDamaged(f"{what} has format {version!r}, which this opalctl does not read (it reads "
                            f"{FORMAT_VERSION})")
    known = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
    if missing:
        raise RecordDamaged(f"{what} lacks {', '.join(missing)}; the record is damaged")
    return cls(**{key: value for key, value in data.items() if key in known})


class _Record:
    """A record's JSON form: its fields as a dict, and back (``WHAT`` names it in a refusal)."""

    WHAT = "a record"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, what: str | None = None):
        return _from_json(cls, data, what or cls.WHAT)


@dataclass
class StageRecord(_Record):
    """``stage-NN.json``: one budget fraction's checkpoint, its metrics and the promotion decision about it.
    ``report.json`` lists the same records under ``stages``."""

    WHAT = "a stage record"

    stage: int
    fraction: float
    update: int
    budget_used: float
    budget_fraction_used: float
    examples: int
    train_cpu_seconds: float
    train_wall_seconds: float
    checkpoint: dict[str, Any]  # file, sha256, model_sha256, bytes
    metrics: dict[str, float | int]
    eval_seconds: float
    incumbent_before: int | str  # a stage number, or "anchor"
    decision: dict[str, Any]  # promotion.Decision.to_json()
    promoted: bool
    incumbent_after: int | str
    shared_state_with: list[int]  # other stages reached by the same update (same weights)
    loss: float | None  # the last update's training loss before this stage
    format: int = FORMAT_VERSION


@dataclass
class AgentFigures(_Record):
    """What an agent optimizer reports at its end (``close()``): its decisions, waiting, cost and checks."""

    WHAT = "the agent figures"

    decisions_asked: int
    decisions_applied: int
    decisions_kept: int
    decisions_load_failed: int
    decisions_failed: int
    decisions_reverted: int
    step_failures: int
    waiting_seconds: float
    agent_seconds: float
    cost_usd: float
    wakes: int
    version: int
    versions: int
    eval_integrity: dict[str, Any] | None  # flagged, information, tensors; None when the check is off
    format: int = FORMAT_VERSION


@dataclass
class TrainingFacts(_Record):
    """What only the training process knows at a run's close, sent to the evaluator, which reports it as the
    training process's own account (the results beside it are the evaluator's)."""

    WHAT = "the training facts"

    updates: int
    budget_total: float
    budget_used: float
    overshoot: float
    ledger: dict[str, Any]  # ledger.Ledger.figures()
    rows_digest: str
    agent: dict[str, Any] | None  # AgentFigures.to_json(), for an agent arm
    final_model_sha256: str  # the training model's digest at the end
    peak_memory_bytes: int
    peak_device_memory_bytes: int | None
    session_wall: float  # this session of the training process, until the close
    session_cpu: float
    format: int = FORMAT_VERSION


@dataclass
class RunReport(_Record):
    """``report.json``: the figures of a finished run (written once, at its end)."""

    WHAT = "a run report"

    lock_sha256: str
    protocol: str
    arm: str
    seed: int
    budget: dict[str, Any]  # clock, total, used, overshoot, fractions, threads, multiplier
    updates: int
    examples_seen: int
    rows_digest: str
    seconds: dict[str, float]
    peak_memory_bytes: int
    parameter_change: dict[str, Any]
    stages: list[dict[str, Any]]  # StageRecord.to_json() of every stage
    promoted_stages: list[int]
    selected: dict[str, Any]  # source, stage, flagged
    final_model_sha256: str
    anchor_metrics: dict[str, float | int]
    agent: dict[str, Any] | None  # AgentFigures.to_json(), for an agent arm
    resumes: int
    nonfinite_losses: int
    limitations: list[str]
    peak_device_memory_bytes: int | None = None
    # the OS confinement of the last session's training process (opalctl.sandbox), None where none was applied
    confinement: dict[str, Any] | None = None
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["peak_device_memory_bytes"] is None:
            del data["peak_device_memory_bytes"]  # only a CUDA run has one
        return data


# --------------------------------------------------------------------------------------------------------------
# reading .jsonl files

def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Each JSON object of a ``.jsonl`` file, in order. A last line cut short by a crash (no newline at its end,
    or not JSON) is skipped; any other line that is not a JSON object is damage, refused naming file and line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RecordDamaged(f"{path} cannot be read ({error.strerror or error})") from None
    lines = data.split(b"\n")
    torn_tail = not data.endswith(b"\n")  # the last piece is "" for a complete file
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number == len(lines)
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            if last and torn_tail:
                return
            raise RecordDamaged(f"{path} line {number} is not JSON; the record is damaged") from None
        if not isinstance(value, dict):
            if last and torn_tail:
                return
            raise RecordDamaged(f"{path} line {number} is not a JSON object; the record is damaged")
        yield value


def finite_or_none(value: float | None) -> float | None:
    """A JSON-safe float: non-finite values become None (``report.json`` is strict JSON)."""
    return value if value is not None and math.isfinite(value) else None
