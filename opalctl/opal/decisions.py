"""The decisions: when the agent is asked (the schedule, wake-ups, one decision in flight, reasons queued behind
it, the cost cap), how it is asked (in the foreground, or in the background while training goes on), and what
becomes of its answer (``apply`` returns an ``Outcome``; every outcome is an event and a ``decisions/NNN``
folder of the training process's account).

Where the work happens is the ``AgentLine``'s. A backend that runs agent code or talks to the network answers in
the agent host (``HostedLine``, ``opalctl.opal.agents.host``), blocking or not, the same answers either way: the
training process sends the running programs' text, the message and the facts, never a path, and never touches
the host's workspace; it loads exactly the programs the answer carries (the static check, the guard and the trial
as for any program), and the host records each decision as it saw it. A backend that does neither (``keep``, a
callable given to ``wrap()``: the user's code, not an agent's) answers here (``LocalLine``) in a workspace of its
own, whose programs are read back never following a link and refusing a program that is no regular UTF-8 file (a
load failure with the sentence); the training process then records the decision's texts itself.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.formats import Event
from opalctl.layout import WORKSPACE, version_name
from opalctl.opal.agents import Answer
from opalctl.opal.agents.host import AgentHost, limit_of, scrub_environment
from opalctl.opal.agents.workspace import META_FOLDER, programs_in, real_folder, write_file_here
from opalctl.opal.estimate import MEASURED_MODEL, decision_usd
from opalctl.opal.messages import rebin, render
from opalctl.opal.notes import read_new
from opalctl.opal.prices import price_dict
from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import FACTS, MESSAGE, RESPONSE, TRANSCRIPT, line_changes, program_sha256, redact_json
from opalctl.opal.schedule import DecisionSchedule, decision_fractions
from opalctl.opal.settings import AgentSettings
from opalctl.opal.slots import ProgramSlots, Version

DEFAULT_ANSWER_SECONDS = 27.0  # how long an answer is expected to take before any has been timed
ANSWER_SECONDS_KEPT = 64
NO_LIMIT = 1 << 62


@dataclass
class DecisionCounts:
    asked: int = 0
    applied: int = 0
    kept: int = 0
    load_failed: int = 0
    failed: int = 0
    waiting_seconds: float = 0.0  # training waited for the agent
    agent_seconds: float = 0.0  # the agent worked (waited for or not)
    cost_usd: float = 0.0
    wakes: int = 0


@dataclass
class InFlight:
    """A decision asked in the background, until its answer is applied."""

    number: int
    message: str
    facts: dict[str, Any]
    files: dict[str, str]  # the running programs the question was asked with
    started: float
    requested_at: int
    reason: str
    result: Answer | None = None
    thread: threading.Thread | None = None  # a backend that answers here, in the background
    notes_before: int = 0  # the last note read before this decision (a resume asks it again, with its notes)


@dataclass(frozen=True)
class Outcome:
    """What became of an answer: an ``Event.OUTCOMES`` kind, and the version it made (applied or not loaded)."""

    kind: str
    decision: int
    version: int | None = None


class HostedBackend:
    """What the training process keeps of a backend whose decisions run in the agent host: its name, its
    description and its time limit (the backend itself, and any key it holds, stay out of this process)."""

    runs_in = "host"

    def __init__(self, backend):
        self.name = backend.name
        self.description = backend.describe()
        self.seconds_per_decision = backend.seconds_per_decision

    def describe(self) -> dict[str, Any]:
        return dict(self.description)


class AgentLine:
    """The line to the agent as the training process holds it: the backend (or what is kept of a hosted one), the
    message it reads, and how a question is sent and its answer collected (``LocalLine``, ``HostedLine``; build one
    with ``make_line``). Everything it writes goes through the training process's redaction."""

    keeps_texts = False  # whether the training process records the message, the response and the transcript

    def __init__(self, backend, prompt_text: str, redaction: Callable[[str], str]):
        self.backend = backend
        self.prompt_text = prompt_text
        self.redaction = redaction
        self.limit = limit_of(backend)

    def prepare(self, facts: dict[str, Any], files: dict[str, str]) -> tuple[str, dict[str, Any]]:
        """The message the agent reads and the facts, both redacted."""
        message = self.redaction(self.prompt_text + "\n\n" + render(facts, files))
        return message, redact_json(json.loads(json.dumps(facts, sort_keys=True, default=float)), self.redaction)

    def call(self, number: int, message: str, facts: dict[str, Any], files: dict[str, str]) -> Answer:
        """Decision ``number``, waited for: the answer, with the programs as the agent left them."""
        raise NotImplementedError

    def start(self, inflight: InFlight) -> None:
        raise NotImplementedError

    def collect(self, inflight: InFlight, wait: bool) -> tuple[Answer | None, float]:
        """The answer of a decision in flight (None while it works) and the seconds spent waiting for it."""
        raise NotImplementedError

    def abandon(self, inflight: InFlight) -> None:
        """Stop working on a decision in flight."""

    def close(self) -> None:
        """The agent is done."""


class LocalLine(AgentLine):
    """A backend that answers in this process (``keep``, a user's callable): a workspace of its own (``run_dir/
    workspace``, or a temporary folder removed by ``close``), the running programs and the facts written into it
    before each decision and the programs read back after it; a non-blocking decision runs in a thread."""

    keeps_texts = True

    def __init__(self, backend, prompt_text: str, redaction: Callable[[str], str], workspace: Path, scratch: bool):
        super().__init__(backend, prompt_text, redaction)
        self.workspace = real_folder(workspace)
        self.scratch = scratch

    def prepare(self, facts: dict[str, Any], files: dict[str, str]) -> tuple[str, dict[str, Any]]:
        """Also put the running programs and the facts in the workspace (a link left in the place of one is
        replaced, never followed)."""
        message, facts = super().prepare(facts, files)
        root = real_folder(self.workspace)
        for name in PROGRAM_FILES:
            write_file_here(root / name, files[name].encode("utf-8"))
        meta = real_folder(root / META_FOLDER)
        write_file_here(meta / FACTS, json.dumps(facts, sort_keys=True, default=float).encode("utf-8"))
        write_file_here(meta / MESSAGE, message.encode("utf-8"))
        return message, facts

    def call(self, number: int, message: str, facts: dict[str, Any], files: dict[str, str]) -> Answer:
        try:
            answer = self.backend.decide(self.workspace, message, facts)
            answer = answer if isinstance(answer, Answer) else Answer(rationale=str(answer))
        except Exception as error:  # the agent's failure is an event, never the end of training
            return Answer(rationale="", failed=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")
        if not answer.failed:
            answer.programs, answer.unreadable = programs_in(real_folder(self.workspace))
        return answer

    def start(self, inflight: InFlight) -> None:
        def work() -> None:
            inflight.result = self.call(inflight.number, inflight.message, inflight.facts, inflight.files)

        inflight.thread = threading.Thread(target=work, name="opal-decision", daemon=True)
        inflight.thread.start()

    def collect(self, inflight: InFlight, wait: bool) -> tuple[Answer | None, float]:
        started = time.perf_counter()
        if wait:
            inflight.thread.join()
        waited = time.perf_counter() - started if wait else 0.0
        if inflight.thread.is_alive():
            return None, waited
        return inflight.result, waited

    def close(self) -> None:
        if self.scratch:
            shutil.rmtree(self.workspace, ignore_errors=True)


class HostedLine(AgentLine):
    """A backend that runs agent code or talks to the network: its decisions run in the agent host, whose workspace
    and records are ``agent_dir`` (``workspace/``, ``decisions/``), fixed when it starts (a temporary folder removed
    by ``close`` when ``scratch``). Once the host is up, this process's environment loses its secret-looking
    variables for good (the host holds them; ``close`` does not put them back)."""

    def __init__(self, backend, prompt_text: str, redaction: Callable[[str], str], agent_dir: Path, scratch: bool,
                 secrets: list[str] | None = None):
        super().__init__(backend, prompt_text, redaction)
        self.agent_dir, self.scratch = Path(agent_dir), scratch
        self.host = AgentHost(backend.recipe(), workspace=self.agent_dir / WORKSPACE, records=self.agent_dir,
                              limit=self.limit, secrets=list(secrets or []))
        self.backend = HostedBackend(backend)
        scrub_environment()  # the host holds the keys now; neither programs nor later children see them

    def call(self, number: int, message: str, facts: dict[str, Any], files: dict[str, str]) -> Answer:
        self.host.ask(number, message, facts, files)
        return self.host.answer(number, wait=True, seconds=self.limit)

    def start(self, inflight: InFlight) -> None:
        self.host.ask(inflight.number, inflight.message, inflight.facts, inflight.files)

    def collect(self, inflight: InFlight, wait: bool) -> tuple[Answer | None, float]:
        started = time.perf_counter()
        answer = self.host.answer(inflight.number, wait=wait, seconds=self.limit)
        return answer, (time.perf_counter() - started if wait else 0.0)

    def abandon(self, inflight: InFlight) -> None:
        self.host.cancel(inflight.number)

    def close(self) -> None:
        self.host.stop()
        if self.scratch:
            shutil.rmtree(self.agent_dir, ignore_errors=True)


def make_line(backend, prompt_text: str, redaction: Callable[[str], str], *, run_dir: Path | None,
              agent_dir: Path | None, secrets: list[str] | None = None) -> AgentLine:
    """The line for ``backend``: a ``HostedLine`` when its decisions run in the agent host (its folder ``agent_dir``,
    else ``run_dir/agent``, else a temporary one), a ``LocalLine`` otherwise (its workspace ``run_dir/workspace``,
    else a temporary one)."""

    if backend.runs_in == "host":
        folder = agent_dir if agent_dir is not None else (run_dir / "agent" if run_dir is not None else None)
        scratch = folder is None
        folder = Path(tempfile.mkdtemp(prefix="opal-agent-")) if scratch else Path(folder)
        return HostedLine(backend, prompt_text, redaction, folder, scratch, secrets)
    scratch = run_dir is None
    workspace = Path(tempfile.mkdtemp(prefix="opal-workspace-")) if scratch else run_dir / WORKSPACE
    return LocalLine(backend, prompt_text, redaction, workspace, scratch)


def answered_programs(answer: Answer) -> tuple[dict[str, str], str | None]:
    """The programs an answer carries, as the training process loads them, and why they cannot be loaded (None: they
    can be tried)."""
    programs = answer.programs or {}
    files = {name: programs.get(name, "") for name in PROGRAM_FILES}
    if answer.programs is None or any(name not in programs for name in PROGRAM_FILES):
        return files, (answer.unreadable or "the answer carried no programs (updater.py and analysis.py); the "
                                            "decision is not applied")
    return files, answer.unreadable


@dataclass
class _Asked:
    """One answer to apply, and the figures its records carry."""

    number: int
    answer: Answer
    message: str
    requested_at: int
    seconds: float
    waited: float


@dataclass(frozen=True)
class CostCap:
    """The cost cap (``max_cost_usd``; None: none) and what a decision is expected to cost: the mean cost of the
    decisions answered so far, or, before any has cost something, the typical cost ``opalctl.opal.estimate`` gives
    for a first or a later decision of the model the backend calls (``priced_as``), at the backend's prices or the
    one price table's (``opalctl.opal.prices``). A backend that names no model (``heuristic``, ``keep``, ``replay``,
    a callable, ``claude-code`` without ``model``) is priced as the measured model; one that names a model with no
    price is refused when there is a cap, since its decisions' cost could not be expected."""

    limit: float | None
    priced_as: str
    first_usd: float
    later_usd: float

    @classmethod
    def of(cls, limit: float | None, backend: dict[str, Any]) -> CostCap:
        """The cap for a backend described by ``backend`` (its ``describe()``: ``model``, ``prices`` when it has
        them)."""
        model, prices = backend.get("model"), price_dict(backend.get("prices"))
        named = model or MEASURED_MODEL
        usd = decision_usd(named, prices)
        if usd is None:
            if limit is not None:
                raise BadInput(f"max_cost_usd needs the prices of the agent's model {model!r}, which the price table "
                               f"(opalctl/opal/prices.py) does not list; give its prices (arms.NAME.agent.prices) or "
                               f"leave max_cost_usd out")
            usd = decision_usd(MEASURED_MODEL)
        return cls(limit, named, usd["first"]["typical"], usd["later"]["typical"])

    def expected(self, spent: float, answered: int, *, asked: int) -> float:
        """The expected cost of the next decision, ``asked`` decisions asked so far (``answered`` of them)."""
        if spent > 0 and answered > 0:
            return spent / answered
        return self.later_usd if asked else self.first_usd


@dataclass
class DecisionState:
    """What the decisions carry from one boundary to the next (all plain data but ``inflight``)."""

    wake_reason: str | None = None
    queued_reason: str | None = None
    last_decision_update: int = 0
    unobserved_at_last_decision: int = 0  # the observer's count of updates stepped without a loss, then
    last_change: dict[str, Any] | None = None
    answer_seconds: list[float] = field(default_factory=list)  # how long each answer the agent gave took
    notes_read: int = 0  # the number of the last note a person left that a decision read (opal/notes.py)
    inflight: InFlight | None = None


class Decisions:
    """When to ask, asking, and applying answers. ``describe()`` gives the run's side of the facts shown to the
    agent (progress, total_steps, goal, lrs, shapes); ``progress()`` the budget fraction used now."""

    def __init__(self, settings: AgentSettings, agent: AgentLine, records, slots: ProgramSlots, observer, *,
                 describe: Callable[[], dict[str, Any]], progress: Callable[[], float], cost_cap: CostCap):
        self.schedule = DecisionSchedule(decision_fractions(settings.decisions, settings.schedule), settings.wakes)
        self.notes = settings.notes_dir  # the notes a person leaves (opal/notes.py)
        self.agent = agent
        self.records = records
        self.slots = slots
        self.observer = observer
        self.blocking = settings.blocking
        self.max_lag = settings.max_lag
        self.describe = describe
        self.progress = progress
        self.counts = DecisionCounts()
        self.state = DecisionState()
        self.cost_cap = cost_cap
        self.closing = False

    # -- when ------------------------------------------------------------------------------------------------
    def due(self, progress: float) -> bool:
        """Whether a boundary has anything to do for the decisions (one due or in flight, a wake-up waiting)."""
        state = self.state
        return (state.inflight is not None or state.wake_reason is not None or state.queued_reason is not None
                or self.schedule.due(progress))

    def quiet_until(self, t: int, *, checks_boundaries: bool, total_steps: int | None, counted: bool) -> int:
        """The first update from ``t`` whose step must check for a boundary: ``t`` while a decision is in flight or
        waiting; with ``checks_boundaries`` (``step`` calls ``between_updates`` itself) the update at which the
        next scheduled decision falls due, or ``t`` when progress is not ``counted`` in updates."""
        state = self.state
        if state.inflight is not None or state.wake_reason is not None or state.queued_reason is not None:
            return t
        if not checks_boundaries or not self.schedule.remaining or (counted and not total_steps):
            return NO_LIMIT
        if not counted:
            return t
        fraction = self.schedule.fractions[self.schedule.next_index]
        due = max(t, int(fraction * total_steps) - 1)  # fraction * total_steps >= 0: int() is floor()
        while min(1.0, due / total_steps) < fraction:
            due += 1
        return due

    def wake(self, reason: str, t: int) -> None:
        if self.state.wake_reason is None:
            self.state.wake_reason = reason
            self.records.event(Event.WAKE, update=t, reason=reason)

    def boundary(self, t: int) -> None:
        """Apply an answer that has arrived, and ask when a decision is due (behind one in flight, it waits)."""
        state = self.state
        if state.inflight is not None:
            self.poll(t)
        progress = self.progress()
        reason = None
        if state.wake_reason is not None:
            if self.schedule.can_wake():
                self.schedule.take_wake()
                reason = f"wake: {state.wake_reason}"
                self.counts.wakes += 1
            state.wake_reason = None
        if reason is None and self.schedule.due(progress):
            self.schedule.take(progress)
            reason = "scheduled"
        if reason is None:
            return
        if state.inflight is not None:
            state.queued_reason = reason if state.queued_reason is None else f"{state.queued_reason}; {reason}"
            return
        self.ask(reason, t)

    # -- asking ----------------------------------------------------------------------------------------------
    def over_cost_cap(self, reason: str, t: int) -> bool:
        """True (with a ``skipped`` event) when what is left of the cost cap is below the expected cost of the next
        decision (``CostCap.expected``)."""
        cap = self.cost_cap
        if cap.limit is None:
            return False
        counts = self.counts
        spent = counts.cost_usd
        answered = counts.asked - (1 if self.state.inflight is not None else 0)
        expected = cap.expected(spent, answered, asked=counts.asked)
        if cap.limit - spent >= expected:
            return False
        self.records.event(Event.SKIPPED, update=t, reason="cost cap", asked_for=reason, spent_usd=spent,
                           max_cost_usd=cap.limit, expected_usd=expected, priced_as=cap.priced_as)
        return True

    def expected_lag(self) -> float:
        """Updates an answer is expected to take: the mean time of the answers the agent gave, over the mean step."""
        step = [s for v in self.slots.versions for s in v.step_seconds]
        per_update = statistics.fmean(step) if step else 1e-3
        answers = self.state.answer_seconds
        seconds = statistics.fmean(answers) if answers else DEFAULT_ANSWER_SECONDS
        return seconds / max(per_update, 1e-9)

    def _facts(self, reason: str, number: int, t: int) -> dict[str, Any]:
        run, slots, observer = self.describe(), self.slots, self.observer
        since = [b for b in observer.loss_bins if b["end"] > self.state.last_decision_update]
        step_seconds = slots.current.step_seconds
        timing = {"updater_ms": 1000 * statistics.fmean(step_seconds) if step_seconds else None,
                  "analysis_ms": (1000 * statistics.fmean(observer.analysis_seconds)
                                  if observer.analysis_seconds else None)}
        return {"decision": number, "reason": reason, "update": t, "progress": run["progress"],
                "total_steps": run["total_steps"], "goal": run["goal"], "remaining": self.schedule.remaining,
                "lrs": run["lrs"], "version": slots.current.number, "losses": {"bins": rebin(since)},
                "losses_observed": observer.observed_since(self.state.last_decision_update, t,
                                                           self.state.unobserved_at_last_decision),
                "loss_start": observer.loss_bins[0]["mean"] if observer.loss_bins else None,  # the first interval's
                "report": observer.latest_report, "errors": observer.errors_shown(),
                "last_change": self.state.last_change, "timing": timing,
                "audit": {version_name(n): {k: v for k, v in counts.items() if k in ("ops", "syncs", "top")}
                          for n, counts in sorted(slots.audits.items())},
                "shapes": run["shapes"]}

    def ask(self, reason: str, t: int) -> None:
        if self.over_cost_cap(reason, t):
            return
        self.counts.asked += 1
        number = self.counts.asked
        facts = self._facts(reason, number, t)
        notes_before, noted = self.state.notes_read, {}
        if self.notes is not None:
            taken = read_new(self.notes, notes_before)
            self.state.notes_read = taken.last
            if taken.notes:
                facts["notes"] = taken.shown()
            noted = {"notes": taken.named()} if taken.notes else {}
            noted.update({"notes_refused": taken.refused} if taken.refused else {})
        files = dict(self.slots.current.files)
        message, facts = self.agent.prepare(facts, files)
        self.records.event(Event.REQUESTED, update=t, decision=number, reason=reason,
                           version=self.slots.current.number, **noted)
        self.state.last_decision_update = t
        self.state.unobserved_at_last_decision = self.observer.unobserved.count
        blocking = self.blocking
        if blocking == "auto":
            blocking = number == 1 or self.expected_lag() > self.max_lag
        if "non-finite" in reason:
            blocking = True  # training waits for an answer when the loss is not finite
        started = time.perf_counter()
        if blocking:
            answer = self.agent.call(number, message, facts, files)
            waited = time.perf_counter() - started
            self.counts.waiting_seconds += waited
            self.counts.agent_seconds += waited
            self.apply(_Asked(number, answer, message, requested_at=t, seconds=waited, waited=waited), t)
        else:
            self.state.inflight = InFlight(number=number, message=message, facts=facts, files=files,
                                           started=started, requested_at=t, reason=reason, notes_before=notes_before)
            self.agent.start(self.state.inflight)

    def poll(self, t: int, wait: bool = False) -> None:
        """Apply the answer of the decision in flight if it has arrived (``wait``: wait for it), then ask what
        was queued behind it."""
        state = self.state
        inflight = state.inflight
        answer, waited = self.agent.collect(inflight, wait)
        self.counts.waiting_seconds += waited
        if answer is None:
            return
        seconds = time.perf_counter() - inflight.started
        self.counts.agent_seconds += seconds
        state.inflight = None
        self.apply(_Asked(inflight.number, answer, inflight.message, requested_at=inflight.requested_at,
                          seconds=seconds, waited=0.0), t)
        if state.queued_reason is not None:
            reason, state.queued_reason = state.queued_reason, None
            self.ask(reason, t)

    # -- answers ---------------------------------------------------------------------------------------------
    def apply(self, asked: _Asked, t: int) -> Outcome:
        """Apply one answer at update ``t``: late (after the last update), failed, kept, not loaded, or applied."""
        answer, number = asked.answer, asked.number
        self.counts.cost_usd += answer.cost_usd or 0.0
        # the texts of a decision the agent host answered are its records, not this process's
        keeps_texts = self.agent.keeps_texts
        files = {MESSAGE: asked.message, RESPONSE: answer.rationale or ""} if keeps_texts else {}
        meta = {"decision": number, "requested_at": asked.requested_at, "answered_at": t, "seconds": asked.seconds,
                "waited_seconds": asked.waited, "usage": answer.usage, "cost_usd": answer.cost_usd}
        if self.closing and not answer.failed:
            # the answer came after the last update: there is no boundary left to apply it at
            self.records.event(Event.LATE, update=t, decision=number, seconds=asked.seconds,
                               message="the answer arrived after the last update and was not applied")
            self.records.save_decision(number, files, {**meta, "outcome": Event.LATE})
            return Outcome(Event.LATE, number)
        meta["backend"] = self.agent.backend.describe()
        if answer.transcript and keeps_texts:
            files[TRANSCRIPT] = json.dumps(answer.transcript, indent=1, default=str)
        lines = [line.strip() for line in (answer.rationale or "").strip().splitlines() if line.strip()]
        summary = next((line for line in lines if line.lower().startswith(("changed", "kept"))), "")
        common = {"update": t, "decision": number, "seconds": asked.seconds, "cost_usd": answer.cost_usd,
                  "rationale": lines[0] if lines else "", "summary": summary}
        if answer.failed:
            self.counts.failed += 1
            self.records.event(Event.DECISION_FAILED, message=answer.failed.splitlines()[0], **common)
            self.records.save_decision(number, files, {**meta, "outcome": "failed", "error": answer.failed})
            return Outcome(Event.DECISION_FAILED, number)
        self.state.answer_seconds.append(asked.seconds)
        del self.state.answer_seconds[:-ANSWER_SECONDS_KEPT]
        edited, unreadable = answered_programs(answer)
        meta["programs_sha256"] = {name: program_sha256(text) for name, text in edited.items()}
        if unreadable is not None:
            return self._refuse(edited, unreadable, files, meta, common, t)
        if edited == self.slots.current.files:
            self.counts.kept += 1
            self.records.event(Event.KEPT, version=self.slots.current.number, **common)
            self.records.save_decision(number, files, {**meta, "outcome": Event.KEPT})
            return Outcome(Event.KEPT, number)
        return self._swap(edited, files, meta, common, t)

    def _refuse(self, edited: dict[str, str], problem: str, files: dict[str, str], meta: dict[str, Any],
                common: dict[str, Any], t: int) -> Outcome:
        """A program the workspace cannot give as a regular UTF-8 file (a link, a folder, a fifo, other bytes):
        a load failure with the sentence, and a failed version, as a program the check refused."""
        version = self.slots.refused(edited, t)
        return self._load_failed(version, problem, edited, files, meta, common, t)

    def _load_failed(self, version: Version, rejection: str, edited: dict[str, str], files: dict[str, str],
                     meta: dict[str, Any], common: dict[str, Any], t: int) -> Outcome:
        number = common["decision"]
        self.counts.load_failed += 1
        first = rejection.splitlines()[0]
        self.observer.record_error("load_failed", t, version.number, first, rejection)
        self.records.event(Event.LOAD_FAILED, version=version.number, message=first, **common)
        self.records.save_decision(number, files, {**meta, "outcome": Event.LOAD_FAILED, "error": rejection})
        self.records.save_program(version.number, edited)
        return Outcome(Event.LOAD_FAILED, number, version.number)

    def _swap(self, edited: dict[str, str], files: dict[str, str], meta: dict[str, Any], common: dict[str, Any],
              t: int) -> Outcome:
        number = common["decision"]
        previous = self.slots.current
        version, rejection = self.slots.swap_in(edited, t)
        if rejection is not None:
            return self._load_failed(version, rejection, edited, files, meta, common, t)
        self.counts.applied += 1
        self.records.save_program(version.number, edited)
        changed = [name for name in PROGRAM_FILES if edited[name] != previous.files[name]]
        diff = {name: line_changes(previous.files[name], edited[name]) for name in changed}
        self.records.event(Event.APPLIED, version=version.number, previous=previous.number, files=changed,
                           diff=diff, **common)
        self.records.save_decision(number, files, {**meta, "outcome": Event.APPLIED, "version": version.number,
                                                   "files": changed})
        recent = [b["mean"] for b in self.observer.loss_bins[-4:] if b["mean"] is not None]
        self.state.last_change = {"version": version.number, "decision": number, "applied_at": t, "files": changed,
                                  "outcome": Event.APPLIED,
                                  "loss_before": statistics.fmean(recent) if recent else None}
        return Outcome(Event.APPLIED, number, version.number)

    def reverted(self, version: int, t: int, reason: str) -> None:
        """The version made by the last change failed at ``t``: the agent is told at its next decision."""
        change = self.state.last_change
        if change and change.get("version") == version:
            change.update(outcome="reverted", reverted_at=t, reason=reason)

    # -- the end, and checkpoints ----------------------------------------------------------------------------
    def close(self, t: int, wait: bool) -> None:
        """No boundary is left: a queued reason is skipped; a decision in flight is waited for (its answer is
        late) or abandoned."""
        self.closing = True
        state = self.state
        if state.queued_reason is not None:
            self.records.event(Event.SKIPPED, update=t, reason=state.queued_reason,
                               message="the run ended before this decision could be asked")
            state.queued_reason = None
        if state.inflight is None:
            return
        if wait:
            while state.inflight is not None:
                state.queued_reason = None
                self.poll(t, wait=True)
            return
        self.agent.abandon(state.inflight)
        self.records.event(Event.ABANDONED, update=t, decision=state.inflight.number)
        state.inflight = None

    def state_dict(self) -> dict[str, Any]:
        """A decision in flight is not waited for (a checkpoint must not make a non-blocking run block): the state
        says it was asked, and a run resumed from it asks that decision again at its first boundary."""
        state = self.state
        counts = asdict(self.counts)
        queued = state.queued_reason
        notes_read = state.notes_read
        if state.inflight is not None:
            counts["asked"] -= 1
            notes_read = state.inflight.notes_before
            queued = state.inflight.reason if queued is None else f"{state.inflight.reason}; {queued}"
        return {"schedule": self.schedule.state_dict(), "counts": counts, "wake_reason": state.wake_reason,
                "queued_reason": queued, "last_decision_update": state.last_decision_update,
                "unobserved_at_last_decision": state.unobserved_at_last_decision, "last_change": state.last_change,
                "answer_seconds": list(state.answer_seconds), "notes_read": notes_read}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.schedule.load_state_dict(saved["schedule"])
        self.counts = DecisionCounts(**saved["counts"])
        self.state = DecisionState(wake_reason=saved["wake_reason"], queued_reason=saved["queued_reason"],
                                   last_decision_update=int(saved["last_decision_update"]),
                                   # absent from states saved before the count was carried (it started over too)
                                   unobserved_at_last_decision=int(saved.get("unobserved_at_last_decision", 0)),
                                   last_change=saved["last_change"], answer_seconds=list(saved["answer_seconds"]),
                                   notes_read=int(saved.get("notes_read", 0)))  # absent before notes
