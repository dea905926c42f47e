"""``AgentOptimizer``: a torch optimizer whose update rule is a program an agent may rewrite while it trains.

The pieces, in the order an update meets them:

- **Boundaries.** Between two updates the optimizer may ask the agent (a scheduled decision, a wake-up from
  the analysis, a non-finite loss) and may switch to a new program version. Agent work never happens inside
  ``step``: a caller that times its updates (the formal run) calls ``between_updates()`` outside its timed
  interval and passes ``manual_boundaries=True``; otherwise ``step`` calls it first.
- **The step.** ``step`` hands the gradients to the running ``updater.py``. A new version runs a *trial*: before
  each trial step the parameters, gradients and optimizer state are copied; if the step fails (an exception, a
  non-finite value, a changed dtype/device/shape, a step over its time limit) the copy is restored and the same
  update is redone by the last version that passed its trial. After the trial a failure hands over to that
  version too, and a non-finite parameter found by the periodic check rolls back to the last checked state.
  Training never dies because of agent code (KeyboardInterrupt aside).
- **The plain path.** While the released starting program runs and nothing else is due (no analysis, decision,
  trial, audit, wake-up, pending record or integrity check before a known update), ``step`` only runs that
  program, keeps the loss and records the integrity sample: the bookkeeping of the full path, a few microseconds
  of Python that cost several times as much between two updates of a small model as in a tight loop, is skipped
  on most updates. ``_plain_horizon`` says up to which update that holds; it is worked out again after every
  full step, and anything that could change it (a boundary, a record, a restored state) resets it.
- **Observation.** Losses are kept as device tensors and read once per analysis interval, never once per update;
  ``analysis.py`` runs on that interval after the step and may wake the agent.
- **Records.** Every outcome is an event in ``events.jsonl`` (see ``records``) and is shown to the agent at its
  next decision.

With the starting programs and an agent that changes nothing, every update is exactly the user's optimizer step
(same clipping, same scheduler), so a wrapped run is bit for bit the plain run.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal
import statistics
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from opalctl.opal.agents import Answer, make_backend
from opalctl.opal.messages import prompt_text, rebin, render
from opalctl.opal.programs import ProgramRejected, load_program
from opalctl.opal.records import OpalRecords
from opalctl.opal.roles import role_of
from opalctl.opal.schedule import DecisionSchedule, decision_fractions
from opalctl.scalars import read_floats

PROGRAM_FILES = ("updater.py", "analysis.py")
GOOD_EVERY = 4  # checks of an agent's program between two renewals of the state it rolls back to
FORMAT = "opal-state/1"


class StepFailure(Exception):
    """A program's step failed one of the checks; the message says which."""


class StepTimeout(BaseException):
    """Raised by the alarm inside a step that ran past its limit (a BaseException so ``except Exception`` in a
    program cannot swallow it)."""


def default_sources() -> dict[str, str]:
    folder = resources.files("opalctl.opal").joinpath("defaults")
    return {name: folder.joinpath(name).read_text("utf-8") for name in PROGRAM_FILES}


class Spec:
    """Run facts handed to ``build(params, previous, spec)``."""

    def __init__(self, optimizer, scheduler, clip, total_steps, goal, params: dict[str, torch.Tensor]):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = clip
        self.total_steps = total_steps
        self.goal = goal
        self.param_names = list(params)
        self._params = params

    def optimizer_state_by_name(self) -> dict[str, dict]:
        return {name: self.optimizer.state.get(param, {}) for name, param in self._params.items()}


class GradView(dict):
    """``grads`` as a program sees it: name -> gradient, read from the parameters when asked (building a dict of
    every gradient on each update would cost time on models with many tensors)."""

    __slots__ = ("_named",)

    def __init__(self, named):
        super().__init__()
        self._named = named

    def __getitem__(self, name):
        return self._named[name].grad

    def get(self, name, default=None):
        param = self._named.get(name)
        return default if param is None or param.grad is None else param.grad

    def __iter__(self):
        return iter(self._named)

    def __len__(self):
        return len(self._named)

    def __contains__(self, name):
        return name in self._named

    def keys(self):
        return self._named.keys()

    def items(self):
        return [(name, p.grad) for name, p in self._named.items()]

    def values(self):
        return [p.grad for p in self._named.values()]


class StepContext:
    __slots__ = ("progress", "loss", "update", "logs")

    def __init__(self, progress: float, loss, update: int):
        self.progress, self.loss, self.update, self.logs = progress, loss, update, None

    def log(self, **values: Any) -> None:
        if self.logs is None:
            self.logs = {}
        self.logs.update(values)


@dataclass
class Version:
    number: int
    files: dict[str, str]
    status: str = "trial"  # trial, passed, failed
    applied_at: int = 0
    updater: Any = None
    analysis: Any = None  # the loaded analysis module
    every: int = 25
    step_seconds: list[float] = field(default_factory=list)
    steps: int = 0  # updates this version has stepped (the audit measures its second)

    def timed(self, seconds: float) -> None:
        """Keep one step's duration (the recent ones only: the agent is shown their mean)."""
        self.step_seconds.append(seconds)
        if len(self.step_seconds) > 256:
            del self.step_seconds[:128]


def _diff_lines(old: str, new: str) -> dict[str, int]:
    """Lines added and removed from ``old`` to ``new`` (a short summary of a program change)."""
    import difflib

    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
    return {"added": sum(1 for x in lines if x.startswith("+") and not x.startswith("+++")),
            "removed": sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return copy.deepcopy(value)


class AgentOptimizer(torch.optim.Optimizer):
    """See the module docstring; build one with ``opalctl.opal.wrap``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, goal: str | None,
                 total_steps: int | None, progress: Callable[[], float] | None, backend, decisions: int,
                 schedule, blocking, every: int, trial_steps: int, run_dir, prompt: str, scheduler, clip,
                 max_lag: int, step_time_limit: float, max_wakes: int | None, manual_boundaries: bool,
                 secrets: list[str] | None = None, sources: dict[str, str] | None = None,
                 eval_integrity: bool = True):
        # not torch.optim.Optimizer.__init__: param_groups and state belong to the running program
        self.defaults = dict(optimizer.defaults)
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        if total_steps is None and progress is None:
            raise ValueError("wrap() needs total_steps or progress (a callable returning the budget fraction used)")
        if blocking not in (True, False, "auto"):
            raise ValueError("blocking must be True, False or 'auto'")
        self.base = optimizer
        self.model = model
        self.goal = goal
        self.total_steps = total_steps
        self._progress_fn = progress
        self.backend = make_backend(backend)
        self.blocking = blocking
        self.default_every = every
        self.trial_steps = trial_steps
        self.prompt = prompt
        self.prompt_text = prompt_text(prompt)
        self.max_lag = max_lag
        self.manual_boundaries = manual_boundaries
        self.named = OrderedDict((name, p) for name, p in model.named_parameters() if p.requires_grad)
        self._grads = GradView(self.named)
        from opalctl.opal.integrity import IntegrityRecorder

        # evaluation integrity (SPEC 6.7): a seeded sample of every tensor's entries recorded on the device
        # after each update; report_dev opens a check of the window around an evaluation
        self.integrity = IntegrityRecorder(self.named, seed=0) if eval_integrity else None
        self.integrity_findings: list[dict[str, Any]] = []
        self.audits: dict[int, dict[str, Any]] = {}
        self.step_time_limit = step_time_limit
        self._alarm_installed = self._install_alarm()
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in self.named.items() if id(p) not in optimized]
        if missing:
            raise ValueError(f"the optimizer does not hold these trainable parameters of the model: {missing[:3]}")
        self.roles = {name: role_of(name, tuple(p.shape)) for name, p in self.named.items()}
        self.layout = {name: (p.dtype, p.device, tuple(p.shape)) for name, p in self.named.items()}
        self.spec = Spec(optimizer, scheduler, clip, total_steps, goal, self.named)
        self.schedule = DecisionSchedule(decision_fractions(decisions, schedule),
                                         max_wakes if max_wakes is not None else max(1, decisions // 2))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.records = OpalRecords(self.run_dir, secrets)
        self.workspace = (self.run_dir / "workspace") if self.run_dir is not None else None
        self._scratch = None
        if self.workspace is None:
            import tempfile

            self._scratch = tempfile.mkdtemp(prefix="opal-workspace-")
            self.workspace = Path(self._scratch)
        self.workspace.mkdir(parents=True, exist_ok=True)

        self.t = 0
        self.versions: list[Version] = []
        self.current: Version | None = None
        self.fallback: Version | None = None
        self.trial_left = 0
        self.memory: dict[str, Any] = {}
        self.pending_losses: list = []
        self.loss_bins: list[dict[str, Any]] = []
        self._latest_report_text: str | None = None
        self.errors: list[dict[str, Any]] = []
        self.last_change: dict[str, Any] | None = None
        self.wake_reason: str | None = None
        self.last_decision_update = 0
        self.counters = {"asked": 0, "applied": 0, "kept": 0, "rejected": 0, "load_failed": 0, "reverted": 0,
                         "failed": 0, "waiting_seconds": 0.0, "agent_seconds": 0.0, "cost_usd": 0.0,
                         "wakes": 0, "step_failures": 0}
        self.inflight: dict[str, Any] | None = None
        self.max_cost_usd: float | None = None  # cost cap (USD): see _over_cost_cap; set by the caller
        self.queued_reason: str | None = None
        self._good: dict[str, Any] | None = None
        self._swap: dict[str, Any] | None = None
        self._analysis_seconds: list[float] = []
        self._plain_until = 0  # steps of updates before this one may take the plain path (see _plain_horizon)
        self._closed = False
        self._closing = False
        self._install(Version(number=0, files=dict(sources or default_sources()), status="passed"), previous=None)
        self.fallback = self.current
        self.records.save_program(0, self.current.files)
        from opalctl.opal.provenance import current, differences

        changed = differences() if sources is None else {"(programs given to wrap)": "not the released defaults"}
        self._released_start = not changed  # version 0 is the released starting program (see _run_step)
        if changed:
            import sys

            sys.stderr.write("opal: warning: the agent's defaults differ from the released ones ("
                             + ", ".join(f"{k} {v}" for k, v in changed.items()) + "); this run records it\n")
        self.records.event("start", update=0, backend=self.backend.describe(), decisions=decisions,
                           schedule=self.schedule.fractions, blocking=blocking, trial_steps=trial_steps,
                           prompt=prompt, every=self.current.every, defaults_sha256=current(),
                           defaults_differ=changed)

    # -- what torch and schedulers see ----------------------------------------------------------------------
    @property
    def param_groups(self):
        updater = self.current.updater if self.current is not None else None
        groups = getattr(updater, "param_groups", None)
        return groups if groups is not None else self.base.param_groups

    @param_groups.setter
    def param_groups(self, value):  # torch internals may assign; the groups live in the base optimizer
        self.base.param_groups = value

    @property
    def state(self):
        return self.base.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):  # pragma: no cover - the parameter set is fixed by the model
        raise RuntimeError("the agent optimizer's parameters are fixed by the model it was wrapped with")

    def __repr__(self) -> str:
        version = self.current.number if self.current else None
        return f"AgentOptimizer(base={type(self.base).__name__}, version={version}, update={self.t})"

    # -- progress ------------------------------------------------------------------------------------------
    def progress(self) -> float:
        if self._progress_fn is not None:
            return float(self._progress_fn())
        return min(1.0, self.t / self.total_steps) if self.total_steps else 0.0

    # -- programs ------------------------------------------------------------------------------------------
    def _install(self, version: Version, previous) -> None:
        """Load both programs of ``version`` and build its updater; raises ProgramRejected on any failure."""
        label = f"v{version.number:03d}"
        updater_program = load_program("updater", version.files["updater.py"], label=f"{label}/updater")
        analysis_program = load_program("analysis", version.files["analysis.py"], label=f"{label}/analysis")
        build = getattr(updater_program.module, "build", None)
        analyze = getattr(analysis_program.module, "analyze", None)
        if not callable(build):
            raise ProgramRejected(f"{label}/updater.py must define build(params, previous, spec)")
        if not callable(analyze):
            raise ProgramRejected(f"{label}/analysis.py must define analyze(obs, memory)")
        every = getattr(analysis_program.module, "EVERY", self.default_every)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ProgramRejected(f"{label}/analysis.py: EVERY must be a positive integer, not {every!r}")
        try:
            updater = build(self.named, previous, self.spec)
        except BaseException as error:  # noqa: B036 - agent code must never end training
            if isinstance(error, KeyboardInterrupt):
                raise
            raise ProgramRejected(f"{label}/updater.py build() raised {type(error).__name__}: {error}\n"
                                  f"{traceback.format_exc(limit=-3)}") from None
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(updater, method, None)):
                raise ProgramRejected(f"{label}/updater.py: the object build() returns has no {method}()")
        version.updater, version.analysis, version.every = updater, analysis_program.module, every
        if version not in self.versions:
            self.versions.append(version)
        self.current = version

    def _snapshot(self) -> dict[str, Any]:
        return {
            "params": {name: p.detach().clone() for name, p in self.named.items()},
            "grads": {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in self.named.items()},
            "base": _clone(self.base.state_dict()),
            "updater": _clone(self.current.updater.state_dict()),
            "version": self.current,
            "scheduler": _clone(self.spec.scheduler.state_dict()) if self.spec.scheduler is not None else None,
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, p in self.named.items():
                if p.dtype != snapshot["params"][name].dtype or tuple(p.shape) != tuple(snapshot["params"][name].shape):
                    p.data = snapshot["params"][name].clone()
                else:
                    p.copy_(snapshot["params"][name])
                grad = snapshot["grads"][name]
                p.grad = grad.clone() if grad is not None else None
        self.base.load_state_dict(_clone(snapshot["base"]))
        if snapshot.get("scheduler") is not None and self.spec.scheduler is not None:
            self.spec.scheduler.load_state_dict(_clone(snapshot["scheduler"]))

    def _check(self, full: bool) -> str | None:
        """What is wrong with the parameters after a step (None when nothing is)."""
        for name, p in self.named.items():
            dtype, device, shape = self.layout[name]
            if p.dtype != dtype:
                return f"parameter {name} changed dtype from {dtype} to {p.dtype}"
            if p.device != device:
                return f"parameter {name} moved from {device} to {p.device}"
            if tuple(p.shape) != shape:
                return f"parameter {name} changed shape from {shape} to {tuple(p.shape)}"
        if full:
            flags = torch.stack([torch.isfinite(p.detach()).all() for p in self.named.values()])
            if not bool(flags.all()):
                bad = [name for name, ok in zip(self.named, flags.tolist()) if not ok]
                return f"non-finite values in {', '.join(bad[:3])}"
        return None

    def _run_step(self, version: Version, grads, ctx: StepContext) -> None:
        if version.number == 0 and self._released_start:
            # The released starting program only calls the user's own optimizer (which sets its own grad mode) and
            # scheduler: no time limit (it has no fallback; it is the fallback) and no grad-mode switch, which
            # cost about as much as the rest of the wrapper put together on a small model.
            started = time.perf_counter()
            version.updater.step(grads, self.t, ctx)
            version.timed(time.perf_counter() - started)
            return
        use_alarm = self._alarm_installed
        started = time.perf_counter()
        if use_alarm:  # arming is three attribute writes: the watchdog thread does the timing (see _watch)
            _ALARM.seq += 1
            _ALARM.started, _ALARM.limit = started, self.step_time_limit
            _ALARM.armed = True
        try:
            with torch.no_grad():
                version.updater.step(grads, self.t, ctx)
        finally:
            if use_alarm:
                _ALARM.armed = False
        elapsed = time.perf_counter() - started
        version.timed(elapsed)
        if self.step_time_limit and elapsed > self.step_time_limit:
            raise StepFailure(f"the step took {elapsed:.2f} s, over its limit of {self.step_time_limit:.2f} s")

    def _install_alarm(self) -> bool:
        """The time limit of a step is a SIGALRM whose handler raises inside the step, sent by a watchdog thread.
        The handler can only be set from the main thread; elsewhere a step over its limit is still caught, after
        it returns."""
        if not self.step_time_limit or threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGALRM)
        if previous not in (signal.SIG_DFL, signal.SIG_IGN, None, _alarm):
            return False  # the program has its own alarm handler: leave it alone
        signal.signal(signal.SIGALRM, _alarm)
        _start_watchdog()
        return True

    # -- the step ------------------------------------------------------------------------------------------
    def step(self, closure=None, loss=None):
        t = self.t
        if t < self._plain_until and closure is None:
            # the plain path (see the module docstring): the released starting program, nothing else due
            version = self.current
            try:
                version.updater.step(self._grads, t, StepContext(self.progress(), loss, t))
            except BaseException as error:  # noqa: B036 - handled as on the full path (the user's optimizer raised)
                if isinstance(error, KeyboardInterrupt):
                    raise
                self._plain_until = 0
                self.records.defer = True  # its records wait for the next boundary (the next step is a full one)
                self._step_failed(version, error, None, StepContext(self.progress(), loss, t))
                self.records.defer = False
            if loss is not None:
                self.observe(loss)
            self.t = t + 1
            version.steps += 1
            if self.integrity is not None:
                self.integrity.record(t + 1, layouts=False)
            return loss
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        progress = self.progress()
        if not self.manual_boundaries and self._boundary_due(progress):
            self.between_updates()
            progress = self.progress()
        ctx = StepContext(progress, loss, self.t)
        # records made during the step wait in memory: writing files is not part of an update
        self.records.defer = True
        grads = self._grads
        probe = (self.t + 1) % self.current.every == 0
        before = {name: p.detach().clone() for name, p in self.named.items()} if probe else None
        version = self.current
        in_trial = version.status == "trial"
        snapshot = self._snapshot() if in_trial else None
        if snapshot is not None and self._swap is not None:
            # the first step of a new version: restore to the state from just before the swap, not after build()
            snapshot["base"] = self._swap["base"]
            snapshot["params"] = self._swap["params"]
            snapshot["scheduler"] = self._swap.get("scheduler")
        self._swap = None
        try:
            if version.steps == 1 and version.number not in self.audits:
                self._audited_step(version, grads, ctx)
            else:
                self._run_step(version, grads, ctx)
            # during a trial every step is checked in full (one device sync); after it, the periodic check does
            problem = self._check(full=True) if in_trial else None
            if problem:
                raise StepFailure(problem)
        except BaseException as error:  # noqa: B036 - agent code must never end training
            if isinstance(error, KeyboardInterrupt):
                raise
            self._step_failed(version, error, snapshot, ctx)
        else:
            if in_trial:
                self.trial_left -= 1
                if self.trial_left <= 0:
                    version.status = "passed"
                    self.fallback = version
                    self.records.event("trial_passed", update=self.t + 1, version=version.number)
        if loss is not None:
            self.observe(loss)
        self.t += 1
        version.steps += 1
        if self.integrity is not None:
            # layouts are compared too whenever a program other than the released starting one ran (see record)
            self.integrity.record(self.t, layouts=version.number != 0 or not self._released_start)
            if self.integrity.pending:  # an evaluation's check is waiting (maybe_check says whether it is due)
                findings = self.integrity.maybe_check(self.t)
                if findings is not None:
                    self._integrity_events(findings)
        if probe:
            self._analyse(before, grads)
        self.records.defer = False
        if not self.manual_boundaries and self.records.pending:
            self.records.flush()
        self._plain_until = self._plain_horizon()
        return loss

    def _plain_horizon(self) -> int:
        """The first update whose step must take the full path: the next analysis, the next scheduled decision
        (when ``step`` checks for boundaries itself and progress is counted in updates), or now, when anything
        other than the released starting program's step may happen (another version, a trial, the audit still to
        run, a decision in flight or waiting, a record or an integrity check pending)."""
        version = self.current
        t = self.t
        if (version.number != 0 or not self._released_start or version.status != "passed"
                or 0 not in self.audits or self.inflight is not None or self.wake_reason is not None
                or self.queued_reason is not None or self.records.pending or self._closed
                or (self.integrity is not None and self.integrity.pending)):
            return t
        every = version.every
        horizon = t + (every - 1 - t) % every  # the next update whose step runs the analysis
        if not self.manual_boundaries and self.schedule.remaining:
            if self._progress_fn is not None:
                return t  # progress is not counted in updates: every step checks for a boundary
            if self.total_steps:
                fraction = self.schedule.fractions[self.schedule.next_index]
                due = max(t, math.floor(fraction * self.total_steps) - 1)
                while due < horizon and min(1.0, due / self.total_steps) < fraction:
                    due += 1
                horizon = min(horizon, due)
        return horizon

    def _audited_step(self, version: Version, grads, ctx: StepContext) -> None:
        """The second update of each version runs under the profiler once (SPEC 6.8): outermost operator calls and,
        on CUDA, host synchronisations, shown to the agent beside the starting program's counts."""
        from opalctl.opal.audit import count_step

        counts = count_step(lambda: self._run_step(version, grads, ctx))
        counts = {"version": version.number, "update": self.t, **counts}
        self.audits[version.number] = counts
        self.records.event("audit", **counts)

    def report_dev(self, **metrics: Any) -> None:
        """A development evaluation happens now (at the current update). Opens an evaluation-integrity check; the
        metrics are recorded, never shown to the agent."""
        self._plain_until = 0
        if self.integrity is not None:
            self.integrity.open_check(self.t)
        self.records.event("dev_report", update=self.t, metrics=metrics)

    def log(self, **values: Any) -> None:
        """Record values with the current update (kept in ``events.jsonl``; not shown to the agent)."""
        self._plain_until = 0
        self.records.event("log", update=self.t, values=values)

    def _integrity_events(self, findings: list[dict[str, Any]]) -> None:
        for finding in findings:
            flagged = finding.get("kind") == "round_trip"
            self.integrity_findings.append({**finding, "flagged": flagged})
            fields = {("finding" if key == "kind" else key): value for key, value in finding.items()
                      if key != "update"}
            self.records.event("eval_integrity", update=self.t, flagged=flagged, **fields)

    def observe(self, loss) -> None:
        """Record the loss of the update that is about to step (for frameworks that call ``step()`` themselves)."""
        self.pending_losses.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))

    def _step_failed(self, version: Version, error: BaseException, snapshot, ctx: StepContext,
                     redo: bool = True) -> None:
        kind = "timeout" if isinstance(error, StepTimeout) else ("check" if isinstance(error, StepFailure)
                                                                  else "exception")
        message = str(error) or type(error).__name__
        trace = "" if kind == "check" else traceback.format_exc(limit=-4)
        fallback = self.fallback if self.fallback is not version else self.versions[0]
        self.counters["step_failures"] += 1
        error_record = {"kind": kind, "update": self.t, "version": version.number, "message": message,
                        "traceback": trace, "fallback": fallback.number, "in_trial": version.status == "trial"}
        self.errors.append(error_record)
        if snapshot is not None:
            self._restore(snapshot)
            restored = "exact"
        elif self._check(full=True) is not None and self._good is not None:
            self._restore(self._good)
            restored = f"rolled back to update {self._good['update']}"
            if self.integrity is not None:
                self.integrity.discontinuity(self.t + 1)
        else:
            restored = "none (the state after the failed step is kept)"
        version.status = "failed"
        self.counters["reverted"] += 1
        self.records.event("reverted", update=self.t, version=version.number, to=fallback.number, reason=kind,
                           message=message, traceback=trace, restored=restored)
        if self.last_change and self.last_change.get("version") == version.number:
            self.last_change.update(outcome="reverted", reverted_at=self.t, reason=message)
        self.current = fallback
        if not redo:
            return
        try:
            self._run_step(fallback, self._grads, ctx)
        except BaseException as second:  # noqa: B036 - the fallback itself failed: the starting program takes over
            if isinstance(second, KeyboardInterrupt):
                raise
            self.records.event("failed_step", update=self.t, version=fallback.number,
                               message=f"{type(second).__name__}: {second}")
            if fallback is not self.versions[0]:
                if snapshot is not None:
                    self._restore(snapshot)
                self.current = self.fallback = self.versions[0]
                self._run_step(self.versions[0], self._grads, ctx)

    # -- analysis ------------------------------------------------------------------------------------------
    def _read_losses(self) -> list[float]:
        pending, self.pending_losses = self.pending_losses, []
        return read_floats(pending)

    def _analyse(self, before, grads) -> None:
        losses = self._read_losses()
        finite = [x for x in losses if x - x == 0.0]  # x - x is nan for nan and for infinities
        mean = math.fsum(finite) / len(finite) if finite else None
        low, high = (min(finite), max(finite)) if finite else (None, None)
        loss_bin = {"start": self.t - len(losses) + 1, "end": self.t, "count": len(losses), "mean": mean,
                    "min": low, "max": high, "nonfinite": len(losses) - len(finite)}
        self.loss_bins.append(loss_bin)
        if len(self.loss_bins) > 4096:
            self.loss_bins = rebin(self.loss_bins, 2048)
        # numbers only: formatted here rather than through json (this runs every few updates)
        self.records.write_line("losses", f'{{"count":{len(losses)},"end":{self.t},"max":{_number(high)},'
                                          f'"mean":{_number(mean)},"min":{_number(low)},'
                                          f'"nonfinite":{loss_bin["nonfinite"]},"start":{loss_bin["start"]},'
                                          f'"update":{self.t}}}\n')
        if loss_bin["nonfinite"]:
            self._wake("non-finite loss")
        if self.current is not self.versions[0]:
            # an agent's program is running: check it, and keep a state to roll back to should it go bad later
            # (the user's own optimizer, version 0, is not second-guessed and costs nothing here)
            problem = self._check(full=True)
            if problem:
                self._step_failed(self.current, StepFailure(problem), None,
                                  StepContext(self.progress(), None, self.t), redo=False)
            elif self._good is None or self.t - self._good["update"] >= GOOD_EVERY * self.current.every:
                # the state to roll back to is renewed on every GOOD_EVERY-th check: a copy of the parameters,
                # gradients and optimizer state is the dearest thing an agent's program adds to training
                self._good = self._snapshot()
                self._good["update"] = self.t
        obs = {"update": self.t, "progress": self.progress(), "losses": losses, "params": dict(self.named),
               "before": before, "grads": dict(grads.items()),
               "state": {name: self.base.state.get(p, {}) for name, p in self.named.items()},
               "roles": self.roles, "lrs": [float(g["lr"]) for g in self.param_groups]}
        started = time.perf_counter()
        try:
            with torch.no_grad():
                result = self.current.analysis.analyze(obs, self.memory)
            if not isinstance(result, dict):
                raise TypeError(f"analyze() returned {type(result).__name__}, not a dict")
            report_text = json.dumps(result["report"], default=float) if "report" in result else None
        except BaseException as error:  # noqa: B036 - agent code must never end training
            if isinstance(error, KeyboardInterrupt):
                raise
            self.errors.append({"kind": "analysis", "update": self.t, "version": self.current.number,
                                "message": f"{type(error).__name__}: {error}",
                                "traceback": traceback.format_exc(limit=-4)})
            self.records.event("analysis_failed", update=self.t, version=self.current.number,
                               message=f"{type(error).__name__}: {error}")
            try:
                json.dumps(self.memory)
            except (TypeError, ValueError):
                self.memory = {}
            return
        finally:
            self._analysis_seconds.append(time.perf_counter() - started)
            del self._analysis_seconds[:-64]
        if report_text is not None:
            self._latest_report_text = report_text  # parsed when a decision reads it (see latest_report)
            self.records.write_line("reports", f'{{"report":{report_text},"update":{self.t},'
                                               f'"version":{self.current.number}}}\n')
        if result.get("wake"):
            self._wake(str(result["wake"]))

    def _wake(self, reason: str) -> None:
        self._plain_until = 0
        if self.wake_reason is None:
            self.wake_reason = reason
            self.records.event("wake", update=self.t, reason=reason)

    @property
    def latest_report(self) -> dict[str, Any] | None:
        """The last analysis report, as plain data (kept as its JSON text: most reports are never read)."""
        return json.loads(self._latest_report_text) if self._latest_report_text is not None else None

    # -- decisions -----------------------------------------------------------------------------------------
    def needs_boundary(self) -> bool:
        """Whether ``between_updates`` has anything to do now (a decision due or in flight, a wake-up waiting).
        Cheap, so a caller that times its updates can skip the boundary bookkeeping on most updates."""
        return self._boundary_due(self.progress())

    def _boundary_due(self, progress: float) -> bool:
        return (self.inflight is not None or self.wake_reason is not None or self.queued_reason is not None
                or bool(self.records.pending) or self.schedule.due(progress))

    def between_updates(self) -> None:
        """Ask the agent when a decision is due, and apply an answer that has arrived. Call between updates."""
        self._plain_until = 0
        if self._closed:
            return
        self.records.flush()
        if self.inflight is not None:
            self._poll()
        progress = self.progress()
        reason = None
        if self.wake_reason is not None:
            if self.schedule.can_wake():
                self.schedule.take_wake()
                reason = f"wake: {self.wake_reason}"
                self.counters["wakes"] += 1
            self.wake_reason = None
        if reason is None and self.schedule.due(progress):
            self.schedule.take(progress)
            reason = "scheduled"
        if reason is None:
            return
        if self.inflight is not None:
            self.queued_reason = reason if self.queued_reason is None else f"{self.queued_reason}; {reason}"
            return
        self._ask(reason)

    def _facts(self, reason: str, number: int) -> dict[str, Any]:
        since = [b for b in self.loss_bins if b["end"] > self.last_decision_update]
        timing = {"updater_ms": 1000 * statistics.fmean(self.current.step_seconds) if self.current.step_seconds else None,
                  "analysis_ms": 1000 * statistics.fmean(self._analysis_seconds) if self._analysis_seconds else None}
        return {"decision": number, "reason": reason, "update": self.t, "progress": self.progress(),
                "total_steps": self.total_steps, "goal": self.goal, "remaining": self.schedule.remaining,
                "lrs": [float(g["lr"]) for g in self.param_groups], "version": self.current.number,
                "losses": {"bins": rebin(since)},
                "loss_start": self.loss_bins[0]["mean"] if self.loss_bins else None,  # the first interval's mean
                "report": self.latest_report, "errors": self.errors[-8:],
                "last_change": self.last_change, "timing": timing,
                "audit": {f"v{number:03d}": {k: v for k, v in counts.items() if k in ("ops", "syncs", "top")}
                          for number, counts in sorted(self.audits.items())},
                "shapes": {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in self.named.items()}}

    def _prepare_workspace(self, facts: dict[str, Any]) -> str:
        for name in PROGRAM_FILES:
            (self.workspace / name).write_text(self.current.files[name], encoding="utf-8")
        meta = self.workspace / ".opal"
        meta.mkdir(exist_ok=True)
        message = self.prompt_text + "\n\n" + render(facts, self.current.files)
        (meta / "facts.json").write_text(json.dumps(facts, sort_keys=True, default=float), encoding="utf-8")
        (meta / "message.md").write_text(message, encoding="utf-8")
        return message

    def _over_cost_cap(self, reason: str) -> bool:
        """True (with a ``skipped`` event) when what is left of ``max_cost_usd`` is below the expected cost of the next
        decision: the mean cost of the decisions answered so far, or before any has cost something the typical
        figure of the estimate (SPEC 6.9) for a first or a later decision."""
        if self.max_cost_usd is None:
            return False
        from opalctl.opal.estimate import FIGURES, MEASURED_EFFORT, MEASURED_MODEL

        spent = self.counters["cost_usd"]
        answered = self.counters["asked"] - (1 if self.inflight is not None else 0)
        figures = FIGURES[(MEASURED_MODEL, MEASURED_EFFORT)]["later" if self.counters["asked"] else "first"]
        expected = spent / answered if spent > 0 and answered > 0 else figures["usd"]["typical"]
        if self.max_cost_usd - spent >= expected:
            return False
        self.records.event("skipped", update=self.t, reason="cost cap", asked_for=reason, spent_usd=spent,
                           max_cost_usd=self.max_cost_usd, expected_usd=expected)
        return True

    def _ask(self, reason: str) -> None:
        if self._over_cost_cap(reason):
            return
        self.counters["asked"] += 1
        number = self.counters["asked"]
        facts = self._facts(reason, number)
        message = self._prepare_workspace(facts)
        self.records.event("requested", update=self.t, decision=number, reason=reason, version=self.current.number)
        self.errors = []
        self.last_decision_update = self.t
        blocking = self.blocking
        if blocking == "auto":
            blocking = number == 1 or self._expected_lag() > self.max_lag
        if "non-finite" in reason:
            blocking = True  # training waits for an answer when the loss is not finite
        started = time.perf_counter()
        if blocking:
            answer = self._call_backend(message, facts)
            waited = time.perf_counter() - started
            self.counters["waiting_seconds"] += waited
            self.counters["agent_seconds"] += waited
            self._apply(number, answer, message, requested_at=self.t, seconds=waited, waited=waited)
        else:
            self.inflight = {"number": number, "message": message, "facts": facts, "started": started,
                             "requested_at": self.t, "result": None, "reason": reason}
            self._start_background(self.inflight)

    def _expected_lag(self) -> float:
        step = [s for v in self.versions for s in v.step_seconds]
        per_update = statistics.fmean(step) if step else 1e-3
        previous = [d for d in self.records.memory["events"] if d.get("kind") in ("applied", "kept", "rejected")]
        seconds = statistics.fmean(d.get("seconds", 27.0) for d in previous) if previous else 27.0
        return seconds / max(per_update, 1e-9)

    def _call_backend(self, message: str, facts: dict[str, Any]) -> Answer:
        try:
            answer = self.backend.decide(self.workspace, message, facts)
            return answer if isinstance(answer, Answer) else Answer(rationale=str(answer))
        except Exception as error:  # the agent's failure is an event, never the end of training
            return Answer(rationale="", failed=f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-4)}")

    def _start_background(self, inflight: dict[str, Any]) -> None:
        if self.backend.runs_in == "process":
            import subprocess
            import sys

            inflight["process"] = subprocess.Popen(
                [sys.executable, "-m", "opalctl.opal.agents.worker", self.backend.name, str(self.workspace)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            return

        def work() -> None:
            inflight["result"] = self._call_backend(inflight["message"], inflight["facts"])

        inflight["thread"] = threading.Thread(target=work, name="opal-decision", daemon=True)
        inflight["thread"].start()

    def _poll(self, wait: bool = False) -> None:
        inflight = self.inflight
        if "process" in inflight:
            process = inflight["process"]
            if wait:
                started = time.perf_counter()
                process.wait()
                self.counters["waiting_seconds"] += time.perf_counter() - started
            if process.poll() is None:
                return
            answer_path = self.workspace / ".opal" / "answer.json"
            if process.returncode == 0 and answer_path.exists():
                data = json.loads(answer_path.read_text())
                answer = Answer(rationale=data.get("rationale", ""), failed=data.get("failed"))
                answer_path.unlink()
            else:
                stderr = process.stderr.read().decode(errors="replace") if process.stderr else ""
                answer = Answer(rationale="", failed=f"the agent process exited with {process.returncode}: "
                                                     f"{stderr.strip()[-2000:]}")
        else:
            if wait:
                started = time.perf_counter()
                inflight["thread"].join()
                self.counters["waiting_seconds"] += time.perf_counter() - started
            if inflight["thread"].is_alive():
                return
            answer = inflight["result"]
        seconds = time.perf_counter() - inflight["started"]
        self.counters["agent_seconds"] += seconds
        self.inflight = None
        self._apply(inflight["number"], answer, inflight["message"], requested_at=inflight["requested_at"],
                    seconds=seconds, waited=0.0)
        if self.queued_reason is not None:
            reason, self.queued_reason = self.queued_reason, None
            self._ask(reason)

    def _apply(self, number: int, answer: Answer, message: str, *, requested_at: int, seconds: float,
               waited: float) -> None:
        self.counters["cost_usd"] += answer.cost_usd or 0.0
        if self._closing and not answer.failed:
            # the answer came after the last update: there is no boundary left to apply it at
            self.records.event("late", update=self.t, decision=number, seconds=seconds,
                               message="the answer arrived after the last update and was not applied")
            self.records.save_decision(number, {"message.md": message, "response.md": answer.rationale or ""},
                                       {"decision": number, "requested_at": requested_at, "answered_at": self.t,
                                        "seconds": seconds, "waited_seconds": waited, "outcome": "late",
                                        "cost_usd": answer.cost_usd, "usage": answer.usage})
            return
        meta = {"decision": number, "requested_at": requested_at, "answered_at": self.t, "seconds": seconds,
                "waited_seconds": waited, "usage": answer.usage, "cost_usd": answer.cost_usd,
                "backend": self.backend.describe()}
        files = {"message.md": message, "response.md": answer.rationale or ""}
        if answer.transcript:
            files["transcript.json"] = json.dumps(answer.transcript, indent=1, default=str)
        lines = [line.strip() for line in (answer.rationale or "").strip().splitlines() if line.strip()]
        summary = next((line for line in lines if line.lower().startswith(("changed", "kept"))), "")
        common = {"update": self.t, "decision": number, "seconds": seconds, "cost_usd": answer.cost_usd,
                  "rationale": lines[0] if lines else "", "summary": summary}
        if answer.failed:
            self.counters["failed"] += 1
            self.records.event("decision_failed", message=answer.failed.splitlines()[0], **common)
            self.records.save_decision(number, files, {**meta, "outcome": "failed", "error": answer.failed})
            return
        edited = {}
        for name in PROGRAM_FILES:
            path = self.workspace / name
            edited[name] = path.read_text(encoding="utf-8") if path.exists() else ""
        if edited == self.current.files:
            self.counters["kept"] += 1
            self.records.event("kept", version=self.current.number, **common)
            self.records.save_decision(number, files, {**meta, "outcome": "kept"})
            return
        swap = self._snapshot()
        previous_version = self.current
        version = Version(number=len(self.versions), files=edited, applied_at=self.t)
        try:
            self._install(version, previous=previous_version.updater)
        except ProgramRejected as error:
            self._restore(swap)
            self.current = previous_version
            self.counters["load_failed"] += 1
            text = str(error)
            self.errors.append({"kind": "load_failed", "update": self.t, "version": version.number,
                                "message": text.splitlines()[0], "traceback": text})
            self.records.event("load_failed", version=version.number, message=text.splitlines()[0], **common)
            self.records.save_decision(number, files, {**meta, "outcome": "load_failed", "error": text})
            if self.records.enabled:
                self.records.save_program(version.number, edited)
            self.versions.append(Version(number=version.number, files=edited, status="failed", applied_at=self.t))
            return
        self.trial_left = self.trial_steps
        self._swap = swap
        self.counters["applied"] += 1
        self.records.save_program(version.number, edited)
        changed = [name for name in PROGRAM_FILES if edited[name] != previous_version.files[name]]
        diff = {name: _diff_lines(previous_version.files[name], edited[name]) for name in changed}
        self.records.event("applied", version=version.number, previous=previous_version.number, files=changed,
                           diff=diff, **common)
        self.records.save_decision(number, files, {**meta, "outcome": "applied", "version": version.number,
                                                   "files": changed})
        recent = [b["mean"] for b in self.loss_bins[-4:] if b["mean"] is not None]
        self.last_change = {"version": version.number, "decision": number, "applied_at": self.t, "files": changed,
                            "outcome": "applied", "loss_before": statistics.fmean(recent) if recent else None}

    # -- the end, and checkpoints --------------------------------------------------------------------------
    def close(self, wait: bool = True) -> dict[str, Any]:
        """Finish: wait for (or abandon) a decision in flight, write the ``end`` event; returns the agent figures."""
        if self._closed:
            return self.figures()
        self._plain_until = 0
        self._closing = True
        if self.queued_reason is not None:
            self.records.event("skipped", update=self.t, reason=self.queued_reason,
                               message="the run ended before this decision could be asked")
            self.queued_reason = None
        if self.inflight is not None:
            if wait:
                while self.inflight is not None:
                    self.queued_reason = None
                    self._poll(wait=True)
            else:
                process = self.inflight.get("process")
                if process is not None:
                    process.kill()
                self.records.event("abandoned", update=self.t, decision=self.inflight["number"])
                self.inflight = None
        if self.integrity is not None:
            findings = self.integrity.flush()
            if findings:
                self._integrity_events(findings)
        self._closed = True
        if self._alarm_installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            self._alarm_installed = False
        self.records.event("end", update=self.t, **self.figures())
        self.records.close()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
        return self.figures()

    def figures(self) -> dict[str, Any]:
        counters = self.counters
        return {"decisions_asked": counters["asked"], "decisions_applied": counters["applied"],
                "decisions_kept": counters["kept"], "decisions_load_failed": counters["load_failed"],
                "decisions_failed": counters["failed"], "decisions_reverted": counters["reverted"],
                "waiting_seconds": counters["waiting_seconds"], "agent_seconds": counters["agent_seconds"],
                "cost_usd": counters["cost_usd"], "wakes": counters["wakes"], "version": self.current.number,
                "versions": len(self.versions),
                "eval_integrity": None if self.integrity is None else {
                    "flagged": sum(1 for f in self.integrity_findings if f["flagged"]),
                    "information": sum(1 for f in self.integrity_findings if not f["flagged"]),
                    "tensors": sorted({f["tensor"] for f in self.integrity_findings if f["flagged"]})}}

    def state_dict(self) -> dict[str, Any]:
        # A decision in flight is not waited for (a checkpoint must not make a non-blocking run block): the state
        # says it was asked, and a run resumed from it asks that decision again at its first boundary.
        inflight = self.inflight
        self._read_pending_as_floats()
        counters = dict(self.counters)
        queued = self.queued_reason
        if inflight is not None:
            counters["asked"] -= 1
            queued = inflight["reason"] if queued is None else f"{inflight['reason']}; {queued}"
        return {
            "format": FORMAT,
            "t": self.t,
            "versions": [{"number": v.number, "files": v.files, "status": v.status, "applied_at": v.applied_at}
                         for v in self.versions],
            "current": self.current.number,
            "fallback": self.fallback.number,
            "trial_left": self.trial_left,
            "base": self.base.state_dict(),
            "scheduler": self.spec.scheduler.state_dict() if self.spec.scheduler is not None else None,
            "updater": self.current.updater.state_dict(),
            "fallback_updater": self.fallback.updater.state_dict() if self.fallback is not self.current else None,
            "memory": self._memory_copy(),
            "schedule": self.schedule.state_dict(),
            "pending_losses": list(self.pending_losses),
            "loss_bins": self.loss_bins,
            "latest_report": self.latest_report,
            "errors": self.errors,
            "last_change": self.last_change,
            "wake_reason": self.wake_reason,
            "queued_reason": queued,
            "last_decision_update": self.last_decision_update,
            "counters": counters,
            "integrity": self.integrity.state_dict() if self.integrity is not None else None,
            "integrity_findings": self.integrity_findings,
            "audits": {str(k): v for k, v in self.audits.items()},
            "version_steps": {str(v.number): v.steps for v in self.versions},
            "records": self.records.offsets(),
        }

    def _memory_copy(self) -> dict[str, Any]:
        """The analysis memory as plain data (checked here, at checkpoints, rather than at every analysis)."""
        try:
            return json.loads(json.dumps(self.memory))
        except (TypeError, ValueError) as error:
            self.errors.append({"kind": "analysis", "update": self.t, "version": self.current.number,
                                "message": f"the analysis memory holds something that is not plain data ({error}); "
                                           f"it was cleared", "traceback": ""})
            self.memory = {}
            return {}

    def _read_pending_as_floats(self) -> None:
        if any(isinstance(x, torch.Tensor) for x in self.pending_losses):
            values = [float(x) for x in (x.float() if isinstance(x, torch.Tensor) else x for x in self.pending_losses)]
            self.pending_losses = values

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != FORMAT:
            raise ValueError("this is not an agent optimizer state (opal-state/1)")
        self._plain_until = 0
        self.records.truncate(state["records"])
        self.versions = []
        by_number = {}
        for entry in state["versions"]:
            by_number[entry["number"]] = Version(number=entry["number"], files=dict(entry["files"]),
                                                 status=entry["status"], applied_at=entry["applied_at"])
        self.base.load_state_dict(state["base"])
        if state.get("scheduler") is not None and self.spec.scheduler is not None:
            self.spec.scheduler.load_state_dict(state["scheduler"])
        for number in sorted(by_number):
            version = by_number[number]
            if number in (state["current"], state["fallback"], 0):
                self._install(version, previous=None)
            else:
                self.versions.append(version)
        self.versions.sort(key=lambda v: v.number)
        self.fallback = by_number[state["fallback"]]
        self.current = by_number[state["current"]]
        self.current.updater.load_state_dict(state["updater"])
        if state.get("fallback_updater") is not None and self.fallback is not self.current:
            self.fallback.updater.load_state_dict(state["fallback_updater"])
        self.t = int(state["t"])
        self.trial_left = int(state["trial_left"])
        self.memory = state["memory"]
        self.schedule.load_state_dict(state["schedule"])
        self.pending_losses = list(state["pending_losses"])
        self.loss_bins = list(state["loss_bins"])
        report = state["latest_report"]
        self._latest_report_text = json.dumps(report) if report is not None else None
        self.errors = list(state["errors"])
        self.last_change = state["last_change"]
        self.wake_reason = state["wake_reason"]
        self.queued_reason = state["queued_reason"]
        self.last_decision_update = int(state["last_decision_update"])
        self.counters = dict(state["counters"])
        if self.integrity is not None and state.get("integrity") is not None:
            self.integrity.load_state_dict(state["integrity"])
        self.integrity_findings = list(state.get("integrity_findings", []))
        self.audits = {int(k): v for k, v in state.get("audits", {}).items()}
        for version in self.versions:
            version.steps = int(state.get("version_steps", {}).get(str(version.number), 0))
        self._good = None
        self.records.event("resumed", update=self.t, version=self.current.number)


def _number(value: float | None) -> str:
    return "null" if value is None else repr(value)


class _AlarmState:
    """What the steps, the watchdog thread and the SIGALRM handler share (one step runs at a time, in the main
    thread). ``seq`` numbers the armed steps; ``fire`` is the step the watchdog signalled, so that a signal that
    arrives after that step ended (or in the next one) is ignored."""

    armed = False
    seq = 0
    fire = -1
    started = 0.0
    limit = 0.0
    watchdog: threading.Thread | None = None


_ALARM = _AlarmState()


def _alarm(signum, frame):
    if _ALARM.armed and _ALARM.fire == _ALARM.seq:
        _ALARM.armed = False
        raise StepTimeout("the step ran past its time limit")


def _watch(main_thread: int) -> None:
    """The watchdog: looks at the armed step every quarter of its limit (so a step over its limit is stopped within
    1.25 times it) and signals the main thread when it is over. Why a thread rather than ``setitimer``: two
    system calls per step cost several microseconds on a step of a few hundred; sleeping costs nothing."""
    while True:
        time.sleep(max((_ALARM.limit or 1.0) / 4, 0.005))
        seq = _ALARM.seq
        if _ALARM.armed and time.perf_counter() - _ALARM.started > _ALARM.limit and _ALARM.seq == seq:
            _ALARM.fire = seq
            signal.pthread_kill(main_thread, signal.SIGALRM)


def _start_watchdog() -> None:
    if _ALARM.watchdog is None or not _ALARM.watchdog.is_alive():
        _ALARM.watchdog = threading.Thread(target=_watch, args=(threading.main_thread().ident,),
                                           name="opal-step-watchdog", daemon=True)
        _ALARM.watchdog.start()


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, goal: str | None = None,
         total_steps: int | None = None, progress: Callable[[], float] | None = None,
         backend: Any = "heuristic", decisions: int = 8, schedule: str | list[float] = "front",
         blocking: bool | str = True, every: int = 25, trial_steps: int = 20, run_dir: str | Path | None = None,
         prompt: str = "neutral", scheduler=None, clip: float | None = None, max_lag: int = 50,
         step_time_limit: float = 10.0, max_wakes: int | None = None, manual_boundaries: bool = False,
         secrets: list[str] | None = None, eval_integrity: bool = True) -> AgentOptimizer:
    """Wrap a torch optimizer so that an agent may rewrite its update rule while the model trains.

    ``optimizer`` (and ``scheduler``, and ``clip`` when given) are what the starting program runs, unchanged.
    ``progress`` returns the fraction of the budget used (decisions are scheduled on it); without it, progress is
    updates done over ``total_steps``. ``backend`` is ``"heuristic"``, ``"keep"``, or a callable
    ``fn(workspace, message) -> rationale``. ``run_dir`` keeps the records (events, programs, decisions).
    """
    return AgentOptimizer(optimizer, model, goal=goal, total_steps=total_steps, progress=progress, backend=backend,
                          decisions=decisions, schedule=schedule, blocking=blocking, every=every,
                          trial_steps=trial_steps, run_dir=run_dir, prompt=prompt, scheduler=scheduler, clip=clip,
                          max_lag=max_lag, step_time_limit=step_time_limit, max_wakes=max_wakes,
                          manual_boundaries=manual_boundaries, secrets=secrets, eval_integrity=eval_integrity)
