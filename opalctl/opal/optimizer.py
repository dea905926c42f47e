"""``AgentOptimizer``: a torch optimizer whose update rule is a program an agent may rewrite while it trains.

The optimizer is a thin torch facade over parts that each own their state (and their ``state_dict``):

- ``ProgramSlots`` (``slots``): the versions of the programs, the running one and its fallback, a version's step,
  the trial of a new version, the snapshots a failed step is restored from;
- ``StepGuard`` (``guard``): a step's time limit and the checks of the parameters after it; agent code runs
  through ``guard.contained``, the one place where its failures become results;
- ``Observer`` and ``IntegrityWatch`` (``observer``): the losses (each update's: what ``observe`` fed since the
  step before, summed, plus the step's own; the updates that had none), the analysis, the errors shown to the
  agent, the rollback state, the evaluation-integrity recorder;
- ``Decisions`` (``decisions``): when and how the agent is asked, and what becomes of its answers;
- ``Recovery`` (``recovery``): what a failed step or an unsaveable output does to the others (revert, restore,
  hand the update to the fallback, tell the agent);
- ``UserState`` (``user_state``): the user's optimizer and scheduler as a checkpoint saves them (plain data only).

In the order an update meets them:

- **Boundaries.** Between two updates the optimizer may ask the agent (a scheduled decision, a wake-up from
  the analysis, a non-finite loss) and may switch to a new program version. Agent work never happens inside
  ``step``: a caller that times its updates (the formal run) calls ``between_updates()`` outside its timed
  interval and passes ``manual_boundaries=True``; otherwise ``step`` calls it first.
- **The step.** ``step`` hands the gradients to the running ``updater.py``. A new version runs a *trial*: before
  each trial step the parameters, gradients and optimizer state are copied; if the step fails (an exception, a
  non-finite value, a changed dtype/device/shape, a step over its time limit) the copy is restored and the same
  update is redone by the last version that passed its trial. After the trial a failure hands over to that
  version too, and a non-finite parameter found by the periodic check rolls back to the last checked state.
  Training never dies because of agent code: any exception it raises is its failure (a real Ctrl-C, told apart by
  the SIGINT signal, still stops training), torch's global state is put back after each program call, and a
  call that hangs past its limit ends the process with a record (exit 4; ``--resume`` goes on without it).
- **The plain path.** While the released starting program runs and nothing else is due, ``step`` only runs that
  program, keeps the loss and records the integrity sample: the bookkeeping of the full path costs more between
  two updates of a small model than in a tight loop, so it is skipped on most updates. Each part says up to
  which update it needs nothing of a step (``quiet_until``); ``_plain_horizon`` combines them, and ``_plan``
  keeps the answer, worked out again whenever a part's state may have changed (a full step, a boundary, a
  record, a restored state), so that the plain path costs one integer comparison per update.
- **Records.** Every outcome is an event in ``events.jsonl`` (see ``records``) and is shown to the agent at its
  next decision.
- **Checkpoints.** ``state_dict()`` holds only plain data (``plain.py``): what a program made that is not (its
  state, its analysis memory, what it left in the user's optimizer or scheduler) is the running version's
  failure at that moment, reverted and left out, so the checkpoint is written and a resume from it works.
- **Agent code's time.** The guard times every call of agent code, inside ``step`` or outside it;
  ``take_outside_charge()`` hands the outside seconds to a formal run, which charges them to its budget.

With the starting programs and an agent that changes nothing, every update is exactly the user's optimizer step
(same clipping, same scheduler), so a wrapped run is bit for bit the plain run.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from opalctl.formats import AgentFigures, Event, RecordDamaged
from opalctl.opal.agents import make_backend
from opalctl.opal.audit import count_step
from opalctl.opal.decisions import CostCap, Decisions, make_line
from opalctl.opal.guard import (
    Interrupts,
    StepFailure,
    StepGuard,
    StepTimeout,
    contained,
)
from opalctl.opal.hangs import GuardFindings, Hangs
from opalctl.opal.messages import prompt_text
from opalctl.opal.observer import GOOD_EVERY, IntegrityWatch, Observer, StepLearningRates
from opalctl.opal.plain import plain_number, string_keyed
from opalctl.opal.program_view import GradView, Spec, StepContext
from opalctl.opal.programs import PROGRAM_FILES, default_sources
from opalctl.opal.provenance import current, differences
from opalctl.opal.records import OpalRecords, Redaction, SecretRedaction
from opalctl.opal.recovery import Recovery
from opalctl.opal.roles import role_of
from opalctl.opal.schedule import SchedulerOwnership, SchedulerShared
from opalctl.opal.settings import AgentSettings
from opalctl.opal.slots import ProgramSlots, Snapshot, Version
from opalctl.opal.user_state import UserState, said

FORMAT = "opal-state/2"

__all__ = ["AgentOptimizer", "AgentSettings", "wrap", "default_sources", "FORMAT", "GOOD_EVERY", "PROGRAM_FILES",
           "GradView", "Spec", "StepContext", "StepFailure", "StepTimeout", "Version", "SchedulerShared"]


def _start(slots: ProgramSlots, records: OpalRecords, sources: dict[str, str] | None, **settings: Any) -> None:
    """Install version 0 (the released defaults unless ``sources``) and write the ``start`` event, which says
    whether version 0 differs from the released starting programs (then it never takes the plain path)."""

    changed = differences() if sources is None else {"(programs given to wrap)": "not the released defaults"}
    version = slots.start(sources or default_sources(), released=not changed)
    records.save_program(0, version.files)
    if changed:
        sys.stderr.write("opal: warning: the agent's defaults differ from the released ones ("
                         + ", ".join(f"{k} {v}" for k, v in changed.items()) + "); this run records it\n")
    records.event(Event.START, update=0, **settings, every=version.every, defaults_sha256=current(),
                  defaults_differ=changed)


class AgentOptimizer(torch.optim.Optimizer):
    """See the module docstring; build one with ``opalctl.opal.wrap``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, settings: AgentSettings):
        # not torch.optim.Optimizer.__init__: param_groups and state belong to the running program
        self.defaults = dict(optimizer.defaults)
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):  # what torch's Optimizer methods expect to find
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())
        self.settings = settings
        backend = make_backend(settings.backend)
        cap = CostCap.of(settings.max_cost_usd, backend.describe())  # refused before anything is started
        self.named = OrderedDict((name, p) for name, p in model.named_parameters() if p.requires_grad)
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in self.named.items() if id(p) not in optimized]
        if missing:
            raise ValueError(f"the optimizer does not hold these trainable parameters of the model: {missing[:3]}")
        self.spec = Spec(optimizer, settings.scheduler, settings.clip, settings.total_steps, settings.goal, self.named)
        self.scheduler_owner = SchedulerOwnership.of(settings.scheduler)  # None: no scheduler is the programs' to step
        self._grads = GradView(self.named)
        self.t = 0
        self._closed = False
        self._plain_until = 0  # see _plan: the only writer
        run_dir = settings.run_dir
        # this process's records are redacted by pattern: it holds no secret to compare with (records.py), unless a
        # caller whose backend answers here gives its own (its code, its strings)
        local_secrets = list(settings.secrets) if settings.secrets and backend.runs_in != "host" else None
        self.records = OpalRecords(run_dir, SecretRedaction(local_secrets) if local_secrets else Redaction())
        Interrupts.shared().install()  # a real Ctrl-C is told apart from a program's KeyboardInterrupt (guard.py)
        self.guard = StepGuard(settings.step_time_limit, self.named, on_hang=self._hung)
        self.step_rates = StepLearningRates(optimizer)  # what the analysis sees as obs["lrs"]
        self.observer = Observer(self.records, {name: role_of(name, tuple(p.shape)) for name, p in self.named.items()},
                                 self.guard)
        self.findings = GuardFindings(Hangs(run_dir), self.records, self.observer)
        self.integrity = IntegrityWatch(self.named, self.records, settings.eval_integrity)
        self.slots = ProgramSlots(self.named, self.spec, settings.every, settings.trial_steps, self.guard,
                                  self.findings.hangs.digests)
        self.user_state = UserState(self.spec, self.guard)
        self.decisions = Decisions(
            settings, make_line(backend, prompt_text(settings.prompt), self.records.redaction, run_dir=run_dir,
                                agent_dir=settings.agent_dir, secrets=list(settings.secrets)),
            self.records, self.slots, self.observer, describe=self._describe, progress=self.progress, cost_cap=cap)
        self.recovery = Recovery(self.slots, self.observer, self.integrity, self.records, self.decisions, self.named,
                                 self.spec, self._grads)
        _start(self.slots, self.records, settings.sources, backend=self.decisions.agent.backend.describe(),
               decisions=settings.decisions, schedule=self.decisions.schedule.fractions, blocking=settings.blocking,
               trial_steps=settings.trial_steps, prompt=settings.prompt)

    def _hung(self, version, call: str, limit: float) -> str:
        """The guard's watchdog found a call of ``version`` past its limit (``StepGuard``'s ``on_hang``)."""
        return self.findings.hung(version, call, limit, self.t, self.slots)

    # -- what torch, schedulers and callers see ------------------------------------------------------------
    @property
    def param_groups(self):
        # read once, under guard, when the version was built (a property of the updater is program code)
        groups = self.slots.current.param_groups if self.slots.current is not None else None
        return groups if groups is not None else self.spec.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):  # torch internals may assign; the groups live in the base optimizer
        self.spec.optimizer.param_groups = value

    @property
    def state(self):
        return self.spec.optimizer.state

    @property
    def base(self) -> torch.optim.Optimizer:  # the user's optimizer, which the starting program steps
        return self.spec.optimizer

    @property
    def total_steps(self) -> int | None:
        return self.spec.total_steps

    @property
    def current(self) -> Version:
        return self.slots.current

    @property
    def max_cost_usd(self) -> float | None:
        """The cost cap (USD): no decision is asked once what is left is below its expected cost."""
        return self.settings.max_cost_usd

    @property
    def manual_boundaries(self) -> bool:
        return self.settings.manual_boundaries

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.spec.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):  # pragma: no cover - the parameter set is fixed by the model
        raise RuntimeError("the agent optimizer's parameters are fixed by the model it was wrapped with")

    def __repr__(self) -> str:
        version = self.slots.current.number if self.slots.current else None
        return f"AgentOptimizer(base={type(self.spec.optimizer).__name__}, version={version}, update={self.t})"

    def progress(self) -> float:
        if self.settings.progress is not None:
            return float(self.settings.progress())
        total = self.spec.total_steps
        return min(1.0, self.t / total) if total else 0.0

    def _context(self) -> StepContext:
        """The step context of the current update, for a failure found outside a step (no loss)."""
        return StepContext(self.progress(), None, self.t)

    def _describe(self) -> dict[str, Any]:
        """The run's side of the facts a decision shows the agent."""
        return {"progress": self.progress(), "total_steps": self.spec.total_steps, "goal": self.spec.goal,
                "lrs": self._learning_rates(),
                "shapes": {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in self.named.items()}}

    def _learning_rates(self) -> list[float | None]:
        """Each group's learning rate, read without running a program's code (a program's ``param_groups`` are its
        objects, which it may have changed since they were read at its build): None for one that is no number."""
        groups = self.param_groups
        if type(groups) is not list:
            return []
        return [plain_number(string_keyed(group).get("lr")) for group in groups]

    # -- the plain path ------------------------------------------------------------------------------------
    def _plain_horizon(self) -> int:
        """The first update whose step must take the full path: the earliest of what each part needs (the slots:
        now unless the released starting program runs, passed and audited; the decisions: now while one is in
        flight or waiting, else the next scheduled one when ``step`` checks for boundaries; the integrity watch:
        now while a check is pending; the analysis: its next update), and now while records wait to be written
        or after ``close``."""
        t = self.t
        if self._closed or self.records.waiting:
            return t
        return min(self.slots.quiet_until(t),
                   self.integrity.quiet_until(t),
                   Observer.quiet_until(t, self.slots.current.every),
                   self.decisions.quiet_until(t, checks_boundaries=not self.manual_boundaries,
                                              total_steps=self.spec.total_steps, counted=self.settings.progress is None))

    def _plan(self) -> None:
        """Work the plain path's horizon out again (after anything that may change a part's state)."""
        self._plain_until = self._plain_horizon()

    # -- the step ------------------------------------------------------------------------------------------
    def step(self, closure=None, loss=None):
        t, owner = self.t, self.scheduler_owner
        if owner is not None and owner.scheduler.last_epoch != owner.seen:
            owner.refuse(t)
        if t < self._plain_until and closure is None:
            # the plain path (see the module docstring): the released starting program, nothing else due
            version = self.slots.current
            _, error = contained(version.updater.step, self._grads, t, StepContext(self.progress(), loss, t))
            if error is not None:  # handled as on the full path (the user's optimizer raised)
                with self.records.hold:  # its records wait for the next boundary (the next step is a full one)
                    self.recovery.step_failed(version, error, None, StepContext(self.progress(), loss, t))
            self.observer.after_step(loss)
            self.t = t + 1
            version.steps += 1
            self.integrity.after_step(t + 1, layouts=False)
            if owner is not None:
                owner.settle()
            if error is not None:
                self._plan()
            return loss
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self.guard.timing_update():  # agent code run from here on is timed as part of the update
            self._full_path(loss)
        if owner is not None:
            owner.settle()
        self._plan()
        return loss

    def _full_path(self, loss) -> None:
        """A boundary when ``step`` checks for one, the full step, and its records written."""
        progress = self.progress()
        if not self.manual_boundaries and self._boundary_due(progress):
            self.between_updates()
            progress = self.progress()
        with self.records.hold:  # records made during the step wait in memory: writing files is not an update's
            self._full_step(StepContext(progress, loss, self.t), loss)
        if not self.manual_boundaries and self.records.waiting:
            self.records.flush()

    def _full_step(self, ctx: StepContext, loss) -> None:
        slots = self.slots
        version = slots.current
        probe = Observer.analysis_due(self.t, version.every)
        before = {name: p.detach().clone() for name, p in self.named.items()} if probe else None
        in_trial = version.status == "trial"
        snapshot = slots.trial_snapshot(self.t)
        self.step_rates.forget()  # the learning rates of this update's step, none of an earlier one
        _, error = contained(self._checked_step, version, ctx, in_trial)
        if error is not None:
            self.recovery.step_failed(version, error, snapshot, ctx)
        elif in_trial and slots.trial_step_passed():
            self.records.event(Event.TRIAL_PASSED, update=self.t + 1, version=version.number)
        self.observer.after_step(loss)
        self.t += 1
        version.steps += 1
        # layouts are compared too whenever a program other than the released starting one ran (see record)
        self.integrity.after_step(self.t, layouts=version.number != 0 or not slots.released_start)
        if probe:
            self._analyse(before)
        if self.guard.changes:
            self.findings.torch_state_changed(self.guard, self.t)

    def _checked_step(self, version: Version, ctx: StepContext, in_trial: bool) -> None:
        if self.slots.audit_due(version):
            self._audited_step(version, ctx)
        else:
            self.slots.run_step(version, self._grads, self.t, ctx)
        # during a trial every step is checked in full (one device sync); after it, the periodic check does
        problem = self.guard.check(full=True) if in_trial else None
        if problem:
            raise StepFailure(problem)

    def _audited_step(self, version: Version, ctx: StepContext) -> None:
        """The second update of each version runs under the profiler once: outermost operator calls and, on CUDA,
        host synchronisations, shown to the agent beside the starting program's counts."""
        counts = count_step(lambda: self.slots.run_step(version, self._grads, self.t, ctx))
        counts = {"version": version.number, "update": self.t, **counts}
        self.slots.audited(counts)
        self.records.event(Event.AUDIT, **counts)

    # -- analysis ------------------------------------------------------------------------------------------
    def _analyse(self, before: dict[str, torch.Tensor]) -> None:
        t, observer, slots = self.t, self.observer, self.slots
        losses, nonfinite = observer.bin_losses(t)
        if nonfinite:
            self.decisions.wake("non-finite loss", t)
        if slots.current is not slots.versions[0]:
            # an agent's program is running: check it, and keep a state to roll back to should it go bad later
            # (the user's own optimizer, version 0, is not second-guessed and costs nothing here)
            problem = self.guard.check(full=True)
            if problem:
                self.recovery.step_failed(slots.current, StepFailure(problem), None, self._context(), redo=False)
            elif observer.good_due(t, slots.current.every):
                observer.keep_good(Snapshot.take(t, self.named, self.spec))
        version = slots.current
        wake, refused = observer.analyse(t, version, progress=self.progress(), losses=losses, params=self.named,
                                         before=before, grads=self._grads, optimizer=self.spec.optimizer,
                                         groups=self.param_groups, step_lrs=self.step_rates.used)
        if refused is not None:
            self.recovery.output_refused(version, refused, self._context())
        elif wake is not None:
            self.decisions.wake(wake, t)

    def observe(self, loss) -> None:
        """Record a loss of the update that is about to step (for frameworks that call ``step()`` themselves);
        the losses observed before one step are its micro-batches' and are summed, with the step's own."""
        self.observer.feed(loss)

    @property
    def latest_report(self) -> dict[str, Any] | None:
        """The last analysis report, as plain data."""
        return self.observer.latest_report

    # -- what the caller tells the optimizer, and boundaries -----------------------------------------------
    def report_dev(self, **metrics: Any) -> None:
        """A development evaluation happens now (at the current update). Opens an evaluation-integrity check; the
        metrics are recorded, never shown to the agent."""
        self.integrity.open_check(self.t)
        self.records.event(Event.DEV_REPORT, update=self.t, metrics=metrics)
        self._plan()

    def log(self, **values: Any) -> None:
        """Record values with the current update (kept in ``events.jsonl``; not shown to the agent)."""
        self.records.event(Event.LOG, update=self.t, values=values)
        self._plan()

    def needs_boundary(self) -> bool:
        """Whether ``between_updates`` has anything to do now (a decision due or in flight, a wake-up waiting, held
        records). Cheap, so a caller that times its updates can skip the boundary bookkeeping on most updates."""
        return self._boundary_due(self.progress())

    def _boundary_due(self, progress: float) -> bool:
        return self.records.waiting or self.decisions.due(progress)

    def between_updates(self) -> None:
        """Ask the agent when a decision is due, and apply an answer that has arrived. Call between updates."""
        if self._closed:
            return
        self.records.flush()
        self.decisions.boundary(self.t)
        self.findings.torch_state_changed(self.guard, self.t)
        self._plan()

    # -- the end, and checkpoints --------------------------------------------------------------------------
    def close(self, wait: bool = True) -> dict[str, Any]:
        """Finish: wait for (or abandon) a decision in flight, write the ``end`` event; returns the agent figures
        (``AgentFigures.to_json()``)."""
        if self._closed:
            return self.figures()
        self.decisions.close(self.t, wait)
        self.integrity.finish(self.t)
        self._closed = True
        self.guard.close()
        self.records.event(Event.END, update=self.t, **self.figures())
        self.records.close()
        self.decisions.agent.close()
        self._plan()
        return self.figures()

    def figures(self) -> dict[str, Any]:
        return _figures(self.decisions.counts, self.slots, self.integrity, self.guard.time)

    def take_outside_charge(self) -> tuple[float, float]:
        """``(cpu_seconds, wall_seconds)`` of agent code run outside timed updates (outside ``step``: a decision's
        programs loaded and built, a checkpoint's ``state_dict()``, a resume's ``load_state_dict()``) since the last
        take. A formal run charges them to its budget, so that work done there (training the model in ``build()``,
        say) is not free. The CPU seconds count every thread of this process."""
        return self.guard.time.take_outside()

    def state_dict(self) -> dict[str, Any]:
        """Each part's state; the slots' keys (versions, current, fallback, trial_left, updater, ...) sit at the top,
        where the formal run's checkpoints are read by tools and tests. Everything in it that a program made or
        could have reached is plain data (``plain.py``): what is not is the running program's failure, now, and is
        left out. The checks that may revert the running version come first, so the program state taken last is
        that of the version that runs on."""
        base, scheduler = self._user_states()
        memory, problem = self.observer.saved_memory()
        if problem is not None:
            self.recovery.output_refused(self.slots.current, problem, self._context())
        updater_state, fallback_state = self.slots.program_states(
            lambda version, problem: self.recovery.state_failed(version, problem, self._context()))
        return {"format": FORMAT, "t": self.t, **self.slots.state_dict(updater_state, fallback_state),
                "base": base, "scheduler": scheduler, "observer": self.observer.state_dict(memory),
                "decisions": self.decisions.state_dict(), "integrity": self.integrity.state_dict(),
                "records": self.records.offsets(), "agent_code_seconds": self.guard.time.state_dict()}

    def _user_states(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The user's optimizer's and scheduler's states, plain data (``UserState``); what a program left in them
        that was left out is the running version's failure, and the states are taken again after its revert (which
        may have restored a snapshot)."""
        base, scheduler, left_out = self.user_state.checked(self.slots.current)
        if left_out:
            self.recovery.output_refused(self.slots.current, "the user's optimizer or scheduler holds what a "
                                         f"checkpoint cannot hold, left out of it: {said(left_out)}", self._context())
            base, scheduler, _ = self.user_state.checked(self.slots.current)
        return base, scheduler

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise RecordDamaged(f"the saved state is not an agent optimizer state ({FORMAT}); resume from a checkpoint "
                                f"this opalctl wrote")
        self.records.truncate(state["records"])
        # the optimizer and scheduler first: the programs installed again are built on them
        if state["base"] is not None:  # None: nothing of it could be saved; it goes on from its state now
            self.spec.optimizer.load_state_dict(state["base"])
        if state["scheduler"] is not None and self.spec.scheduler is not None:
            self.spec.scheduler.load_state_dict(state["scheduler"])
        self.scheduler_owner = SchedulerOwnership.of(self.spec.scheduler)  # the loaded schedule is the one it owns
        failures = self.slots.load_state_dict(state)
        self.t = int(state["t"])
        self.observer.load_state_dict(state["observer"])
        self.decisions.load_state_dict(state["decisions"])
        self.integrity.load_state_dict(state["integrity"])
        self.guard.time.load_state_dict(state.get("agent_code_seconds"))  # absent from states saved before
        self.records.event(Event.RESUMED, update=self.t, version=self.slots.current.number)
        self.findings.failed_at_resume(failures, self.t, self.slots)  # failed at the resume itself
        self.findings.torch_state_changed(self.guard, self.t)
        self._plan()


def _figures(counts, slots: ProgramSlots, integrity: IntegrityWatch, agent_code) -> dict[str, Any]:
    """The agent figures (``AgentFigures.to_json()``) from the parts that count them."""
    return AgentFigures(
        decisions_asked=counts.asked, decisions_applied=counts.applied, decisions_kept=counts.kept,
        decisions_load_failed=counts.load_failed, decisions_failed=counts.failed,
        decisions_reverted=slots.reverted, step_failures=slots.step_failures,
        waiting_seconds=counts.waiting_seconds, agent_seconds=counts.agent_seconds, cost_usd=counts.cost_usd,
        wakes=counts.wakes, version=slots.current.number, versions=len(slots.versions),
        eval_integrity=integrity.figures(), agent_code_seconds=agent_code.figures()).to_json()


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module, settings: AgentSettings | None = None,
         **keywords: Any) -> AgentOptimizer:
    """Wrap a torch optimizer so that an agent may rewrite its update rule while the model trains.

    ``settings`` is an ``AgentSettings`` (``opalctl.opal.settings``: every setting, with its default); keyword
    arguments name its fields (``wrap(optimizer, model, total_steps=1000, backend="keep")``) and, beside
    ``settings``, take the place of its values.

    ``optimizer`` (and ``scheduler``, and ``clip`` when given) are what the starting program runs, unchanged.
    ``progress`` returns the fraction of the budget used (decisions are scheduled on it); without it, progress is
    updates done over ``total_steps``. ``backend`` is ``"heuristic"``, ``"keep"``, or a callable
    ``fn(workspace, message) -> rationale``. ``run_dir`` keeps this process's records (events, programs as loaded,
    each decision's outcome). ``agent_dir`` is where the agent host keeps its workspace and its records of each
    decision (``workspace/``, ``decisions/NNN/``), fixed when the host starts; by default ``run_dir / "agent"``, or
    a temporary folder without ``run_dir``. A backend that answers in this process (``keep``, a callable) edits in
    ``run_dir / "workspace"`` (or a temporary folder) instead. ``secrets``: strings to keep out of every record
    besides the secret-looking variables of the environment and the backend's key. ``notes_dir``: the folder of the
    notes a person leaves for the agent (``opalctl say``; ``opalctl.opal.notes``), read at each decision and shown in
    its message; none by default.

    A backend whose decisions run in the agent host (``heuristic``, ``anthropic``, ``claude-code``, ``replay``)
    starts the host here; the host takes the secret-looking variables of the environment (``ANTHROPIC_API_KEY``,
    any ``*_TOKEN``, ...) and this process removes them from ``os.environ`` for good: they do not come back at
    ``close()``. In a notebook, set one again yourself, e.g. ``os.environ["ANTHROPIC_API_KEY"] = key``.

    In a process group of more than one rank (torchrun, DDP) it refuses: each rank would run an agent of its own
    into the same records, and the ranks' programs would part; ``wrap_distributed`` is the call there.
    """
    ranks = _ranks_in_process_group()
    if ranks > 1 and not _LINKED_RANKS.get():
        raise ValueError(f"wrap() in a process group of {ranks} ranks would run one agent per rank; call "
                         f"opalctl.opal.wrap_distributed(optimizer, model, ...) on every rank instead (rank 0's "
                         f"agent decides, the others follow it)")
    return AgentOptimizer(optimizer, model, AgentSettings.of(settings, **keywords))


# set by wrap_distributed around its own call of wrap(): the one caller that makes one agent optimizer per rank
# and links them (rank 0 decides, the others follow), so the only one that may wrap inside a process group
_LINKED_RANKS: contextvars.ContextVar[bool] = contextvars.ContextVar("opalctl_linked_ranks", default=False)


@contextlib.contextmanager
def linked_ranks() -> Iterator[None]:
    token = _LINKED_RANKS.set(True)
    try:
        yield
    finally:
        _LINKED_RANKS.reset(token)


def _ranks_in_process_group() -> int:
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    return distributed.get_world_size()
