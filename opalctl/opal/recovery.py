"""What the agent optimizer does when agent code fails: ``Recovery``.

A program's step can fail (it raises, it times out, a check of the parameters after it finds a non-finite value or a
changed layout), and what a program made can be unsaveable (its report, its analysis memory, its state, what it
left in the user's optimizer or scheduler). Either way the failing version is reverted to its fallback, what can be
restored is, the agent is told at its next decision, and training goes on: the fallback redoes the same update, and
should the fallback fail too, the starting program takes over. Each outcome is an event in ``events.jsonl``.

``Recovery`` keeps no state of its own: the versions are the slots', the errors shown to the agent and the
rollback state the observer's, the discontinuity the integrity watch's, the decision's outcome the decisions'. It
is the one place that says in which order they are told.
"""

from __future__ import annotations

from typing import Any

from opalctl.formats import Event
from opalctl.opal.guard import StepFailure, StepTimeout, contained, failure_message, failure_text, trace_of
from opalctl.opal.plain import type_name
from opalctl.opal.program_view import StepContext
from opalctl.opal.slots import Snapshot, Version


class Recovery:
    """Reverts a failing version and hands its update to the fallback (see the module docstring)."""

    def __init__(self, slots, observer, integrity, records, decisions, named: dict[str, Any], spec, grads):
        self.slots, self.observer, self.integrity = slots, observer, integrity
        self.records, self.decisions = records, decisions
        self.named, self.spec, self.grads = named, spec, grads

    def step_failed(self, version: Version, error: BaseException, snapshot: Snapshot | None, ctx: StepContext,
                    redo: bool = True) -> None:
        """``version``'s step at update ``ctx.update`` failed: restore what can be, hand over to its fallback,
        and (``redo``) let the fallback do the same update."""
        t, slots = ctx.update, self.slots
        # the error may be a program's: its class is looked at, and its text read, without running its code
        kind = "timeout" if issubclass(type(error), StepTimeout) else ("check" if issubclass(type(error), StepFailure)
                                                                        else "exception")
        message = failure_message(error) or type_name(error)
        trace = "" if kind == "check" else trace_of(error, -4)
        slots.failed_step()
        self.observer.record_error(kind, t, version.number, message, trace,
                                   fallback=slots.fallback_for(version).number, in_trial=version.status == "trial")
        restored, rolled_back = self.observer.restore_after(snapshot, self.named, self.spec)
        if rolled_back:
            self.integrity.discontinuity(t + 1)
        fallback = slots.revert(version)
        self.records.event(Event.REVERTED, update=t, version=version.number, to=fallback.number, reason=kind,
                           message=message, traceback=trace, restored=restored)
        self.decisions.reverted(version.number, t, message)
        if not redo:
            return
        _, second = contained(slots.run_step, fallback, self.grads, t, ctx)
        if second is None:
            return
        # the fallback itself failed: the starting program takes over
        slots.failed_step()
        self.records.event(Event.FAILED_STEP, update=t, version=fallback.number, message=failure_text(second))
        if fallback is not slots.versions[0]:
            if snapshot is not None:
                snapshot.restore(self.named, self.spec)
            slots.run_step(slots.to_start(), self.grads, t, ctx)

    def _fails_now(self, version: Version) -> bool:
        """Whether a problem of ``version`` is a failure of the running program (the agent's, not version 0)."""
        return version is self.slots.current and version is not self.slots.versions[0]

    def output_refused(self, version: Version, problem: str, ctx: StepContext) -> None:
        """What ``version`` made cannot be saved or written (its report or wake-up reason, the analysis memory, what
        it left in the user's optimizer or scheduler): when it runs and is the agent's, it fails now as a step does
        (reverted, the agent told at its next decision); else the agent is told and a ``log`` event says it."""
        if self._fails_now(version):
            self.step_failed(version, StepFailure(problem), None, ctx, redo=False)
            return
        self.records.event(Event.LOG, update=ctx.update, values={"not_saved": problem, "version": version.number})
        self.observer.record_error("check", ctx.update, version.number, problem)

    def state_failed(self, version: Version, problem: str, ctx: StepContext) -> None:
        """``version``'s ``state_dict()`` failed (``ProgramSlots.program_states``): the running one fails as a
        step does; another is only recorded."""
        if self._fails_now(version):
            self.step_failed(version, StepFailure(problem), None, ctx, redo=False)
        else:
            self.records.event(Event.REVERTED, update=ctx.update, version=version.number, to=0, reason="check",
                               message=problem, traceback="", restored="none (it was not running)")
