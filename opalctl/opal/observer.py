"""What the optimizer sees of training: the losses, the analysis and its reports, the errors shown to the agent,
the state a bad program is rolled back to, and the evaluation-integrity watch.

Losses are kept as device tensors and read once per analysis interval, never once per update; ``analysis.py``
runs on that interval, after the step, and may wake the agent. Everything handed to it and read of its result
happens inside its guarded call; its report (and wake-up reason) must be plain data when it is made, and its
memory when a checkpoint saves it (``plain.py``, checked without calling any of their objects): anything else is
the running version's failure, and the optimizer reverts it.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from typing import Any

import torch

from opalctl.formats import Event
from opalctl.opal.guard import failure_message, failure_text, trace_of
from opalctl.opal.integrity import IntegrityRecorder
from opalctl.opal.messages import rebin
from opalctl.opal.plain import NotPlainData, json_text, plain_problem, type_name
from opalctl.opal.slots import Snapshot, Version
from opalctl.scalars import read_floats

GOOD_EVERY = 4  # checks of an agent's program between two renewals of the state it rolls back to
LOSS_BINS_KEPT = 4096  # more bins than this are merged in pairs
ANALYSIS_SECONDS_KEPT = 64


class StepLearningRates:
    """The learning rate of each parameter group as the step of a torch optimizer used it: the effective learning
    rate, the one definition the analysis (``obs["lrs"]``), the run's steps records and the report use.

    A hook of the torch optimizer (``register_step_pre_hook``) reads the groups' values just before each step, so
    it sees what the budget schedule set and what an agent's program set for that step: the starting program
    multiplies the groups' learning rates by its ``LR_SCALE`` and anneal only around the step and puts them back
    after, where a reading after the update would miss it. The hook copies the groups' values into a list (Python
    numbers, no device work); ``take`` hands over the last step's list and forgets it, so an update whose program
    did not step the torch optimizer (an agent's own update rule) gives None rather than an earlier update's. The
    values are kept as the groups held them (a program may have put an object of its own there): a reader converts
    them where converting is safe."""

    def __init__(self, optimizer) -> None:
        self.used: list | None = None
        optimizer.register_step_pre_hook(self._before_step)  # for the optimizer's life

    def _before_step(self, optimizer, _args, _kwargs) -> None:
        self.used = [group["lr"] for group in optimizer.param_groups]

    def forget(self) -> None:
        self.used = None

    def take(self) -> list | None:
        used, self.used = self.used, None
        return used


def _number(value: float | None) -> str:
    return "null" if value is None else repr(value)


def losses_line(loss_bin: dict[str, Any], update: int) -> str:
    """One line of ``losses.jsonl``: numbers only, formatted by hand (this runs every few updates); the same bytes
    as ``losses_line_plain`` (tested). ``mean``, ``min`` and ``max`` are finite or None."""
    return (f'{{"count":{loss_bin["count"]},"end":{loss_bin["end"]},"max":{_number(loss_bin["max"])},'
            f'"mean":{_number(loss_bin["mean"])},"min":{_number(loss_bin["min"])},'
            f'"nonfinite":{loss_bin["nonfinite"]},"start":{loss_bin["start"]},"update":{update}}}\n')


def losses_line_plain(loss_bin: dict[str, Any], update: int) -> str:
    """The plain twin of ``losses_line``, through ``json.dumps``."""
    return json.dumps({**loss_bin, "update": update}, sort_keys=True, separators=(",", ":")) + "\n"


class NoLossWarning(UserWarning):
    """``step()`` ran without a loss: the agent then decides without seeing how training goes."""


class UnobservedUpdates:
    """The updates whose ``step()`` saw no loss (none passed, no closure's, none fed through ``observe()`` since
    the step before), and the one warning about them: an agent never reasons on no data without being told. Both
    are carried in the optimizer's state, so a resumed run counts on and does not warn again."""

    def __init__(self):
        self.count = 0
        self.warned = False

    def warn(self) -> None:
        self.warned = True
        warnings.warn(NoLossWarning(
            "opalctl: step() ran without a loss, so the agent is told that no loss was observed; pass "
            "step(loss=...) or call observe(loss) before step() (under transformers.Trainer use "
            "opalctl.integrations.hf.OpalTrainer)"), stacklevel=6)  # the caller of step() (a full step's depth)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "warned": self.warned}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """``state`` None: a state saved before the count was carried (it starts over, as it did then)."""
        self.count = int(state["count"]) if state is not None else 0
        self.warned = bool(state["warned"]) if state is not None else False


class Observer:
    """The losses since the last analysis (``pending_losses``), their bins, the analysis's memory and latest
    report, the errors the agent is shown at its next decision, the rollback state ``good``, and the updates that
    stepped without a loss (``unobserved``)."""

    def __init__(self, records, roles: dict[str, str], guard):
        self.records = records
        self.guard = guard  # analyze() runs through guard.call: its time limit, torch's global state
        self.roles = roles  # each parameter's role (see roles.py), shown to the analysis
        self.pending_losses: list = []
        self.loss_bins: list[dict[str, Any]] = []
        self.analysis_seconds: list[float] = []
        self._report_text: str | None = None  # the latest report as JSON text: most reports are never read
        self.memory: dict[str, Any] = {}
        self.errors: list[dict[str, Any]] = []
        self.good: Snapshot | None = None
        self.fed = None  # the losses fed since the last step, summed (a tensor or a float), or None
        self.unobserved = UnobservedUpdates()

    def feed(self, loss) -> None:
        """A loss of the update about to step, from a framework that calls ``step()`` itself: the losses fed before
        one step are its micro-batches' (gradient accumulation), already scaled by the framework, and are summed."""
        loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        self.fed = loss if self.fed is None else self.fed + loss

    def after_step(self, loss) -> None:
        """Keep the loss of the update just stepped: the losses fed since the step before plus the step's own (passed
        to ``step`` or its closure's), or count an update with neither. The plain and the full path of ``step`` both
        call this and nothing else about losses, so the two cannot count differently; it runs once per update,
        hence the inlined branches."""
        fed = self.fed
        if fed is not None:
            self.fed = None
            if loss is not None:
                fed = fed + (loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
            self.pending_losses.append(fed)
        elif loss is not None:
            self.pending_losses.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        else:
            unobserved = self.unobserved
            unobserved.count += 1
            if not unobserved.warned:
                unobserved.warn()

    def observed_since(self, update: int, t: int, unobserved_then: int) -> int:
        """How many of the updates after update ``update`` (the last decision's) up to ``t`` stepped with a loss:
        those updates less the ones counted without one since (``unobserved_then``: the count at ``update``). Exact
        at any update, unlike the analysed bins, which may begin before it. 0 tells the agent it has no loss to
        reason on."""
        return (t - update) - (self.unobserved.count - unobserved_then)

    @staticmethod
    def analysis_due(t: int, every: int) -> bool:
        """Whether the step of update ``t`` (0-based) runs the analysis after it."""
        return (t + 1) % every == 0

    @staticmethod
    def quiet_until(t: int, every: int) -> int:
        """The next update from ``t`` whose step runs the analysis."""
        return t + (every - 1 - t) % every

    @property
    def latest_report(self) -> dict[str, Any] | None:
        return json.loads(self._report_text) if self._report_text is not None else None

    def bin_losses(self, t: int) -> tuple[list[float], int]:
        """Read the losses since the last analysis, keep their bin and write its line; returns them and how many
        were not finite."""
        losses = read_floats(self.pending_losses)
        self.pending_losses = []
        finite = [x for x in losses if x - x == 0.0]  # x - x is nan for nan and for infinities
        mean = math.fsum(finite) / len(finite) if finite else None
        low, high = (min(finite), max(finite)) if finite else (None, None)
        loss_bin = {"start": t - len(losses) + 1, "end": t, "count": len(losses), "mean": mean,
                    "min": low, "max": high, "nonfinite": len(losses) - len(finite)}
        self.loss_bins.append(loss_bin)
        if len(self.loss_bins) > LOSS_BINS_KEPT:
            self.loss_bins = rebin(self.loss_bins, LOSS_BINS_KEPT // 2)
        self.records.write_line("losses", losses_line(loss_bin, t))
        return losses, loss_bin["nonfinite"]

    def restore_after(self, snapshot: Snapshot | None, named, spec) -> tuple[str, bool]:
        """Put back the state from before a failed step (its trial snapshot), or roll a non-finite state back to
        the last checked one (``good``); says which, and whether it rolled back (the integrity watch then sees a
        discontinuity)."""
        if snapshot is not None:
            snapshot.restore(named, spec)
            return "exact", False
        good = self.good
        if good is not None and self.guard.check(full=True) is not None:
            good.restore(named, spec)
            return f"rolled back to update {good.update}", True
        return "none (the state after the failed step is kept)", False

    def record_error(self, kind: str, t: int, version: int | None, message: str, traceback: str = "",
                     **more: Any) -> None:
        """An error the agent is shown at its next decision (``kind``: what failed, at update ``t``, in ``version``)."""
        self.errors.append({"kind": kind, "update": t, "version": version, "message": message, "traceback": traceback,
                            **more})

    def errors_shown(self) -> list[dict[str, Any]]:
        """The errors a decision shows the agent (the latest eight), forgotten once shown."""
        shown, self.errors = self.errors[-8:], []
        return shown

    def keep_good(self, snapshot: Snapshot) -> None:
        """The state a non-finite one is rolled back to (see ``good_due``)."""
        self.good = snapshot

    def good_due(self, t: int, every: int) -> bool:
        """Whether to renew the rollback state: on every GOOD_EVERY-th check of an agent's program (a copy of the
        parameters, gradients and optimizer state is the dearest thing an agent's program adds to training)."""
        return self.good is None or t - self.good.update >= GOOD_EVERY * every

    def analyse(self, t: int, version: Version, *, progress: float, losses: list[float], params, before, grads,
                optimizer, groups, step_lrs: list | None = None) -> tuple[str | None, str | None]:
        """Run ``version``'s analysis after update ``t``; keep its report. ``obs["lrs"]`` is ``step_lrs``, the
        learning rates the update's step used (``StepLearningRates``), or the groups' values where no step of
        the torch optimizer ran. Returns why it wakes the agent (None when
        it does not) and, when its report or wake-up reason is not plain data, why (the optimizer then reverts the
        version). Another failure is an error shown to the agent, and an ``analysis_failed`` event."""
        seen = (t, progress, losses, params, before, grads, optimizer, groups, step_lrs)
        started = time.perf_counter()
        result, error = self.guard.call(version, "analyze()", self._analyze, version, seen)
        self.analysis_seconds.append(time.perf_counter() - started)
        del self.analysis_seconds[:-ANALYSIS_SECONDS_KEPT]
        if error is not None:
            if plain_problem(self.memory, tensors="none") is not None:
                self.memory = {}
            if type(error) is NotPlainData:  # raised by _analyze: the sentence is ours
                return None, failure_message(error)
            message = failure_text(error)
            self.record_error("analysis", t, version.number, message, trace_of(error, -4))
            self.records.event(Event.ANALYSIS_FAILED, update=t, version=version.number, message=message)
            return None, None
        wake, report_text = result
        if report_text is not None:
            self._report_text = report_text
            self.records.write_line("reports", f'{{"report":{report_text},"update":{t},'
                                               f'"version":{version.number}}}\n')
        return wake, None

    def _analyze(self, version: Version, seen: tuple) -> tuple[str | None, str | None]:
        """The program's ``analyze`` and everything read for it or of its result (inside the guarded call: the user's
        optimizer state and the groups may hold a program's objects, and the result is the program's): (why it
        wakes the agent or None, the report as JSON text or None)."""
        t, progress, losses, params, before, grads, optimizer, groups, step_lrs = seen
        state = optimizer.state
        obs = {"update": t, "progress": progress, "losses": losses, "params": dict(params), "before": before,
               "grads": dict(grads.items()), "state": {name: state.get(p, {}) for name, p in params.items()},
               "roles": self.roles,
               "lrs": [float(lr) for lr in (step_lrs if step_lrs is not None else [g["lr"] for g in groups])]}
        with torch.no_grad():
            result = version.analysis.analyze(obs, self.memory)
        if type(result) is not dict:
            raise TypeError(f"analyze() returned {type_name(result)}, not a dict")
        report = None
        if "report" in result:
            report, problem = json_text(result["report"], tensors="scalars")
            if problem is not None:
                raise NotPlainData(f"analyze() returned a report that cannot be written: {problem}")
        wake = result.get("wake")
        if type(wake) not in (str, bool, int, float, type(None)):
            raise NotPlainData(f"analyze() returned a wake-up reason that is a {type_name(wake)}; return a string")
        return (str(wake) if wake else None), report

    def saved_memory(self) -> tuple[dict[str, Any], str | None]:
        """The analysis memory as a checkpoint holds it (plain data, through JSON), and None; or, when it holds
        anything else, ``({}, why)``, the memory cleared (the optimizer reverts the running version). Checked here,
        at checkpoints, rather than at every analysis."""
        text, problem = json_text(self.memory) if type(self.memory) is dict else (None, "it is not a dict")
        if problem is None:
            return json.loads(text), None
        self.memory = {}
        return {}, f"the analysis memory cannot be saved: {problem}; it was cleared"

    def state_dict(self, memory: dict[str, Any]) -> dict[str, Any]:
        """The observer's state, with ``memory`` (``saved_memory``'s)."""
        if any(isinstance(x, torch.Tensor) for x in self.pending_losses):
            self.pending_losses = [float(x.float()) if isinstance(x, torch.Tensor) else x for x in self.pending_losses]
        fed = float(self.fed.float()) if isinstance(self.fed, torch.Tensor) else self.fed
        return {"memory": memory, "pending_losses": list(self.pending_losses),
                "loss_bins": self.loss_bins, "latest_report": self.latest_report, "errors": self.errors,
                "fed": fed, "unobserved": self.unobserved.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory = state["memory"]
        self.pending_losses = list(state["pending_losses"])
        self.loss_bins = list(state["loss_bins"])
        report = state["latest_report"]
        self._report_text = json.dumps(report) if report is not None else None
        self.errors = list(state["errors"])
        self.good = None
        self.fed = state.get("fed")  # absent from states saved before it was carried
        self.unobserved.load_state_dict(state.get("unobserved"))


class IntegrityWatch:
    """The evaluation-integrity recorder (a seeded sample of every tensor's entries recorded on the device after
    each update; an evaluation opens a check of the window around it) and its findings."""

    def __init__(self, named: dict[str, torch.Tensor], records, enabled: bool):
        self.recorder = IntegrityRecorder(named, seed=0) if enabled else None
        self.findings: list[dict[str, Any]] = []
        self.records = records

    def quiet_until(self, t: int) -> int:
        """``t`` while a check is pending (every step then sees whether it is due), else no limit."""
        return t if self.recorder is not None and self.recorder.pending else 1 << 62

    def after_step(self, t: int, layouts: bool) -> None:
        """Record update ``t`` (``layouts``: compare strides and shapes too, see ``IntegrityRecorder.record``), and
        run the checks that became due."""
        recorder = self.recorder
        if recorder is None:
            return
        recorder.record(t, layouts=layouts)
        if recorder.pending:
            findings = recorder.maybe_check(t)
            if findings is not None:
                self._found(findings, t)

    def open_check(self, t: int) -> None:
        if self.recorder is not None:
            self.recorder.open_check(t)

    def discontinuity(self, update: int) -> None:
        if self.recorder is not None:
            self.recorder.discontinuity(update)

    def finish(self, t: int) -> None:
        """Run the checks still pending, with what is recorded (at the end of a run)."""
        if self.recorder is not None:
            findings = self.recorder.flush()
            if findings:
                self._found(findings, t)

    def _found(self, findings: list[dict[str, Any]], t: int) -> None:
        for finding in findings:
            flagged = finding.get("kind") == "round_trip"
            self.findings.append({**finding, "flagged": flagged})
            fields = {("finding" if key == "kind" else key): value for key, value in finding.items()
                      if key != "update"}
            self.records.event(Event.EVAL_INTEGRITY, update=t, flagged=flagged, **fields)

    def figures(self) -> dict[str, Any] | None:
        if self.recorder is None:
            return None
        return {"flagged": sum(1 for f in self.findings if f["flagged"]),
                "information": sum(1 for f in self.findings if not f["flagged"]),
                "tensors": sorted({f["tensor"] for f in self.findings if f["flagged"]})}

    def state_dict(self) -> dict[str, Any]:
        return {"recorder": self.recorder.state_dict() if self.recorder is not None else None,
                "findings": self.findings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.recorder is not None and state["recorder"] is not None:
            self.recorder.load_state_dict(state["recorder"])
        self.findings = list(state["findings"])
