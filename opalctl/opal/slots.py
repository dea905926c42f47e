"""The program slots: every version of the two programs, which one runs (and its step, under the guard), which one
a failure falls back to, the trial of a new version, and the snapshots a failed step is restored from.

A ``Snapshot`` holds the parameters, their gradients, the user's optimizer state and the scheduler state, and
``restore`` puts back exactly those; of the two states, only their plain data (``plain.py``: what a program left
there that is not plain data is never copied, since copying it would run its code, and a restore clears it). It
holds no program's own state (``updater.state_dict()``): a trial's or a
rollback's snapshot is restored only when the version that was running when it was taken failed, and a failed
version never runs again, so that state would never be read back. The state from before a swap is the one case
where the version it was taken under runs on (after its successor was rejected or failed its first step); what
the successor's ``build(params, previous, spec)`` did to ``previous`` is not undone, as it never was.

A program's ``state_dict()`` is taken under the guard and must be plain data (``plain_problem``): anything else
is the version's failure when the state is taken (a checkpoint), never an error of the checkpoint itself.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from opalctl.layout import version_name
from opalctl.opal.guard import failure_text, method_call, trace_of
from opalctl.opal.plain import plain_copy, plain_entries, plain_optimizer_state, plain_problem, type_name
from opalctl.opal.programs import ANALYSIS, PROGRAM_FILES, UPDATER, ProgramRejected, check_program, load_program

STEP_SECONDS_KEPT = 256  # the recent step durations a version keeps (the agent is shown their mean)


def version_digest(files: dict[str, str]) -> str:
    """The sha256 that names a version's two files (what ``hangs.py`` remembers)."""
    digest = hashlib.sha256()
    for name in PROGRAM_FILES:
        digest.update(name.encode() + b"\0" + str(files.get(name, "")).encode("utf-8", "surrogateescape") + b"\0")
    return digest.hexdigest()


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
    param_groups: Any = None  # the updater's param_groups, read once when it was built (None: the base's)
    digest: str = ""

    def __post_init__(self) -> None:
        self.digest = version_digest(self.files)

    def timed(self, seconds: float) -> None:
        """Keep one step's duration (the recent ones only)."""
        self.step_seconds.append(seconds)
        if len(self.step_seconds) > STEP_SECONDS_KEPT:
            del self.step_seconds[:STEP_SECONDS_KEPT // 2]


@dataclass
class Snapshot:
    """The training state a failed step is restored to (see the module docstring for what it leaves out)."""

    update: int
    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    base: dict[str, Any] | None  # None: the user's optimizer's state had no shape that could be kept
    scheduler: dict[str, Any] | None

    @classmethod
    def take(cls, update: int, named: dict[str, torch.Tensor], spec) -> Snapshot:
        """The state now; of the user's optimizer and scheduler only their plain data (``plain.py``: a program may
        have left anything in them, and copying it would run its code), so a restore also clears what a program
        left there."""
        base, _ = plain_optimizer_state(spec.optimizer.state_dict(), spec.optimizer.defaults)
        scheduler = plain_entries(spec.scheduler.state_dict(), "the scheduler")[0] if spec.scheduler is not None \
            else None
        return cls(update=update,
                   params={name: p.detach().clone() for name, p in named.items()},
                   grads={name: (p.grad.detach().clone() if p.grad is not None else None)
                          for name, p in named.items()},
                   base=plain_copy(base), scheduler=plain_copy(scheduler))

    def restore(self, named: dict[str, torch.Tensor], spec) -> None:
        with torch.no_grad():
            for name, p in named.items():
                saved = self.params[name]
                if p.dtype != saved.dtype or tuple(p.shape) != tuple(saved.shape):
                    p.data = saved.clone()
                else:
                    p.copy_(saved)
                grad = self.grads[name]
                p.grad = grad.clone() if grad is not None else None
        if self.base is not None:
            spec.optimizer.load_state_dict(plain_copy(self.base))
        if self.scheduler is not None and spec.scheduler is not None:
            spec.scheduler.load_state_dict(plain_copy(self.scheduler))

    def before_swap(self, swap: Snapshot) -> Snapshot:
        """This trial snapshot with the parameters and optimizer state of ``swap`` (the state from just before
        a new version's ``build``, which may have changed them): a failed first step restores to before it."""
        return Snapshot(update=self.update, params=swap.params, grads=self.grads, base=swap.base,
                        scheduler=swap.scheduler)


def _no_grad_step(version: Version, grads, t: int, ctx) -> None:
    with torch.no_grad():
        version.updater.step(grads, t, ctx)


def _build(build, named, previous, spec) -> tuple[Any, Any] | str:
    """A program's ``build`` and what is read of its updater, all inside the guarded call (a property of the
    updater is program code too): (the updater, its param_groups or None), or what is wrong with it."""
    updater = build(named, previous, spec)
    for method in ("step", "state_dict", "load_state_dict"):
        if not callable(getattr(updater, method, None)):
            return f"the object build() returns has no {method}()"
    groups = getattr(updater, "param_groups", None)
    if groups is not None and not (type(groups) is list and all(type(g) is dict for g in groups)):
        return "param_groups must be a list of dicts (or leave it out: the user's optimizer's groups are used)"
    return updater, groups


class ProgramSlots:
    """Versions, the running one (``current``), the one a failure hands over to (``fallback``), the trial of a
    new version and the audits of each version's second step."""

    def __init__(self, named: dict[str, torch.Tensor], spec, default_every: int, trial_steps: int, guard,
                 hung: set[str] | None = None):
        self.named = named
        self.guard = guard  # every call into a program goes through guard.call (time limit, torch state)
        self.hung = set(hung or ())  # digests of versions that hung: never loaded again
        self.spec = spec
        self.default_every = default_every
        self.trial_steps = trial_steps
        self.versions: list[Version] = []
        self.current: Version | None = None
        self.fallback: Version | None = None
        self.trial_left = 0
        self.swap: Snapshot | None = None  # the state from before the running version's build, until it steps
        self.audits: dict[int, dict[str, Any]] = {}
        self.reverted = 0  # versions that failed and were handed over to their fallback
        self.step_failures = 0  # failed steps (a fallback's failed redo counts too)
        self.released_start = False  # version 0 is the released starting program (not programs given to wrap)

    # -- installing ------------------------------------------------------------------------------------------
    def start(self, files: dict[str, str], released: bool) -> Version:
        """Install version 0 (the starting programs; ``released``: the released ones, unchanged): it runs, and it
        is the fallback."""
        self.install(Version(number=0, files=dict(files), status="passed"), previous=None)
        self.fallback = self.current
        self.released_start = released
        return self.current

    def install(self, version: Version, previous) -> None:
        """Load both programs of ``version``, build its updater and make it current; raises ProgramRejected on any
        failure (``build`` included). Both files pass the static check before either runs."""
        label = version_name(version.number)
        if version.number != 0 and version.digest in self.hung:  # the starting program is the last resort
            raise ProgramRejected(f"{label}: these programs hung in an earlier run of this folder (they ran past "
                                  f"their time limit and did not stop) and are never loaded again; change them")
        check_program("updater", version.files[UPDATER], label=f"{label}/updater")
        check_program("analysis", version.files[ANALYSIS], label=f"{label}/analysis")

        def top_level(fn, *args):
            return self.guard.call(version, "the top level of a program", fn, *args)

        updater_program = load_program("updater", version.files[UPDATER], label=f"{label}/updater",
                                       run=top_level)
        analysis_program = load_program("analysis", version.files[ANALYSIS], label=f"{label}/analysis",
                                        run=top_level)
        build = updater_program.module.__dict__.get("build")
        analyze = analysis_program.module.__dict__.get("analyze")
        if not callable(build):
            raise ProgramRejected(f"{label}/updater.py must define build(params, previous, spec)")
        if not callable(analyze):
            raise ProgramRejected(f"{label}/analysis.py must define analyze(obs, memory)")
        every = analysis_program.module.__dict__.get("EVERY", self.default_every)
        if type(every) is not int or every < 1:
            shown_every = repr(every) if type(every) is int else f"a {type_name(every)}"
            raise ProgramRejected(f"{label}/analysis.py: EVERY must be a positive integer, not {shown_every}")
        built, error = self.guard.call(version, "build()", _build, build, self.named, previous, self.spec)
        if error is not None:
            raise ProgramRejected(f"{label}/updater.py build() raised {failure_text(error)}\n"
                                  f"{trace_of(error, -3)}") from None
        if isinstance(built, str):
            raise ProgramRejected(f"{label}/updater.py: {built}")
        version.updater, version.param_groups = built
        version.analysis, version.every = analysis_program.module, every
        if version not in self.versions:
            self.versions.append(version)
        self.current = version

    def swap_in(self, files: dict[str, str], update: int) -> tuple[Version, str | None]:
        """Install an agent's edited programs as the next version and start its trial; on a rejection the state
        from before is restored, the previous version runs on, and the version is kept as failed. Returns the
        version and the rejection's text (None when it was installed)."""
        swap = Snapshot.take(update, self.named, self.spec)
        previous = self.current
        version = Version(number=len(self.versions), files=files, applied_at=update)
        try:
            self.install(version, previous=previous.updater)
        except ProgramRejected as error:
            swap.restore(self.named, self.spec)
            self.current = previous
            failed = Version(number=version.number, files=files, status="failed", applied_at=update)
            self.versions.append(failed)
            return failed, str(error)
        self.trial_left = self.trial_steps
        self.swap = swap
        return version, None

    # -- the trial and failures ------------------------------------------------------------------------------
    def trial_snapshot(self, update: int) -> Snapshot | None:
        """Before a step: the state to restore should it fail, when the running version is in its trial (the
        first trial step restores to before the swap). Called once per full step."""
        swap, self.swap = self.swap, None
        if self.current.status != "trial":
            return None
        snapshot = Snapshot.take(update, self.named, self.spec)
        return snapshot.before_swap(swap) if swap is not None else snapshot

    def trial_step_passed(self) -> bool:
        """One trial step of the running version passed; True when that ended its trial (it is the fallback now)."""
        self.trial_left -= 1
        if self.trial_left > 0:
            return False
        self.current.status = "passed"
        self.fallback = self.current
        return True

    def fallback_for(self, version: Version) -> Version:
        return self.fallback if self.fallback is not version else self.versions[0]

    def revert(self, version: Version) -> Version:
        """``version`` failed: it never runs again; its fallback runs from now on (and is returned)."""
        fallback = self.fallback_for(version)
        version.status = "failed"
        self.current = fallback
        if self.fallback is version:  # it had passed its trial: a failed version is no one's fallback
            self.fallback = fallback
        self.reverted += 1
        return fallback

    def to_start(self) -> Version:
        """The fallback failed too: the starting program runs, and is the fallback, from now on."""
        self.current = self.fallback = self.versions[0]
        return self.current

    # -- stepping --------------------------------------------------------------------------------------------
    def run_step(self, version: Version, grads, t: int, ctx) -> None:
        """``version``'s step of update ``t``, timed; an exception or a step over the time limit propagates (the
        optimizer's ``contained`` makes it a failure)."""
        if version.number == 0 and self.released_start:
            # The released starting program only calls the user's own optimizer (which sets its own grad mode) and
            # scheduler: no time limit (it has no fallback; it is the fallback) and no grad-mode switch, which
            # cost about as much as the rest of the wrapper put together on a small model.
            started = time.perf_counter()
            version.updater.step(grads, t, ctx)
            version.timed(time.perf_counter() - started)
            return
        elapsed = self.guard.run(version, _no_grad_step, version, grads, t, ctx)
        version.timed(elapsed)
        self.guard.enforce(elapsed)

    def failed_step(self) -> None:
        """A step failed (a fallback's failed redo counts too)."""
        self.step_failures += 1

    def audited(self, counts: dict[str, Any]) -> None:
        """The profiler's counts of a version's audited step (``counts["version"]``), shown to the agent."""
        self.audits[counts["version"]] = counts

    def refused(self, files: dict[str, str], update: int) -> Version:
        """Programs an answer carries that cannot be loaded at all (not regular UTF-8 files): kept as the next
        version, failed, as a program the check refused."""
        version = Version(number=len(self.versions), files=files, status="failed", applied_at=update)
        self.versions.append(version)
        return version

    def audit_due(self, version: Version) -> bool:
        return version.steps == 1 and version.number not in self.audits

    def quiet_until(self, t: int) -> int:
        """Up to which update the slots need nothing of a step but the released starting program's own: ``t``
        (none) unless that program runs, passed, with its audit done."""
        version = self.current
        if version.number != 0 or not self.released_start or version.status != "passed" or 0 not in self.audits:
            return t
        return 1 << 62

    # -- checkpoints -----------------------------------------------------------------------------------------
    def program_state(self, version: Version) -> tuple[Any, str | None]:
        """``version``'s ``updater.state_dict()``, taken under guard and checked at once: (the state, None), or
        (None, why it failed) (the caller reverts the version: a state that cannot be saved is its failure)."""
        state, error = self.guard.call(version, "state_dict()", method_call, version.updater, "state_dict")
        if error is not None:
            return None, f"state_dict() raised {failure_text(error)}"
        problem = plain_problem(state)
        if problem is not None:
            return None, f"state_dict() returned a state that cannot be saved: {problem}"
        return state, None

    def program_states(self, failed) -> tuple[Any, Any]:
        """The running version's and its fallback's program states, taken and checked now. A version whose state
        fails is handed to ``failed(version, why)`` first (the optimizer reverts the running one); then the state
        of what runs in its place is taken. The fallback failing leaves the starting program as the fallback; the
        starting program's own failure leaves {}."""
        while True:
            version = self.current
            state, problem = self.program_state(version)
            if problem is None:
                break
            failed(version, problem)
            if version is self.versions[0]:
                state = {}
                break
        fallback_state = None
        if self.fallback is not self.current:
            fallback_state, problem = self.program_state(self.fallback)
            if problem is not None:
                failed(self.fallback, problem)
                self.fallback.status = "failed"
                self.fallback = self.versions[0]
                fallback_state = self.program_state(self.fallback)[0] if self.fallback is not self.current else None
        return state, fallback_state

    def state_dict(self, updater_state: Any, fallback_state: Any) -> dict[str, Any]:
        """The slots' state with the running version's and its fallback's program states, taken (and checked)
        by ``program_state`` just before."""
        return {"versions": [{"number": v.number, "files": {k: str(text) for k, text in v.files.items()},
                              "status": v.status, "applied_at": v.applied_at, "steps": v.steps}
                             for v in self.versions],
                "current": self.current.number, "fallback": self.fallback.number, "trial_left": self.trial_left,
                "updater": updater_state,
                "fallback_updater": fallback_state if self.fallback is not self.current else None,
                "audits": {str(k): v for k, v in self.audits.items()}, "reverted": self.reverted,
                "step_failures": self.step_failures}

    def load_state_dict(self, state: dict[str, Any]) -> list[tuple[Version, str]]:
        """Rebuild the versions (the running one, the fallback and version 0 are installed again, with the
        optimizer and scheduler state already loaded) and their updaters' state. A version that cannot be
        installed again (it hung since, say) or whose ``load_state_dict`` fails is failed at once and its
        fallback runs; returns those versions with the reason, for the records."""
        by_number = {entry["number"]: Version(number=entry["number"], files=dict(entry["files"]),
                                              status=entry["status"], applied_at=entry["applied_at"],
                                              steps=int(entry["steps"]))
                     for entry in state["versions"]}
        self.versions = sorted(by_number.values(), key=lambda v: v.number)
        failures: list[tuple[Version, str]] = []
        for number in sorted({0, state["fallback"], state["current"]}):
            try:
                self.install(by_number[number], previous=None)
            except ProgramRejected as error:
                if number == 0:
                    raise
                by_number[number].status = "failed"
                failures.append((by_number[number], str(error)))
        self.fallback, self.current = by_number[state["fallback"]], by_number[state["current"]]
        self._load_program_state(self.current, state["updater"], failures)
        if self.fallback is not self.current and state["fallback_updater"] is not None:
            self._load_program_state(self.fallback, state["fallback_updater"], failures)
        self.reverted = int(state["reverted"])
        if self.fallback.status == "failed":
            self.fallback = self.versions[0]
        if self.current.status == "failed":
            self.current = self.fallback
            self.reverted += 1
        self.trial_left = int(state["trial_left"])
        self.audits = {int(k): v for k, v in state["audits"].items()}
        self.step_failures = int(state["step_failures"])
        self.swap = None
        return failures

    def _load_program_state(self, version: Version, program_state: Any, failures: list[tuple[Version, str]]) -> None:
        if version.status == "failed":
            return
        _, error = self.guard.call(version, "load_state_dict()", method_call, version.updater, "load_state_dict",
                                   program_state)
        if error is not None:
            if version.number != 0:  # the starting program is the last resort: it runs on, from a fresh state
                version.status = "failed"
            failures.append((version, f"load_state_dict() raised {failure_text(error)}"))
