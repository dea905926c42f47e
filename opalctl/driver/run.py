"""``opalctl run LOCK --arm A --seed S``: one formal, pre-registered run of one arm on one seed.

The order of work is the promise the product makes (docs/architecture.md traces it):

1. every record of the lock is re-hashed, and the run refuses to start on anything that changed;
2. the evaluator process starts (driver/evaluator.py) before any agent program can load: it reads the lock and
   the evaluation splits, and evaluates the anchor (the original parent for this seed) once per lock and seed, or
   re-checks its record;
3. the arm's model, sampler and optimizer are built from the ``train`` split alone (an agent arm's optimizer is
   wrapped), ``initial.pt`` is saved, an agent arm's training process is confined by the operating system where it
   can be (``opalctl.sandbox``: it may write only its ``training/`` folder of the run, start no process, use
   bounded memory), the evaluator is told how the run started and writes ``start.json``, and a resume's state is
   restored;
4. the budget loop charges each whole update (batch, forward, loss, backward, clipping, step) to the protocol's
   clock, with what agent code ran outside the updates since the last one (a program built at a decision, its
   state taken at a checkpoint), and nothing else: evaluations, checkpoint writes and log writes happen between
   timed intervals and are recorded on their own. No update is cut short; the run ends after the first update that
   reaches 100 %, and the overshoot is recorded;
5. at each budget fraction the state is checkpointed, and the evaluator reads the stage's checkpoint file itself,
   evaluates it, decides about it by the promotion policy (which always measures floors against the anchor) and
   writes its record; it tells an agent arm's training process only that the stage was recorded;
6. the evaluator writes ``selected.json``, ``last.json`` and ``report.json`` from its records, what the kernel
   counted of this process, and the training facts this process sends.

Every name of the run folder is ``opalctl/layout.py``'s (``RunLayout``): the records of results lie beside
``training/``, this process's own, and ``agent/``, the agent host's. The parts own their state: ``build.ArmParts``
what trains, ``ledger.Ledger`` every total, the evaluator the evaluation, the promotion decisions and the records of
results, ``Carried`` what a resume must carry beside the parts' own states, and ``BudgetLoop`` the loop over them.
``FormalRun.execute`` is the sequence above.

A resume checkpoint holds everything the loop needs (model, optimizer, sampler, schedule, budget meter, RNG
states, running totals, how many stages it has passed, how many lines of ``steps.jsonl.gz`` precede it), so
``--resume`` after a crash ends, for a deterministic arm, with exactly the weights of an uninterrupted run; the
evaluator judges the stages passed again from its own records and their checkpoint files before the loop
continues, and the resume refuses a steps file that is not the one its checkpoint records (its digests travel in
it).

One run per folder: the folder's lock (a file beside it, ``FolderLock``) is taken first, and only then is it
decided whether this start may use the folder (``claim_folder``, by ``RunLayout.state``): a started or finished
run is never started over, ``--resume`` needs a resume checkpoint (or a run that never got past update 0), and
``--restart`` starts a started, unfinished run again from update 0 after moving its folder aside whole
(``seed-S.abandoned-N``). A stop signal (SIGINT, SIGTERM, SIGHUP), a storage fault or a bound of the confinement
ends a run in one sentence that gives the command continuing it (``StopSignals``, ``told``).

Under torchrun (``training.ranks`` above 1) every rank runs this sequence on its own batches: rank 0 alone
claims the folder, talks to the evaluator and writes; the others train beside it, charged what rank 0 is charged,
and write nothing. An agent arm's optimizer is wrapped on every rank (``opal.distributed``: rank 0 has the agent
and its records, the others follow it), and every rank's training process is confined. What the ranks tell each
other, and why that keeps them at the same update, is driver/ranks.py's; a world of one rank is today's single
process, with nothing wrapped.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import platform
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.compare.aggregate import read_report
from opalctl.compare.decisions import RunEnding
from opalctl.driver.arm import make_update, wrap_agent
from opalctl.driver.budget import BudgetMeter, ChargingClock, PendingCharge, TrainingBudget, clock_spec, make_clock
from opalctl.driver.build import build_arm, check_device, choose_arm, peak_memory_bytes
from opalctl.driver.evaluation import rng_state, set_rng_state
from opalctl.driver.evaluator import EvaluatorProcess
from opalctl.driver.ledger import Ledger
from opalctl.driver.ranks import FollowerSteps, Ranks, join, lost_rank, torchrun_line
from opalctl.driver.records import FLUSH_LINES, StepsWriter, locate
from opalctl.errors import BadInput, InputChanged, Interrupted, OpalctlError, StorageFault
from opalctl.files import storage, storage_fault
from opalctl.formats import (
    CarriedStages,
    Message,
    Opening,
    StageFacts,
    StageReached,
    StageSaved,
    Starting,
    TrainingFacts,
)
from opalctl.layout import (
    AT_UPDATE_0,
    FINISHED,
    NEW,
    RESUMABLE,
    LockRuns,
    RunLayout,
    flock_holders,
    runs_dir_default,
)
from opalctl.opal.agents import registry
from opalctl.opal.agents.host import release_secrets
from opalctl.protocol.lock import read_lock
from opalctl.protocol.recheck import require_unchanged
from opalctl.sandbox import bound_refusal, confine_process, device_access, training_bounds, training_paths
from opalctl.tasks.calls import TaskFailed
from opalctl.training_folder import clear_strays

__all__ = ["run", "FormalRun", "RunCommand", "runs_dir_default"]

LOCK_WAIT_SECONDS = 30.0  # how long a run waits for a folder's lock no live run holds before calling it busy
# how long a stop signal waits for the update in progress to end, so that a resume checkpoint is written at it;
# well under the grace a grid (60 s) or Slurm (KillWait, 30 s by default) gives a run it stops
STOP_WAIT_SECONDS = 10.0


# --------------------------------------------------------------------------------------------------------------
# the folder

@dataclass(frozen=True)
class RunCommand:
    """The command line of this run as the user would type it again: what a refusal, an interruption or a storage
    fault tells them to type next."""

    lock: str
    arm: str
    seed: int
    runs_dir: str | None = None  # only when one was given: the same environment finds the default again
    ranks: int = 1  # the lock's training.ranks: more than one is a torchrun command

    def line(self, flag: str = "") -> str:
        words = ["opalctl", "run", self.lock, "--arm", self.arm, "--seed", str(self.seed)]
        words += ["--runs-dir", self.runs_dir] if self.runs_dir is not None else []
        words += [flag] if flag else []
        return shlex.join(torchrun_line(self.ranks, words) if self.ranks > 1 else words)

    def next_step(self, layout: RunLayout) -> tuple[str, str]:
        """What continues the run in ``layout`` now, by the state its folder is in: (verb, command line)."""
        state = layout.state
        if state in (RESUMABLE, AT_UPDATE_0):
            return "resume", self.line("--resume")
        if state not in (NEW, FINISHED):
            return "start it again", self.line("--restart")
        return "start it again", self.line()


class FolderLock:
    """The lock of one arm and seed's run folder: a file beside the folder, in the arm's folder, so that a finished
    folder holds its records and nothing else, and an abandoned attempt is moved aside under the lock (``--restart``).
    The evaluator and the steps helper inherit it and hold it as long as they live; nothing is ever written into
    it."""

    def __init__(self, layout: RunLayout):
        self.run, self.path = layout.root, layout.folder_lock
        with storage(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write access

    def fileno(self) -> int:
        return self.fd

    def acquire(self) -> None:
        # A lock taken by a live process is busy at once. The evaluator and the steps helper of a run that was just
        # killed hold it until they see their input end (records.py), the evaluator after the evaluation it is in
        # (seconds on a loaded machine), so a prompt resume waits for them before calling the folder busy.
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self._live_holder()
                if not holder and time.monotonic() >= deadline:
                    holder = self._openers()
                if holder or time.monotonic() >= deadline:
                    raise BadInput(f"another opalctl process{holder} is running {self.run} now; wait for it to "
                                   f"finish") from None
                time.sleep(0.05)

    def _live_holder(self) -> str:
        """`` (pid N)`` when the process that took the lock is alive (``/proc/locks`` names it; a killed run's
        helpers hold it under the dead run's id), else ``""``, also where the system does not say."""
        try:
            pids = sorted(flock_holders(os.fstat(self.fd)))
            states = [Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] for pid in pids]
        except (OSError, ValueError, IndexError):
            return ""
        return next((f" (pid {pid})" for pid, state in zip(pids, states) if state != "Z"), "")

    def _openers(self) -> str:
        """`` (pid N)``, `` (pids N, M)``: the live processes other than this one that have the lock's file open
        (a killed run's helper that inherited it, still alive past the wait), from ``/proc``; ``""`` where it does
        not say."""
        status = os.fstat(self.fd)
        pids = []
        try:
            processes = [entry for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()]
        except OSError:
            return ""
        for pid in processes:
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    found = os.stat(f"/proc/{pid}/fd/{fd}")
                    if (found.st_dev, found.st_ino) == (status.st_dev, status.st_ino):
                        pids.append(pid)
                        break
            except OSError:
                continue
        if not pids:
            return ""
        return f" (pid {pids[0]})" if len(pids) == 1 else f" (pids {', '.join(pids[:4])})"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim_folder(layout: RunLayout, mode: str, command: RunCommand) -> FolderLock:
    """Take the run folder's lock, then decide under it whether this start may use the folder (``mode``: start,
    resume or restart), and make it ready; returns the held lock."""
    if layout.state == NEW:  # what a new folder is refused (a resume) is refused before the lock's file is made
        _may_use(layout, mode, command)
    lock = FolderLock(layout)
    try:
        lock.acquire()
        _may_use(layout, mode, command)
        with storage(layout.root):
            _prepare(layout, mode)
    except BaseException:
        lock.close()
        raise
    return lock


def _may_use(layout: RunLayout, mode: str, command: RunCommand) -> None:
    """Refuse, naming the folder, a start this folder's state does not allow."""
    run, state = layout.root, layout.state
    if state == FINISHED:
        said = "restarted" if mode == "restart" else "overwritten"
        raise BadInput(f"run {run} already finished (its report is {layout.report}) and a finished run is "
                       f"never {said}; use --runs-dir for a separate copy")
    if mode == "resume" and state == NEW:
        raise BadInput(f"there is no run to resume in {run}; start it without --resume")
    if mode == "resume" and state not in (RESUMABLE, AT_UPDATE_0):
        raise BadInput(f"run {run} has no resume checkpoint ({layout.resume} is missing), so --resume cannot "
                       f"continue it; start it again from update 0 with `{command.line('--restart')}`, which keeps "
                       f"what it wrote aside")
    if mode == "start" and state != NEW:
        way = (f"continue it with `{command.line('--resume')}`" if state in (RESUMABLE, AT_UPDATE_0) else
               f"start it again from update 0 with `{command.line('--restart')}`, which keeps what it wrote aside")
        raise BadInput(f"run folder {run} already holds a started run, and a run is never overwritten; {way}")


def _prepare(layout: RunLayout, mode: str) -> None:
    """Under the lock: move an abandoned attempt aside (``--restart``), or clear what a dead session left that no
    record counts, then make the folder and training's own folder in it."""
    state = layout.state
    if mode == "restart" and state != NEW:
        layout.root.rename(layout.next_abandoned())
    elif state in (NEW, AT_UPDATE_0):
        # what a start that never trained an update left: the agent's records and the training's own files (its
        # start is made again from update 0); the records of results are the evaluator's, made again too
        for folder in (layout.agent, layout.training):
            if folder.is_dir() and folder != layout.root:
                shutil.rmtree(folder)
    for folder in {layout.root, layout.training}:
        if folder.is_dir():
            # the temporary files of writes a killed session never finished (files.atomic_write_bytes): no record
            # names them, and the lock says that no process of this run is writing any more; a folder made by an
            # older opalctl also held its lock in the folder itself
            for leftover in [*folder.glob(".*.tmp"), folder / ".running"]:
                leftover.unlink(missing_ok=True)
    layout.training.mkdir(parents=True, exist_ok=True)


def write_initial(layout: RunLayout, parts) -> dict[str, Any]:
    """``initial.pt``, written before the training process is confined (afterwards it cannot write beside the
    records); returns what the evaluator's ``start.json`` records of it."""
    initial = checkpoints.save(layout.initial, parts.model.state_dict(), kind="initial", meta={"update": 0})
    return {"file": layout.name_of(layout.initial), "sha256": initial["sha256"],
            "model_sha256": initial["model_sha256"]}


# --------------------------------------------------------------------------------------------------------------
# what a resume carries

@dataclass
class Carried:
    """What a resume checkpoint carries beside the parts' own states and the ledger. The stage records are the
    evaluator's, in the run folder: the resume only counts how many of them it has passed."""

    stages: int = 0  # the stages judged before this checkpoint
    # the charge of agent code that ran outside the timed updates, not yet added to an update's (BudgetLoop)
    agent_charge: float = 0.0
    next_checkpoint: int = 1  # the index k of the next resume checkpoint, due at k * checkpoint_every
    steps_lines: int = 0  # the lines steps.jsonl.gz holds for the updates before this session
    # what a resume checks its steps file against (None: a checkpoint written by an opalctl that did not carry them)
    steps_seen: str | None = None  # the rows digest after those lines
    steps_sha256: str | None = None  # the bytes of steps.jsonl.gz up to the end of those lines


def restore(layout: RunLayout, parts, meter, ledger: Ledger, limit_bytes: int, ranks: Ranks | None = None) -> Carried:
    """Load the resume checkpoint into the parts, the meter, the RNGs and the ledger; return what it carries. Under
    torchrun each rank restores its own sampler and RNG states (``ranks``), from a checkpoint of the same world."""
    try:
        payload = checkpoints.load(layout.resume, limit_bytes=limit_bytes, expected_shapes=parts.shapes,
                                   require_finite=False)
    except checkpoints.CheckpointRefused as error:
        raise checkpoints.CheckpointRefused(
            f"cannot resume: {error.message}; start the run again from update 0 with --restart, which keeps "
            f"what {layout.root} holds aside") from None
    extra = payload["extra"]
    own = rank_state(layout.resume, extra.get("ranks"), ranks or Ranks())
    parts.model.load_state_dict(payload["model"])
    # an agent arm's optimizer state differs between rank 0 (the agent's) and the ranks that follow it
    parts.optimizer.load_state_dict(own["optimizer"] if own is not None and "optimizer" in own else extra["optimizer"])
    parts.sampler.load_state_dict(extra["sampler"] if own is None else own["sampler"])
    parts.schedule.load_state_dict(extra["schedule"])
    meter.load_state_dict(extra["meter"])
    set_rng_state(extra["rng"] if own is None else own["rng"])
    ledger.load_state_dict(extra["totals"])
    return Carried(stages=int(extra["stages"]), agent_charge=float(extra.get("agent_charge", 0.0)),
                   next_checkpoint=extra["next_checkpoint"],
                   steps_lines=int(extra["steps_lines"]), steps_seen=extra.get("steps_seen"),
                   steps_sha256=extra.get("steps_sha256"))


def rank_state(path: Path, states: list[dict[str, Any]] | None, ranks: Ranks) -> dict[str, Any] | None:
    """This rank's own states (sampler, RNG, and an agent arm's optimizer) in a checkpoint of a torchrun run
    (``states``, one per rank); None for a single-process run, whose states are the checkpoint's own."""
    world = 1 if states is None else len(states)
    if world != ranks.world:
        raise BadInput(f"the resume checkpoint {path} was written by a run of {world} rank(s) and this one has "
                       f"{ranks.world}; resume it with the world the lock's training.ranks says, or start it again "
                       f"from update 0 with --restart")
    return None if states is None else states[ranks.rank]


def check_steps(path: Path, found, carried: Carried, resume: Path) -> None:
    """Refuse a resume whose steps records are not those its checkpoint counts (``found``: ``records.locate``'s
    answer), however well formed they are."""
    differs = [name for name, want, got in (("rows digest", carried.steps_seen, found.seen),
                                            ("sha256", carried.steps_sha256, found.sha256))
               if want is not None and want != got]
    if differs:
        which = " and ".join(differs) + (" differ" if len(differs) > 1 else " differs")
        raise InputChanged(f"the run's steps records {path} are not those its resume checkpoint {resume} counts "
                           f"(its {which}: the file was rewritten); restore it, or start the run again from update "
                           f"0 with --restart")


# --------------------------------------------------------------------------------------------------------------
# the loop

class BudgetLoop:
    """Steps 4 and 5 of the module docstring: the budget loop over the parts, its stages and its checkpoints."""

    def __init__(self, protocol, parts, agent, budget: TrainingBudget, ledger: Ledger, evaluator: EvaluatorProcess,
                 steps: StepsWriter, carried: Carried, layout: RunLayout, progress: Callable[..., None],
                 say: Callable[[str], None], ranks: Ranks | None = None):
        self.protocol, self.parts, self.agent, self.budget = protocol, parts, agent, budget
        self.ledger, self.evaluator, self.steps = ledger, evaluator, steps
        self.carried, self.layout = carried, layout
        self.progress, self.say = progress, say
        # under torchrun rank 0 alone acts on stages and writes; the others wait for it (driver/ranks.py)
        self.ranks = ranks or Ranks()
        self.saved_at = budget.meter.updates  # the update of the last resume checkpoint (a resume starts at its own)
        self.stop_asked: list[int] = []  # StopSignals.asked while the loop runs

    def run(self, first_checkpoint: bool, session: tuple[float, float]) -> TrainingFacts:
        """Train until the budget is spent (after a resume checkpoint at update 0 when ``first_checkpoint``);
        returns what the evaluator needs of this process to close the run. ``session``: the wall and CPU clocks
        when this session started."""
        import torch  # torch, and what imports it, here: this module is imported without it (the CLI, the grid)

        if first_checkpoint:
            self.write_resume()
        # Every object alive now (the interpreter, torch, the task, the parts) is set aside from the garbage
        # collector while the loop runs: a full collection walks them all, and on a large process that is a pause
        # of a tenth of a second or more that would land inside whichever timed update it happens to, charging it
        # to the budget at random. They are handed back when the loop ends.
        gc.freeze()
        # a stop signal waits for the update in progress, then the resume checkpoint at it (StopSignals); under
        # torchrun the ranks would have to agree on the update first, so there a stop happens where each rank is
        stops = StopSignals.active if self.ranks.world == 1 else None
        try:
            with stops.deferred() if stops is not None else contextlib.nullcontext([]) as self.stop_asked:
                self._loop()
            if self.stop_asked:  # it came after the last update's look: the checkpoint at that update is there
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            if stops is not None and self.saved_at != self.budget.meter.updates:
                # what the resume trains again, and why no checkpoint was written at the stop, for the sentence
                stops.lost = (self.saved_at, self.budget.meter.updates,
                              stops.at_once_span or f"before the update in progress ended (it waited "
                                                    f"{STOP_WAIT_SECONDS:g} s)")
            raise
        finally:
            gc.unfreeze()
        self.steps.close()
        self.ledger.take(self.steps.take_sums())
        figures = self.agent.close() if self.agent is not None else None
        self.ledger.loop_ends()
        meter = self.budget.meter
        return TrainingFacts(
            updates=meter.updates, budget_total=meter.total, budget_used=meter.used, overshoot=meter.overshoot,
            ledger=self.ledger.figures(), rows_digest=self.steps.seen, agent=figures,
            final_model_sha256=checkpoints.model_sha256(self.parts.model.state_dict()),
            peak_memory_bytes=peak_memory_bytes(),
            peak_device_memory_bytes=(int(torch.cuda.max_memory_allocated())
                                      if self.protocol.training.device == "cuda" else None),
            session_wall=time.perf_counter() - session[0], session_cpu=time.process_time() - session[1])

    def _loop(self) -> None:
        import torch  # as in ``run``

        from opalctl.opal.observer import StepLearningRates  # imports torch

        parts, meter, agent = self.parts, self.budget.meter, self.agent
        # The loop body runs once per update, and everything it does between two updates costs several times what
        # it would in a tight loop (the caches hold the model's work; see records.py): what does not change is
        # looked up once here, and a call is avoided wherever an inline operation does the same.
        update = make_update(parts.task, self.ranks.for_update(parts.model), parts.optimizer, parts.clip,
                             pass_loss=agent is not None)
        next_batch = parts.sampler.next_batch
        clock_start, clock_stop = self.budget.clock.start, self.budget.clock.stop
        charge_meter = meter.charge
        # a formats.StepRow per update, appended as a plain tuple rather than through StepsWriter.add: the loss
        # as a number on the CPU, where reading it costs no synchronisation, and detached elsewhere; the batch's
        # ids themselves when the sampler promises they stay as they are (Sampler.fresh_ids), else a copy; and the
        # learning rate of each group as the step of the arm's torch optimizer (the schedule's, which an agent's
        # program steps) used it, a list of the groups' Python numbers read by a hook of that optimizer
        fresh_ids = bool(getattr(parts.sampler, "fresh_ids", False))
        take_lrs = StepLearningRates(parts.schedule.optimizer).take
        kept = self.steps.pending
        keep_step, flush_lines, flush_steps = kept.append, FLUSH_LINES, self.steps.flush
        loss_value = torch.Tensor.item if self.protocol.training.device == "cpu" else torch.Tensor.detach
        needs_boundary = agent.needs_boundary if agent is not None else None
        if agent is not None:
            self._take_agent_code()  # what a resume's load_state_dict ran
        apply_schedule = None if parts.schedule.schedule.constant else parts.schedule.apply  # constant: set once
        perf_counter, progress = time.perf_counter, self.progress
        asked = self.stop_asked  # a stop signal's, read after each update (StopSignals)
        last_progress = 0.0
        # k * every is compared with a tolerance: repeated float sums (0.05 * 3 = 0.15000000000000002) would
        # otherwise push a checkpoint one update late
        checkpoint_due = self.carried.next_checkpoint * self.protocol.training.checkpoint_every - 1e-9
        self.ledger.loop_begins()
        while not meter.done:
            if apply_schedule is not None:
                apply_schedule(meter.fraction_used)
            wall0 = perf_counter()
            token = clock_start()
            batch = next_batch()
            loss = update(batch)
            charge = clock_stop(token)
            wall1 = perf_counter()
            reached = charge_meter(charge)
            # everything below is outside the timed interval; the update's figures are added to the ledger at the
            # next flush, and its line is digested and written by the steps helper (see records.py)
            keep_step((meter.updates, charge, meter.used, wall1 - wall0, loss_value(loss),
                       batch.ids if fresh_ids else batch.ids.copy(), take_lrs()))
            if len(kept) >= flush_lines:
                flush_steps()
            if needs_boundary is not None and not meter.done and needs_boundary():
                self._between_updates()
            if reached or (meter.used / meter.total >= checkpoint_due and not meter.done):
                checkpoint_due = self._boundary(reached)
            if wall1 - last_progress > 0.25:
                last_progress = wall1
                progress(meter.used, meter.total, stage=self.carried.stages,
                         stages=len(self.protocol.budget.fractions), loss=float(loss.detach()))
            if asked:
                self._stop_here()

    def _stop_here(self) -> None:
        """A stop signal arrived during the update that just ended: the resume checkpoint at it (unless this
        update wrote one), the very one a periodic checkpoint here would be, then the stop."""
        if self.saved_at != self.budget.meter.updates:
            self._boundary([])
        raise KeyboardInterrupt

    def _between_updates(self) -> None:
        """The agent's work (and training's waiting for it), outside the timed interval."""
        with self.ledger.outside("agent_wait_wall"):
            self.agent.between_updates()
        self._take_agent_code()

    def _take_agent_code(self) -> None:
        """The agent code that ran outside the timed updates since the last look (a program built at a decision,
        its state taken at a checkpoint, loaded at a resume), charged with the next update on the clocks that
        charge time: agent code never runs off the budget (docs/architecture.md)."""
        self.budget.charge_agent_code(*self.agent.take_outside_charge())

    def _boundary(self, reached: list[int]) -> float:
        """The stages this update reached, then a resume checkpoint; returns where the next checkpoint is due."""
        if reached:
            self.ranks.lead_alone(lambda: self.stage(reached))
        every = self.protocol.training.checkpoint_every
        carried = self.carried
        while carried.next_checkpoint * every - 1e-9 <= self.budget.meter.fraction_used:
            carried.next_checkpoint += 1
        self.write_resume()
        return carried.next_checkpoint * every - 1e-9

    def stage(self, indices: list[int]) -> None:
        """Save the stages' checkpoint and have the evaluator judge it. What it answers is the stages it recorded;
        the results themselves reach this process only for an arm without an agent (an agent arm's training
        process runs agent code, which must not learn them: they are in the evaluator's stage records)."""
        ledger, meter, carried = self.ledger, self.budget.meter, self.carried
        with ledger.outside():
            ledger.take(self.steps.take_sums())
            with ledger.outside("checkpoint_wall"):
                saved = [StageSaved.of(index, checkpoints.save(
                    self.layout.stage_checkpoint(index + 1), self.parts.model.state_dict(), kind="stage",
                    meta={"stage": index + 1, "update": meter.updates})) for index in indices]
            if self.agent is not None:
                self.agent.report_dev(stage=indices[-1] + 1)  # opens the evaluation-integrity check here
            facts = StageFacts(update=meter.updates, budget_used=meter.used, budget_fraction_used=meter.fraction_used,
                               examples=ledger.examples, train_cpu_seconds=ledger.train_cpu,
                               train_wall_seconds=ledger.train_wall, loss=self.steps.last_loss)
            stops = StopSignals.active if self.ranks.world == 1 else None
            with ledger.outside("eval_wall"), (stops.at_once("while the evaluator judged the stage")
                                               if stops is not None else contextlib.nullcontext()):
                verdict = self.evaluator.ask(Message.STAGE, StageReached(saved=saved, facts=facts))
            count = len(self.protocol.budget.fractions)
            for recorded in verdict.stages:
                carried.stages += 1
                said = recorded.said or f"judged (in {self.layout.stage_record(recorded.stage).name})"
                self.say(f"stage {recorded.stage}/{count} at update {meter.updates}: {said}")

    def write_resume(self) -> None:
        """``resume.pt``, on rank 0; under torchrun it carries every rank's own sampler and RNG states, and an
        agent arm's optimizer state, which differs between rank 0 (the agent's) and the ranks that follow it."""
        states = None
        if self.ranks.world > 1:
            own = {"sampler": self.parts.sampler.state_dict(), "rng": rng_state()}
            if self.agent is not None:
                own["optimizer"] = self.parts.optimizer.state_dict()
                if not self.ranks.lead:
                    self._take_agent_code()
            states = self.ranks.gather(own)
        if not self.ranks.lead:
            return
        with self.ledger.outside("checkpoint_wall"):
            # every line so far is on the disk before the checkpoint that counts them is written, and the
            # checkpoint carries their digests, which the steps helper computes (records.py)
            self.steps.begin_sync()
            self.steps.finish_sync()
            extra = self._loop_state()
            if states is not None:
                extra["ranks"] = states
            checkpoints.save(self.layout.resume, self.parts.model.state_dict(), kind="resume",
                             extra=extra, meta={"update": self.budget.meter.updates})
        self.saved_at = self.budget.meter.updates

    def _loop_state(self) -> dict[str, Any]:
        """The state a resume continues from; call it after ``steps.finish_sync`` (every line on the disk)."""
        self.ledger.take(self.steps.take_sums())
        parts, carried = self.parts, self.carried
        optimizer = parts.optimizer.state_dict()
        if self.agent is not None:
            self._take_agent_code()  # the programs' state_dict(), charged with the update after this checkpoint
        return {
            "optimizer": optimizer,
            "agent_charge": self.budget.pending.amount,
            "sampler": parts.sampler.state_dict(),
            "schedule": parts.schedule.state_dict(),
            "meter": self.budget.meter.state_dict(),
            "rng": rng_state(),
            "totals": self.ledger.state_dict(),
            "stages": carried.stages,
            "next_checkpoint": carried.next_checkpoint,
            "steps_lines": self.steps.lines,
            "steps_seen": self.steps.seen,
            "steps_sha256": self.steps.sha256,
        }


# --------------------------------------------------------------------------------------------------------------
# the run

class FormalRun:
    """One run of one arm on one seed: ``execute`` is the module docstring's sequence of steps. Under torchrun
    (``training.ranks`` above 1) every rank runs it: rank 0 claims the folder, talks to the evaluator and writes
    every file; the others train beside it and write nothing (driver/ranks.py)."""

    def __init__(self, lock, arm_name: str, seed: int, runs_dir: Path, *, clock_factory=None,
                 progress: Callable[..., None] | None = None, say: Callable[[str], None] | None = None,
                 confine: bool = False, command: RunCommand | None = None):
        self.lock = lock
        self.protocol = lock.protocol()
        self.arm = choose_arm(self.protocol, arm_name, seed, f"lock {lock.path}", "the lock's")
        self.arm_name, self.seed = arm_name, seed
        self.layout = LockRuns.of(runs_dir, lock).run(arm_name, seed)
        self.clock_factory = clock_factory
        self.progress = progress or (lambda *args, **kwargs: None)
        self.say = say or (lambda text: None)
        # the OS confinement lasts as long as the process: only a process that is this one run (`opalctl run`)
        # asks for it, never a caller that runs a formal run among its other work (a test, a notebook)
        self.confine = confine
        self.command = replace(command or RunCommand(str(lock.path), arm_name, seed, str(runs_dir)),
                               ranks=self.protocol.training.ranks)
        self.ranks: Ranks = Ranks()

    def execute(self, resume: bool = False, restart: bool = False) -> dict[str, Any]:
        """The run; ``resume`` continues it from its resume checkpoint, ``restart`` starts a started one again
        from update 0, its folder moved aside (``seed-S.abandoned-N``). What the task prints goes to stderr:
        stdout carries the command's report alone (one JSON document under ``--json``)."""
        with contextlib.redirect_stdout(sys.stderr):
            return self._execute_run(resume, restart)

    def _execute_run(self, resume: bool, restart: bool) -> dict[str, Any]:
        if resume and restart:
            raise BadInput("--resume and --restart exclude each other; choose one")
        require_unchanged(self.lock)
        check_device(self.protocol, advice="run on a machine with a GPU or set training.device: cpu")
        if self.arm.agent is not None and (missing := registry.unready(self.arm.agent)):
            raise BadInput(f"arm {self.arm_name}: {missing}")  # before any folder is made: a refusal leaves nothing
        mode = "resume" if resume else "restart" if restart else "start"
        self.ranks = join(self.protocol, self.command.line({"start": ""}.get(mode, f"--{mode}")))
        try:
            if not self.ranks.lead:  # rank 0 alone prints; the others would say it again
                self.progress, self.say = (lambda *args, **kwargs: None), (lambda text: None)
            handle = self.ranks.answer_of_lead(lambda: claim_folder(self.layout, mode, self.command))
            try:
                return self._execute(resume, handle)
            finally:
                if handle is not None:
                    handle.close()
        finally:
            self.ranks.close()

    def _execute(self, resume: bool, lock_handle) -> dict[str, Any]:
        session = (time.perf_counter(), time.process_time())
        if not self.ranks.lead:
            return self._train(None, resume, None, session)
        # the evaluator starts before anything of an agent exists in this process, and works on the anchor while
        # the arm is built; it holds the folder's lock too, so no resume starts before it has ended
        evaluator = EvaluatorProcess(Opening(
            lock=str(self.lock.path), lock_sha256=self.lock.sha256, arm=self.arm_name, seed=self.seed,
            run_dir=str(self.layout.root), anchor_dir=str(self.layout.anchor.folder), sys_path=list(sys.path)),
            inherit_fds=(lock_handle.fileno(),))
        try:
            return self._train(evaluator, resume, lock_handle, session)
        finally:
            evaluator.end()

    def _train(self, evaluator: EvaluatorProcess | None, resume: bool, lock_handle, session) -> dict[str, Any]:
        protocol, layout, ranks = self.protocol, self.layout, self.ranks
        parts, agent, budget = self._build()
        meter = budget.meter
        # the secrets `opalctl run` started again without (opal/handover.py): the agent host has read them, if the
        # arm has one; this process never does, and closes its end before anything it runs could
        release_secrets()
        ledger = Ledger(cpu_charges=clock_spec(protocol.budget.clock).cpu_charges)
        resuming = resume and layout.resume.exists()  # else the claim found it at update 0
        if ranks.lead:
            carried, steps = self._open_records(evaluator, parts, agent, meter, ledger, resuming, lock_handle)
        else:
            if agent is not None and self.confine:  # every rank's training process runs the agent's programs
                confine_training(layout, protocol)
            carried = restore(layout, parts, meter, ledger, protocol.limits.checkpoint_bytes, ranks) \
                if resuming else Carried()
            steps = FollowerSteps()
        budget.pending.amount = carried.agent_charge
        loop = BudgetLoop(protocol, parts, agent, budget, ledger, evaluator, steps, carried, layout, self.progress,
                          self.say, ranks)
        if evaluator is not None:
            evaluator.advice = "resume the run with --resume"  # from its first resume checkpoint on
        try:
            training = loop.run(first_checkpoint=not resuming, session=session)
        except BaseException:
            steps.abandon()  # its helper process ends; the lines not yet durable are cut by a resume
            raise
        report = None
        if ranks.lead:
            report = evaluator.ask(Message.CLOSE, training).report
            layout.resume.unlink(missing_ok=True)
        return ranks.from_lead(report)

    def _open_records(self, evaluator: EvaluatorProcess, parts, agent, meter, ledger: Ledger, resuming: bool,
                      lock_handle) -> tuple[Carried, StepsWriter]:
        """Rank 0's start of the records: a resume's strays cleared, a new run's ``initial.pt`` (before the
        confinement: it lies beside the records), the steps helper (started before the confinement too: after it
        this process starts no process), the confinement, the start the evaluator records, a resume's checks and
        carried stages, and the steps file opened where the run left it. Everything sent to the evaluator here is
        sent before any agent program can have run."""
        protocol, layout = self.protocol, self.layout
        confining = agent is not None and self.confine
        if resuming:  # under the folder's lock, before anything of this session opens a file there
            removed = clear_strays(layout)
            if removed:
                self.say(f"removed {len(removed)} file(s) from {layout.training} that the run never writes "
                         f"({', '.join(removed[:3])}{', ...' if len(removed) > 3 else ''})")
        initial = None if resuming else write_initial(layout, parts)
        # A steps line carries a CPU figure only when the clock charges CPU seconds (see ledger.py for the CPU
        # figure under the other clocks). The steps helper holds the folder's lock too, so no resume cuts the file
        # back while it still writes.
        steps = StepsWriter.started(layout.steps, cpu_charges=ledger.cpu_charges,
                                    inherit_fds=(lock_handle.fileno(),), confine=confining)
        try:
            confinement = confine_training(layout, protocol) if confining else None
            evaluator.answer()  # the anchor is evaluated, or its record checked
            evaluator.ask(Message.START, Starting(
                confinement=confinement, initial=initial,
                inherited=None if resuming else parts.built.inherited,
                initialised=None if resuming else parts.built.initialised,
                groups=None if resuming else parts.groups, host=platform.node()))
            if resuming:
                evaluator.advice = "resume the run with --resume"
                carried = restore(layout, parts, meter, ledger, protocol.limits.checkpoint_bytes, self.ranks)
                found = locate(layout.steps, carried.steps_lines)
                check_steps(layout.steps, found, carried, layout.resume)
                evaluator.ask(Message.CARRIED, CarriedStages(stages=carried.stages, update=meter.updates))
                self.say(f"resuming {layout.root} at update {meter.updates}")
            else:
                carried = Carried()
                found = locate(layout.steps, 0)  # offset 0: the file starts over
            steps.open(found.offset, found.seen, carried.steps_lines)
        except BaseException:
            steps.abandon()
            raise
        return carried, steps

    def _build(self):
        """Step 3: the arm's parts from the train split (this rank's sampler), its budget (the meter, and the clock
        whose charges are combined over the ranks), and the agent optimizer for an agent arm."""
        protocol, device = self.protocol, self.protocol.training.device
        parts = build_arm(protocol, self.arm, self.seed, self.lock.parent_path(self.seed),
                          {"train": self.lock.data_path("train")}, rank=self.ranks.rank)
        meter = BudgetMeter(protocol.budget.amount * self.arm.budget_multiplier, list(protocol.budget.fractions))
        clock = (self.clock_factory or (lambda name: make_clock(name, device)))(protocol.budget.clock)
        pending = PendingCharge()  # agent code's charge from outside the updates (driver/budget.py)
        if self.arm.agent is not None:
            clock = ChargingClock(clock, pending)
        spec = clock_spec(protocol.budget.clock)
        budget = TrainingBudget(meter, self.ranks.reduced(clock, spec.combine), pending, spec.agent_code_charge)
        agent = None
        if self.arm.agent is not None:
            # the agent optimizer wraps the arm's own optimizer: clipping is handed over to its starting program
            # and decisions happen between timed updates; the budget schedule keeps setting the base learning rate
            agent = wrap_agent(self.arm, parts.optimizer, parts.model, progress=lambda: meter.fraction_used,
                               layout=self.layout, clip=parts.clip, budget=protocol.budget,
                               world=self.ranks.world)
            parts = replace(parts, optimizer=agent, clip=None)
        return parts, agent, budget


def confine_training(layout: RunLayout, protocol) -> dict[str, Any] | None:
    """The operating system's confinement of an agent arm's training process (``opalctl.sandbox``): no network,
    no writes but to its own folder of the run (``training/``: never the records of results, which lie beside
    it), no reads of the evaluation splits, no new process, and bounds on its memory and on any one file it
    writes (the protocol's ``limits``). Not the temporary folder: writable means readable, and a project's data
    may well lie beneath it."""
    bounds = training_bounds(protocol.limits, stages=len(protocol.budget.fractions), ranks=protocol.training.ranks)
    # the notes a person leaves for the agent (opal/notes.py), where its arm made their folder: read, never written
    notes = [layout.notes] if layout.notes.is_dir() and not layout.notes.is_symlink() else []
    confinement = confine_process(writable=[layout.training], readable=[*training_paths(), *notes],
                                  deny_network=True, bounds=bounds, devices=device_access(protocol.training.device))
    return confinement.to_json()



class StopSignals:
    """SIGINT, SIGTERM and SIGHUP while a run works: each stops it as Ctrl-C does, with a KeyboardInterrupt in
    the main thread, and the first is kept so the run ends in ``Interrupted`` (exit 128 + its number) saying what
    continues it. A SIGTERM or SIGHUP goes through the SIGINT handler when one is installed over this one: the
    agent optimizer's guard counts SIGINTs to tell the user's stop from agent code's own exceptions
    (opal/guard.py). A signal the process ignores (nohup, a background job's SIGINT) stays ignored; nothing is
    installed off the main thread.

    While the budget loop runs (``deferred``), a stop waits for the update in progress to end, so that the loop
    writes a resume checkpoint at it and nothing trained is lost (``asked``, which the loop reads after each
    update): the same checkpoint a periodic one at that update would be. The wait is bounded (``wait`` seconds):
    when the update does not end in time, the stop happens where the run is, as above, and the loop records how
    much the resume will train again (``lost``). The SIGINT handler is this one while the loop defers, so that
    agent code is never interrupted by a stop that waits for it; past the bound the guard counts the stop as it
    always does."""

    NUMBERS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    active: StopSignals | None = None  # the instance installed in this process (signal handlers are the process's)

    def __init__(self, wait: float = STOP_WAIT_SECONDS) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        self.wait = wait
        self.asked: list[int] = []  # the stop that waits for the update's end; empty until one arrives
        # (last resume checkpoint's update, updates done, when the stop came) for a stop that could not wait
        self.lost: tuple[int, int, str] | None = None
        self._deferring = False
        self.at_once_span: str | None = None  # what the loop does in a span a stop does not wait for (at_once)
        self._deadline = float("inf")
        self._guard: Any = None  # the SIGINT handler installed over this one, set aside while the loop defers
        self._forwarding = False
        # the watch of the bound, a thread started with the loop: a handler starts no thread (it may run while the
        # main thread holds a lock of threading's own) and only sets an event
        self._stirred = threading.Event()  # a stop was asked, or the loop ended
        self._ended = threading.Event()  # the loop ended

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.NUMBERS:
                current = signal.getsignal(number)
                if current != signal.SIG_IGN:
                    self.previous[number] = current
                    signal.signal(number, self.stop)
            StopSignals.active = self
        return self

    def __exit__(self, *exc_info) -> None:
        for number, previous in self.previous.items():
            signal.signal(number, signal.SIG_DFL if previous is None else previous)
        self.previous = {}
        if StopSignals.active is self:
            StopSignals.active = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[list[int]]:
        """The budget loop's span: a stop waits for the update in progress (the class docstring); yields
        ``asked``."""
        installed = signal.SIGINT in self.previous and threading.current_thread() is threading.main_thread()
        if installed:
            current = signal.getsignal(signal.SIGINT)
            if callable(current) and current != self.stop:
                self._guard = current
                signal.signal(signal.SIGINT, self.stop)
        self._deferring = bool(self.previous)
        self._stirred.clear()
        self._ended.clear()
        if self._deferring:
            threading.Thread(target=self._watch, name="opalctl-stop-bound", daemon=True).start()
        try:
            yield self.asked
        finally:
            self._deferring = False  # first: a handler that runs from here on sets no event
            self._ended.set()
            self._stirred.set()
            if self._guard is not None:
                signal.signal(signal.SIGINT, self._guard)
                self._guard = None

    @contextlib.contextmanager
    def at_once(self, doing: str) -> Iterator[None]:
        """A span of the loop that is no update, ``doing`` what the user's code bounds (the evaluator judging a
        stage runs the task's evaluate, limited only by ``limits.evaluate_seconds``): a stop that arrives in it
        happens at once, as outside the loop, and the sentence says what the resume trains again. A stop asked
        before the span keeps waiting within its bound."""
        deferring = self._deferring
        if not self.asked:
            self._deferring, self.at_once_span = False, doing
        try:
            yield
        finally:
            self._deferring, self.at_once_span = deferring, None

    def stop(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
        if self._deferring and time.monotonic() < self._deadline:
            if not self.asked:  # the loop stops after this update; past the bound, a signal of our own stops it
                self.asked.append(signum)
                self._deadline = time.monotonic() + self.wait
                self._stirred.set()
            return
        if self._forwarding:  # the guard, counting the stop, calls the handler it was installed over: this one
            raise KeyboardInterrupt
        if self._guard is not None:
            self._forwarding = True
            try:
                self._guard(signal.SIGINT, frame)
            finally:
                self._forwarding = False
            raise KeyboardInterrupt
        on_interrupt = signal.getsignal(signal.SIGINT)
        if signum != signal.SIGINT and callable(on_interrupt) and on_interrupt != self.stop:
            signal.raise_signal(signal.SIGINT)  # its handler runs as soon as this one returns
            return
        raise KeyboardInterrupt

    def _watch(self) -> None:
        """The bound: once a stop is asked, when the loop has not ended ``wait`` seconds later, the stop happens
        where the run is then (a signal of this process's own, which finds the bound passed)."""
        self._stirred.wait()
        if not self._ended.wait(self.wait) and self.received is not None:
            os.kill(os.getpid(), self.received)


def told(error: BaseException, received: int | None, command: RunCommand,
         layout: RunLayout | None, lost: tuple[int, int, str] | None = None) -> OpalctlError | None:
    """What a run that failed with ``error`` tells the user, when it is a stop, a lost rank or a storage fault: an
    ``Interrupted`` when a stop signal arrived (whatever else went wrong while it stopped; ``lost``: the last resume
    checkpoint's update and the updates done, when the stop could not wait for the update in progress), a sentence
    naming the failed collective when another torchrun rank is gone, a ``StorageFault`` whose sentence ends with the
    command that continues the run; None for anything else."""
    verb, line = command.next_step(layout) if layout is not None else ("start it again", command.line())
    if received is not None:
        said = None
        if lost is not None and verb == "resume":
            saved, done, when = lost
            said = (f"{when}, so no resume checkpoint was written at the stop: the resume starts at update {saved}, "
                    f"and trains the {done - saved} update(s) done since then again")
        return Interrupted(received, line, what=verb, lost=said)
    refusal = bound_refusal(error, f"{verb} with: {line}")
    if refusal is not None:
        return refusal
    gone = lost_rank(error) if command.ranks > 1 else None
    if gone is not None:
        return OpalctlError(f"another rank of this torchrun run stopped ({gone}); {verb} with: {line}")
    if isinstance(error, OSError):  # a writer that does not say it through files.storage
        where = error.filename or (layout.root if layout is not None else None)
        error = storage_fault(where, error.errno, error.strerror or "") or error
    return error.for_command(line) if isinstance(error, (StorageFault, TaskFailed)) else None


def run(lock_path: str | Path, arm: str, seed: int, *, runs_dir=None, resume: bool = False, restart: bool = False,
        clock_factory=None, progress=None, say=None, confine: bool = False) -> dict[str, Any]:
    """One formal run (the module docstring); a stop signal or a storage fault ends it in one sentence that says
    what continues it (``told``)."""
    command = RunCommand(str(lock_path), arm, seed, None if runs_dir is None else str(runs_dir))
    layout = None
    with StopSignals() as stops:
        try:
            lock = read_lock(Path(lock_path))
            formal = FormalRun(lock, arm, seed, runs_dir_default(runs_dir), clock_factory=clock_factory,
                               progress=progress, say=say, confine=confine, command=command)
            layout = formal.layout
            command = formal.command  # the lock says whether continuing it is a torchrun command
            report = formal.execute(resume=resume, restart=restart)
        except BaseException as error:
            if stops.received is not None and layout is not None and layout.state == FINISHED:
                report = finished_anyway(layout, stops.received, say)
            else:
                saying = told(error, stops.received, command, layout, stops.lost)
                if saying is None:
                    raise
                raise saying from None
    report["run_dir"] = str(formal.layout.root)
    # whether its agent acted, from the folder's records: the CLI warns and picks the exit code by it
    report["agent_acted"] = RunEnding.of(arm, seed, lock.resolved["arms"][arm], formal.layout.root).to_json()
    return report


def finished_anyway(layout: RunLayout, received: int, say: Callable[[str], None] | None) -> dict[str, Any]:
    """A stop that came once the evaluator had written ``report.json``: the run is finished (its report is whole,
    written at once), so it ends as a finished run does, saying so; the resume checkpoint it would have removed
    next goes too."""
    layout.resume.unlink(missing_ok=True)
    (say or (lambda text: None))(f"the stop ({signal.Signals(received).name}) came after the run finished; its "
                                 f"report is {layout.report}")
    return read_report(layout.report)
