"""Every record that crosses a module or a process boundary, defined once: its fields, its version, to and from JSON.

A run writes its results as files, and other commands (``show``, ``compare``, ``replay``, ``--resume``) and other
processes (the steps helper) read them back. Each of those records is described here and nowhere else:

- ``Event``: the kinds of line in an agent run's ``opal/events.jsonl`` (the only kinds a writer may use);
- ``StepRow`` and ``step_line``: one update as the training loop keeps it, and its line in ``steps.jsonl.gz``;
- ``Message``: the kinds of request the training process sends its evaluator (driver/evaluator.py), each with
  the record its body is (``Opening``, ``Starting``, ``CarriedStages``, ``StageReached`` with ``StageSaved`` and
  ``StageFacts``, ``TrainingFacts``) and the record its answer is (``Acknowledged``, ``StageVerdict`` with
  ``RecordedStage``, ``Closed``);
- ``StageRecord``: ``stage-NN.json``, and each entry of ``report.json``'s ``stages``;
- ``AgentFigures``: what an agent optimizer reports at its end (``report.json``'s ``agent``, the ``end`` event);
- ``HostStart``, ``HostDecide`` and ``HostCancel``: the agent host's input, ``HostReply`` its output,
  ``WorkerQuestion`` and ``WorkerAnswer`` what it exchanges with a worker process; ``HostDecisionRecord``:
  ``agent/decisions/NNN/answer.json``, one decision as the agent host saw it, and ``HostRefusal``, one line of
  ``agent/refused.jsonl``, a request the host refused (opal/records.py);
- ``MailboxRequest``, ``MailboxAnswer`` and ``MailboxLease``: a decision asked in a mailbox folder, its answer,
  and a server's hold on it (opal/mailbox/box.py);
- ``TrainingFacts``: what the training process tells the evaluator at a run's close (driver/evaluator.py);
- ``RunReport``: ``report.json``, with ``RunDigests``, the end of the chain of digests (below);
- ``StartRecord``, ``AnchorRecord``, ``LastRecord``, ``SelectedRecord``: ``start.json``, ``anchor.json``,
  ``last.json`` and ``selected.json``, as the evaluator writes them and every reader reads them back;
- ``read_record``: the one reader of a JSON record file, ``read_jsonl`` the one reader of a ``.jsonl`` file.

Records carry ``format`` (``FORMAT_VERSION``); a record written before versioning has none and is read as
version 1. ``from_json`` refuses a record that lacks a field or holds a value of another type, in one sentence
naming the record; a field added later has a default, so that older records still read.

The chain of digests, from the lock to the verdict (each record names only records written before it, so it
has no loop; ``opalctl verify RUN_DIR`` checks it, verify/chain.py holds the checks):

- ``start.json`` names the lock's sha256 and ``initial.pt``'s sha256 and ``model_sha256``;
- ``anchor.json`` names the lock, the parent and the data, and carries ``sha256``, the digest of its own content
  (``anchor_sha256``: everything but ``eval_seconds``, so that evaluating the same parent again gives the same
  digest);
- each ``stage-NN.json`` names its checkpoint's sha256 and ``model_sha256`` and the anchor's digest;
- ``last.json`` and ``selected.json`` name the checkpoint of a stage (or the anchor's);
- ``report.json`` carries ``digests`` (``RunDigests``): the sha256 of every stage record, of ``start.json``, of
  ``steps.jsonl.gz``, of ``last.json`` and ``selected.json``, the anchor's digest, and ``report``, the digest of
  the report itself without that one entry (an edited figure is seen without any other file).

A record's digest is the sha256 of its bytes as opalctl writes them (``files.canonical_json``), so
``record_sha256(value)`` of a record read back is its file's sha256 when nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

from opalctl.errors import InputChanged, OpalctlError
from opalctl.files import JSONRefused, NotAPlainFile, canonical_json, decode_json, read_plain

FORMAT_VERSION = 1
DAMAGED = "the record is damaged"  # what a refusal says when its caller has nothing better to advise

# The most bytes read of each kind of file opalctl reads back (``read_bounded``): far above what a run writes, far
# below what exhausts a machine's memory. A record's own is its class's ``MAX_BYTES``.
RECORD_MAX_BYTES = 16 << 20  # start, stage, last, selected and anchor records, a decision's answer
REPORT_MAX_BYTES = 256 << 20  # report.json holds every stage record
EVENTS_MAX_BYTES = 1 << 30  # opal/events.jsonl and the other .jsonl records of an agent arm
STEPS_MAX_BYTES = 8 << 30  # steps.jsonl.gz: a line per update, compressed
PROGRAM_MAX_BYTES = 16 << 20  # an agent's program file as a run folder keeps it


class RecordDamaged(OpalctlError):
    """A record on disk cannot be read as what it should be (exit 1): missing, empty, not UTF-8, not JSON, or not
    of its shape; the sentence names the file."""


class RecordChanged(InputChanged):
    """A run's record reads well but no longer matches the digest or the record that vouches for it: it was
    edited after opalctl wrote it (exit 3); the sentence names the file."""


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
    ids (an array that must not change until it is sent); ``lrs`` the learning rate of each parameter group as the
    update's step used it (``driver.arm.StepLearningRates``: the values the groups held, read at the flush) or None
    when no step of the arm's torch optimizer ran. The loop appends plain tuples in this order."""

    update: int
    charge: float
    used: float
    wall: float
    loss: Any
    ids: Any
    lrs: Any = None


STEP_LINE_KEYS = ("charge", "cpu", "loss", "lrs", "rows", "seen", "update", "used", "wall")


def step_line(update: int, charge: float, used: float, wall: float, loss: float, rows: str, seen: str,
              cpu_charges: bool, lrs: list[float | None] | None = None) -> str:
    """One line of ``steps.jsonl.gz`` (no newline): sorted keys, no spaces. ``cpu`` is the charge under the cpu
    clock and null under the others; ``lrs`` the effective learning rate of each parameter group (null for the
    whole list when the update's step did not step the arm's torch optimizer, for a group whose value is no
    finite number; a line of an opalctl older than the field has no ``lrs``: read it with ``.get``). Formatted by
    hand, since the helper formats one per update; a non-finite loss or learning rate (rare) goes through
    ``step_line_plain``, which gives the same bytes for finite values (tested)."""
    if loss - loss != 0.0:
        return step_line_plain(update, charge, used, wall, loss, rows, seen, cpu_charges, lrs)
    if lrs is None:
        rates = "null"
    else:
        for lr in lrs:
            if lr is None or lr - lr != 0.0:
                return step_line_plain(update, charge, used, wall, loss, rows, seen, cpu_charges, lrs)
        rates = f"[{','.join(map(repr, lrs))}]"
    return (f'{{"charge":{charge!r},"cpu":{repr(charge) if cpu_charges else "null"},"loss":{loss!r},'
            f'"lrs":{rates},"rows":"{rows}","seen":"{seen}","update":{update},"used":{used!r},"wall":{wall!r}}}')


def step_line_plain(update: int, charge: float, used: float, wall: float, loss: float, rows: str, seen: str,
                    cpu_charges: bool, lrs: list[float | None] | None = None) -> str:
    """The plain twin of ``step_line``: the same line through ``json.dumps``."""
    rates = None if lrs is None else [lr if lr is not None and lr - lr == 0.0 else None for lr in lrs]
    return json.dumps({"charge": charge, "cpu": charge if cpu_charges else None, "loss": loss, "lrs": rates,
                       "rows": rows, "seen": seen, "update": update, "used": used, "wall": wall},
                      separators=(",", ":"), allow_nan=True, sort_keys=True)


# --------------------------------------------------------------------------------------------------------------
# records as dataclasses

def _from_json(cls, data: Any, what: str, advice: str = DAMAGED):
    """``cls`` from a JSON object, refusing a missing field, a value of another type or another format in one
    sentence naming ``what`` and ending in ``advice``."""
    if not isinstance(data, dict):
        raise RecordDamaged(f"{what} is not a JSON object; {advice}")
    version = data.get("format", 1)
    if version != FORMAT_VERSION:
        raise RecordDamaged(f"{what} has format {version!r}, which this opalctl does not read (it reads "
                            f"{FORMAT_VERSION})")
    known = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
    if missing:
        raise RecordDamaged(f"{what} lacks {', '.join(missing)}; {advice}")
    hints = typing.get_type_hints(cls)
    wrong = [name for name in known if name in data and not _is_a(data[name], hints[name])]
    if wrong:
        raise RecordDamaged(f"{what} holds a value of the wrong type in {', '.join(sorted(wrong))}; {advice}")
    return cls(**{key: value for key, value in data.items() if key in known})


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's type (``int``, ``float``, ``str``, ``bool``, ``None``, ``Any``, unions,
    ``list[T]`` and ``dict[str, T]``); a JSON integer is a float too, a boolean is no number."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, option) for option in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_is_a(entry, item) for entry in value)
    if origin is dict:
        _key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(isinstance(k, str) and _is_a(v, item) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


class _Record:
    """A record's JSON form: its fields as a dict, and back (``WHAT`` names it in a refusal)."""

    WHAT = "a record"
    MAX_BYTES = RECORD_MAX_BYTES

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, what: str | None = None, advice: str = ""):
        return _from_json(cls, data, what or cls.WHAT, advice or DAMAGED)


@dataclass(frozen=True)
class StageFacts(_Record):
    """What the training process knows when an update reaches one or more stages (the same for each of them),
    sent to the evaluator with the stage: these fields are ``StageRecord``'s of the same names, reported as the
    training process's account."""

    WHAT = "the stage facts"

    update: int
    budget_used: float
    budget_fraction_used: float
    examples: int
    train_cpu_seconds: float
    train_wall_seconds: float
    loss: float | None  # the last update's training loss
    format: int = FORMAT_VERSION

    def fields(self) -> dict[str, Any]:
        """The fields a stage record takes over."""
        return {key: value for key, value in asdict(self).items() if key != "format"}

    @classmethod
    def of(cls, record: StageRecord) -> StageFacts:
        """The facts a stage record took over (a resume's stage, judged again from them)."""
        return cls(**{field.name: getattr(record, field.name) for field in fields(cls) if field.name != "format"})


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
    metrics: dict[str, float | int | None]  # None: a value that was not finite (a diverged model's loss)
    eval_seconds: float
    incumbent_before: int | str  # a stage number, or "anchor"
    decision: dict[str, Any]  # promotion.Decision.to_json()
    promoted: bool
    incumbent_after: int | str
    shared_state_with: list[int]  # other stages reached by the same update (same weights)
    loss: float | None  # the last update's training loss before this stage
    format: int = FORMAT_VERSION
    # the digest of the anchor record it was judged against (``anchor_sha256``); None: written before the chain
    anchor_sha256: str | None = None
    # the CPU seconds the kernel counted for the training process (every thread) from the start of the run to this
    # stage, read by the evaluator (driver/kernel_account.py); None where it cannot be read or before it was
    process_cpu_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("anchor_sha256", "process_cpu_seconds"):
            if data[key] is None:
                del data[key]  # a record written before the field reads back to its own bytes
        return data


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
    # the seconds agent code ran in the training process, {"inside_updates": {"cpu", "wall"}, "outside_updates":
    # {"cpu", "wall"}}: inside the timed updates (its steps and analysis) and outside them (loading and building
    # programs at decisions, state_dict() at checkpoints, load_state_dict() at resumes; the formal run charges the
    # outside seconds to the budget); None: a record written before they were measured
    agent_code_seconds: dict[str, dict[str, float]] | None = None


@dataclass
class HostDecisionRecord(_Record):
    """``agent/decisions/NNN/answer.json``: one decision as the agent host saw it, written by the host process
    beside the request as received and the files it answered (opal/records.py ``HostRecords``). ``programs`` and
    ``running`` give the sha256 of each program file's text answered and received, so that a file edited after the
    host wrote it is seen."""

    WHAT = "a decision record of the agent host"

    decision: int
    backend: str  # the backend's name, as its recipe says
    seconds: float  # from the request read to the answer written, in the host
    usage: dict[str, Any]
    cost_usd: float
    failed: str | None  # why the decision failed (the programs answered are then the running ones)
    unreadable: str | None  # why the programs the agent left cannot be loaded (a link, a folder, not UTF-8, ...)
    programs: dict[str, str]  # updater.py / analysis.py -> the sha256 of the text answered
    running: dict[str, str]  # updater.py / analysis.py -> the sha256 of the running program the request carried
    swept: list[str]  # what the sweep of the workspace did after the decision
    format: int = FORMAT_VERSION
    # where a remote backend's answer was worked (the mailbox backend): request, server, host, round_trip_seconds,
    # answer_seconds and the answers refused on the way; None for a backend that answered in the host
    remote: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["remote"] is None:
            del data["remote"]  # a local decision's record reads as it did before the field
        return data


@dataclass
class HostRefusal(_Record):
    """One line of ``agent/refused.jsonl``: a request the agent host refused, as it saw it (the names of the
    request's keys, never their values: a refused request is not followed, and its paths are not written)."""

    WHAT = "a refusal of the agent host"

    op: Any
    id: Any
    keys: list[str]
    refused: str  # the sentence the host answered
    format: int = FORMAT_VERSION


@dataclass(frozen=True)
class HostStart(_Record):
    """The first line of an agent host's input (opal/agents/host.py), from the training process or a mailbox
    server: the backend's ``recipe`` (its name in ``backend``), the host's ``workspace`` and ``records`` folders
    (absolute paths, fixed for the host's life), the time ``limit`` of one decision in seconds, and the ``secrets``
    it redacts beside a key the recipe gives."""

    WHAT = "the agent host's start"

    recipe: dict[str, Any]
    workspace: str
    records: str
    limit: float
    secrets: list[str]
    op: str = "start"


@dataclass(frozen=True)
class HostDecide(_Record):
    """A decision asked of the agent host: its number ``id`` (above every one asked before), the ``message`` and
    ``facts`` the agent reads, and the running ``programs`` by file name. Nothing else, and no path: the host
    refuses a request that names any other key (``HOST_DECIDE_KEYS``)."""

    WHAT = "a decision asked of the agent host"

    id: int
    message: str
    facts: dict[str, Any]
    programs: dict[str, str]
    op: str = "decide"


HOST_DECIDE_KEYS = frozenset(field.name for field in fields(HostDecide))


@dataclass(frozen=True)
class HostCancel(_Record):
    """Stop working on decision ``id`` (its worker is killed; the host does not reply)."""

    WHAT = "a cancel asked of the agent host"

    id: int
    op: str = "cancel"


HOST_CANCEL_KEYS = frozenset(field.name for field in fields(HostCancel))


@dataclass(frozen=True)
class HostReply(_Record):
    """The agent host's reply to decision ``id``: its ``answer`` (``Answer.to_json()``, with the programs as the
    agent left them), or the sentence it ``refused`` the request with; the JSON holds the one it is."""

    WHAT = "a reply of the agent host"

    id: int
    answer: dict[str, Any] | None = None
    refused: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, **({"refused": self.refused} if self.refused is not None else {"answer": self.answer})}


@dataclass(frozen=True)
class WorkerQuestion(_Record):
    """What the agent host hands one worker process (opal/agents/worker.py) on its standard input: the backend's
    ``recipe``, the host's own ``workspace``, the ``message`` and ``facts`` of the decision, and what the backend
    carries over from its previous decision (``carry``: a session, say)."""

    WHAT = "a question to an agent worker"

    recipe: dict[str, Any]
    workspace: str
    message: str
    facts: dict[str, Any]
    carry: dict[str, Any]


@dataclass(frozen=True)
class WorkerAnswer(_Record):
    """A worker's one line of output: its ``answer`` (``Answer.to_json()``; a failure is a failed answer) and what
    its backend carries over to the next decision."""

    WHAT = "an agent worker's answer"

    answer: dict[str, Any]
    carry: dict[str, Any]


@dataclass
class MailboxRequest(_Record):
    """``requests/ID.json`` of a mailbox: one decision asked by a training job's agent host, for any server of
    ``backend`` to answer (opal/mailbox/box.py). ``backend`` is the answering backend's recipe without a key or a
    server address (a server uses its own); ``run`` tells the runs sharing the mailbox apart, ``label`` names the
    run for people; ``deadline`` is when the training side stops waiting (seconds since the epoch)."""

    WHAT = "a mailbox request"

    request: str
    run: str
    label: str
    decision: int
    asked_at: float
    deadline: float
    backend: dict[str, Any]
    message: str
    facts: dict[str, Any]
    programs: dict[str, str]
    format: int = FORMAT_VERSION


@dataclass
class MailboxAnswer(_Record):
    """``answers/ID.json`` of a mailbox: a server's answer to one request, created once (a second answer to the
    request cannot be written). It names the request, its run and the sha256 of the request's bytes, so that an
    answer to anything else is refused; ``answer`` is an ``Answer.to_json()``."""

    WHAT = "a mailbox answer"

    request: str
    run: str
    request_sha256: str
    server: str
    host: str
    answered_at: float
    seconds: float
    answer: dict[str, Any]
    format: int = FORMAT_VERSION


@dataclass
class MailboxLease(_Record):
    """``leases/ID.NNNNNN`` of a mailbox: generation NNNNNN of a server's hold on request ID, until ``expires``
    (seconds since the epoch, renewed while it works)."""

    WHAT = "a mailbox lease"
    MAX_BYTES = 4096

    request: str
    server: str
    host: str
    pid: int
    expires: float


@dataclass
class NoteRecord(_Record):
    """``notes/NNN.json``: a note a person left for the agent of a run (``opalctl say``, opal/notes.py), shown at the
    next decision the run asks; the training process reads it as hostile (bounded, no link, this shape)."""

    WHAT = "a note for the agent"

    note: int  # its number in the run, from 1
    text: str
    who: str  # user@host of the person who left it
    at: str  # when, UTC, ISO 8601
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


# --------------------------------------------------------------------------------------------------------------
# the evaluator's messages: a request ``{"kind": K, "body": ...}`` and one answer ``{"ok": ...}`` each, over a
# pipe between the training process and its evaluator (driver/evaluator.py is their one reader and writer)

@dataclass(frozen=True)
class Opening(_Record):
    """``OPEN``'s body: what the evaluator needs to start, sent by the training process before any agent code
    exists in it."""

    WHAT = "the evaluator's opening"

    lock: str
    lock_sha256: str
    arm: str
    seed: int
    run_dir: str
    anchor_dir: str
    sys_path: list[str]  # where the task's module is found (a test's or a user's folder)


@dataclass(frozen=True)
class Starting(_Record):
    """``START``'s body: how the run started, sent before any agent program can have run in the training process.
    ``initial`` is ``initial.pt`` as ``start.json`` names it (None on a resume, whose start record is there
    already); ``inherited``, ``initialised`` and ``groups`` are the build's, for a new run; ``confinement`` the
    one the training process applied, ``host`` where it runs. They become ``StartRecord``'s fields of the same
    names."""

    WHAT = "the start sent"

    confinement: dict[str, Any] | None
    initial: dict[str, Any] | None
    inherited: Any
    initialised: Any
    groups: list[dict[str, Any]] | None
    host: str


@dataclass(frozen=True)
class CarriedStages(_Record):
    """``CARRIED``'s body: the stages a resume checkpoint has passed, and its update."""

    WHAT = "the carried stages sent"

    stages: int
    update: int


@dataclass(frozen=True)
class StageSaved(_Record):
    """A stage checkpoint as the training process says it saved it: the fraction's index (the stage number is
    index + 1) and the file's digests and size, a claim the evaluator checks against the file the layout puts
    there (no path is ever sent)."""

    WHAT = "a stage checkpoint sent"

    index: int
    sha256: str
    model_sha256: str
    bytes: int

    @classmethod
    def of(cls, index: int, checkpoint: dict[str, Any]) -> StageSaved:
        """Stage ``index``'s from a checkpoint's record (``checkpoints.save``'s, a stage record's ``checkpoint``)."""
        return cls(index=index, **{field.name: checkpoint[field.name] for field in fields(cls)
                                   if field.name != "index"})


@dataclass(frozen=True)
class StageReached(_Record):
    """``STAGE``'s body: the stages one update reached (they share its weights) and the training facts there."""

    WHAT = "the stage sent"

    saved: list[StageSaved]
    facts: StageFacts

    def to_json(self) -> dict[str, Any]:
        return {"saved": [entry.to_json() for entry in self.saved], "facts": self.facts.to_json()}

    @classmethod
    def from_json(cls, data: Any, what: str | None = None, advice: str = "") -> StageReached:
        what, advice = what or cls.WHAT, advice or DAMAGED
        if not isinstance(data, dict) or not isinstance(data.get("saved"), list):
            raise RecordDamaged(f"{what} is not a JSON object with a list of saved stages; {advice}")
        return cls(saved=[StageSaved.from_json(entry, advice=advice) for entry in data["saved"]],
                   facts=StageFacts.from_json(data.get("facts"), what=f"the stage facts of {what}", advice=advice))


@dataclass(frozen=True)
class RecordedStage(_Record):
    """One stage the evaluator judged and recorded (``stage-NN.json``), as the training process may learn it:
    ``said``, the outcome in words, only for an arm without an agent (agent code learns no result it could act
    on), else None."""

    WHAT = "a recorded stage"

    stage: int
    said: str | None


@dataclass(frozen=True)
class StageVerdict(_Record):
    """``STAGE``'s answer: the stages it recorded, in order."""

    WHAT = "the evaluator's verdict on a stage"

    stages: list[RecordedStage]

    def to_json(self) -> dict[str, Any]:
        return {"stages": [stage.to_json() for stage in self.stages]}

    @classmethod
    def from_json(cls, data: Any, what: str | None = None, advice: str = "") -> StageVerdict:
        what, advice = what or cls.WHAT, advice or DAMAGED
        if not isinstance(data, dict) or not isinstance(data.get("stages"), list):
            raise RecordDamaged(f"{what} is not a JSON object with a list of stages; {advice}")
        return cls(stages=[RecordedStage.from_json(entry, advice=advice) for entry in data["stages"]])


@dataclass(frozen=True)
class Acknowledged(_Record):
    """The answer of a request done with nothing to tell (``OPEN``: the anchor is ready; ``START``: the start is
    recorded or checked; ``CARRIED``: the carried stages are judged again and hold)."""

    WHAT = "the evaluator's acknowledgement"


@dataclass(frozen=True)
class Closed(_Record):
    """``CLOSE``'s answer: ``report.json`` as the evaluator wrote it."""

    WHAT = "the evaluator's close"

    report: dict[str, Any]


class Message:
    """The kinds of request, in the order a run sends them (``START`` once, ``CARRIED`` only on a resume), the
    record each one's body is (``BODIES``) and the record its answer is (``ANSWERS``): ``OPEN`` (an
    ``Opening``, answered once the anchor is evaluated or its record checked), ``START`` (``Starting``: a new
    run's ``start.json`` is written, a resumed run's checked), ``CARRIED`` (``CarriedStages``), ``STAGE``
    (``StageReached``, answered by a ``StageVerdict``) and ``CLOSE`` (``TrainingFacts``, answered with the report
    written)."""

    OPEN = "open"
    START = "start"
    CARRIED = "carried"
    STAGE = "stage"
    CLOSE = "close"
    ALL = (OPEN, START, CARRIED, STAGE, CLOSE)
    BODIES: dict[str, type[_Record]] = {OPEN: Opening, START: Starting, CARRIED: CarriedStages,
                                        STAGE: StageReached, CLOSE: TrainingFacts}
    ANSWERS: dict[str, type[_Record]] = {OPEN: Acknowledged, START: Acknowledged, CARRIED: Acknowledged,
                                         STAGE: StageVerdict, CLOSE: Closed}


@dataclass
class RunReport(_Record):
    """``report.json``: the figures of a finished run (written once, at its end)."""

    WHAT = "a run report"
    MAX_BYTES = REPORT_MAX_BYTES

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
    # RunDigests.to_json(): the end of the chain of digests; None: written before the chain
    digests: dict[str, Any] | None = None
    # the machine while the run trained (driver/sharing.py's MachineWatch.to_json()); None where not measured
    machine: dict[str, Any] | None = None
    # the processes of its torchrun world (driver/ranks.py); a single-process run's report leaves it out
    ranks: int = 1
    # the training process as the kernel counted it, read by the evaluator (driver/kernel_account.py): cpu_seconds
    # (every thread, from the run's start to its close, all sessions), peak_rss_bytes; None where not measured
    process: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key, absent in (("peak_device_memory_bytes", None), ("ranks", 1), ("process", None)):
            if data[key] == absent:
                del data[key]  # only a CUDA run has a device peak, a torchrun run ranks, a measured run process
        return data


@dataclass
class RunDigests(_Record):
    """``report.json``'s ``digests``: the sha256 of every record the verdict rests on (module docstring)."""

    WHAT = "the report's digests"

    start: str  # start.json
    steps: str | None  # steps.jsonl.gz (None: the run has no steps file)
    stages: dict[str, str]  # "stage-01.json" -> its sha256, every stage
    last: str  # last.json
    selected: str  # selected.json
    anchor: str  # anchor_sha256 of anchors/seed-S/anchor.json
    report: str = ""  # report_sha256: the report without this entry ("" until it is sealed)


def report_sha256(report: dict[str, Any]) -> str:
    """The digest of a report's content: the report with ``digests.report`` left out."""
    digests = {key: value for key, value in (report.get("digests") or {}).items() if key != "report"}
    return record_sha256({**report, "digests": digests})


@dataclass
class StartRecord(_Record):
    """``start.json``: what a run starts from (written before its first update, by driver/run.py)."""

    WHAT = "a start record"

    lock: str
    lock_sha256: str
    protocol: str
    arm: str
    seed: int
    budget: dict[str, Any]  # clock, total, fractions, threads
    initial: dict[str, Any]  # file, sha256, model_sha256 of initial.pt
    anchor: dict[str, Any]  # folder (relative to the run folder), model_sha256
    arm_config: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    inherited: Any = None
    initialised: Any = None
    confinement: dict[str, Any] | None = None
    started_at: str | None = None
    host: str | None = None
    format: int = FORMAT_VERSION
    ranks: int = 1  # its torchrun world (driver/ranks.py); written only when above 1
    # an arm with parameter groups (arms.NAME.groups): each torch group in order (the order of a steps line's
    # ``lrs``), with its parameters' names, its learning rate before any schedule and its weight decay; written only
    # for such an arm (driver/groups.group_records)
    groups: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["ranks"] == 1:
            del data["ranks"]
        if data["groups"] is None:
            del data["groups"]
        return data


@dataclass
class AnchorRecord(_Record):
    """``anchors/seed-S/anchor.json``: the parent's metrics, evaluated once per lock and seed (driver/evaluator.py)."""

    WHAT = "an anchor record"

    lock_sha256: str
    seed: int
    parent: dict[str, Any]  # path, sha256
    data: dict[str, str]  # the lock's data roles -> sha256
    model_sha256: str
    metrics: dict[str, float | int]
    eval_seconds: float
    sha256: str | None = None  # anchor_sha256 of this record; None: written before the chain
    format: int = FORMAT_VERSION


def anchor_sha256(anchor: dict[str, Any]) -> str:
    """The digest of an anchor record's content: all of it but its own digest, its format and ``eval_seconds``
    (how long it took is no part of what it says)."""
    return record_sha256({key: value for key, value in anchor.items()
                          if key not in ("sha256", "format", "eval_seconds")})


@dataclass
class LastRecord(_Record):
    """``last.json``: the last stage and its checkpoint (driver/closing.py)."""

    WHAT = "a last-stage record"

    stage: int
    update: int
    file: str
    sha256: str
    model_sha256: str
    bytes: int | None = None


@dataclass
class SelectedRecord(_Record):
    """``selected.json``: the model the promotion policy hands over: a stage, or the anchor, flagged."""

    WHAT = "a selected-model record"

    source: str  # "stage" or "anchor"
    stage: int | None
    flagged: bool
    checkpoint: dict[str, Any]  # file, sha256, model_sha256
    metrics: dict[str, float | int | None]  # None: not finite (as in the stage record)
    reason: str | None = None  # why the anchor is selected; a selected stage's record has none

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["reason"] is None:
            del data["reason"]
        return data

    def summary(self) -> dict[str, Any]:
        """What ``report.json``'s ``selected`` says of it."""
        return {"source": self.source, "stage": self.stage, "flagged": self.flagged}


# --------------------------------------------------------------------------------------------------------------
# reading record files

def record_sha256(value: Any) -> str:
    """The sha256 of a record as opalctl writes it (``files.canonical_json``): its file's sha256, unchanged."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def decode_record(data: bytes) -> tuple[Any, str | None]:
    """A record file's bytes as JSON: ``(value, None)``, or ``(None, why)`` with ``why`` a clause ("is empty", "is
    nested deeper than 64 levels"; ``files.decode_json``)."""
    if not data.strip():
        return None, "is empty"
    try:
        return decode_json(data), None
    except JSONRefused as why:
        return None, str(why)


def read_bounded(path: str | Path, limit: int, advice: str = DAMAGED) -> bytes:
    """The bytes of a file opalctl reads back (``files.read_plain``: a regular file, never a link, a FIFO or a
    device, of at most ``limit`` bytes), else ``RecordDamaged`` in one sentence naming it and ending in ``advice``."""
    try:
        return read_plain(path, limit)
    except FileNotFoundError:
        raise RecordDamaged(f"{path} is missing; {advice}") from None
    except NotAPlainFile as why:
        raise RecordDamaged(f"{path} cannot be read ({why}); {advice}") from None
    except OSError as error:
        raise RecordDamaged(f"{path} cannot be read ({error.strerror or error}); {advice}") from None


def read_record(path: str | Path, cls: type | None = None, advice: str = DAMAGED, limit: int | None = None) -> Any:
    """A JSON record file, as ``cls`` when given; refused as ``RecordDamaged`` in one sentence naming the file and
    ending in ``advice`` when it is missing, not a regular file, over ``limit`` (else ``cls.MAX_BYTES``), empty,
    not UTF-8, not JSON, nested too deep or (with ``cls``) not of that shape."""
    path = Path(path)
    data = read_bounded(path, limit or getattr(cls, "MAX_BYTES", RECORD_MAX_BYTES), advice)
    value, why = decode_record(data)
    if why is not None:
        raise RecordDamaged(f"{path} {why}; {advice}")
    return value if cls is None else cls.from_json(value, what=str(path), advice=advice)


def read_jsonl(path: str | Path, limit: int = EVENTS_MAX_BYTES) -> Iterator[dict[str, Any]]:
    """Each JSON object of a ``.jsonl`` file (of at most ``limit`` bytes, read as ``read_bounded`` reads), in
    order. A last line cut short by a crash (no newline at its end, or not JSON) is skipped; any other line that is
    not a JSON object is damage, refused naming file and line."""
    path = Path(path)
    data = read_bounded(path, limit)
    lines = data.split(b"\n")
    torn_tail = not data.endswith(b"\n")  # the last piece is "" for a complete file
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = number == len(lines)
        try:
            value = decode_json(raw)
        except JSONRefused as why:
            if last and torn_tail:
                return
            raise RecordDamaged(f"{path} line {number} {why}; the record is damaged") from None
        if not isinstance(value, dict):
            if last and torn_tail:
                return
            raise RecordDamaged(f"{path} line {number} is not a JSON object; the record is damaged")
        yield value


def finite_or_none(value: float | None) -> float | None:
    """A JSON-safe float: non-finite values become None (``report.json`` is strict JSON)."""
    return value if value is not None and math.isfinite(value) else None
