"""``opalctl run LOCK --arm A --seed S``: one formal, pre-registered run of one arm on one seed.

The order of work is the promise the product makes:

1. every record of the lock is re-hashed, and the run refuses to start on anything that changed;
2. the anchor (the original parent for this seed) is evaluated once per lock and seed, and re-checked, not
   recomputed, when it is already there;
3. the arm's model, sampler and optimizer are built and the initial state is saved;
4. the budget loop charges each whole update (batch, forward, loss, backward, clipping, step) to the protocol's
   clock and nothing else: evaluations, checkpoint writes and log writes happen between timed intervals and are
   recorded on their own. No update is cut short; the run ends after the first update that reaches 100 %, and
   the overshoot is recorded;
5. at each budget fraction the state is checkpointed, evaluated and judged by the promotion policy, which always
   measures floors against the anchor;
6. ``selected.json``, ``last.json`` and ``report.json`` close the run.

A resume checkpoint holds everything the loop needs (model, optimizer, sampler, schedule, budget meter, RNG
states, running totals, the incumbent, how many lines of ``steps.jsonl.gz`` precede it), so ``--resume`` after a
crash ends, for a deterministic arm, with exactly the weights of an uninterrupted run. A run folder that exists is
never reused except by ``--resume``.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.driver.evaluation import evaluate_all, rng_state, set_rng_state
from opalctl.driver.records import FLUSH_LINES, StepsWriter, locate
from opalctl.errors import BadInput, OpalctlError
from opalctl.files import atomic_write_json, read_json

RESUME_FILE = "resume.pt"
LOCK_WAIT_SECONDS = 5.0  # how long a run waits for its folder's lock before calling it busy


@dataclass
class RunPaths:
    base: Path
    anchor: Path
    run: Path

    @classmethod
    def of(cls, runs_dir: Path, lock, arm: str, seed: int) -> RunPaths:
        base = Path(runs_dir) / f"{lock.name}-{lock.sha12}"
        return cls(base=base, anchor=base / "anchors" / f"seed-{seed}", run=base / arm / f"seed-{seed}")


def runs_dir_default(value: str | os.PathLike | None) -> Path:
    return Path(value or os.environ.get("OPALCTL_RUNS") or "runs")


def stage_name(index: int) -> str:
    return f"stage-{index + 1:02d}"


class Totals:
    """Running seconds, kept apart: training on each clock, evaluation, checkpoint writes, records."""

    KEYS = ("train_cpu", "train_wall", "eval_wall", "checkpoint_wall", "loop_wall", "agent_wait_wall")

    def __init__(self) -> None:
        self.values = {key: 0.0 for key in self.KEYS}
        self.values.update({"examples": 0, "nonfinite_losses": 0, "resumes": 0})

    def add(self, key: str, amount: float) -> None:
        self.values[key] += amount


# --------------------------------------------------------------------------------------------------------------
# the anchor

def prepare_anchor(lock, task, splits, seed: int, folder: Path, device: str, model_digest: str) -> dict[str, Any]:
    """Evaluate the parent once per lock and seed; when it was done before, check it instead of redoing it."""
    record_path = folder / "anchor.json"
    parent_record = lock.records[f"parent.seed-{seed}"]
    data_records = {role: record["sha256"] for role, record in lock.records.items() if role.startswith("data.")}
    if record_path.exists():
        try:
            anchor = read_json(record_path)
        except ValueError:
            raise OpalctlError(f"anchor record {record_path} is damaged; delete the folder {folder} so it is "
                               f"evaluated again") from None
        problems = []
        if anchor.get("lock_sha256") != lock.sha256:
            problems.append("it was made from another lock")
        if anchor.get("parent", {}).get("sha256") != parent_record["sha256"]:
            problems.append("the parent's digest differs")
        if anchor.get("data") != data_records:
            problems.append("the data digests differ")
        if anchor.get("model_sha256") != model_digest:
            problems.append("the parent loads to other weights")
        if problems:
            raise OpalctlError(f"anchor record {record_path} does not match this run ({'; '.join(problems)}); "
                               f"delete the folder {folder} so it is evaluated again")
        return anchor
    started = time.perf_counter()
    parent = task.build(lock.parent_path(seed), {}, seed, device)
    metrics = evaluate_all(task, parent.model, splits)
    anchor = {
        "lock_sha256": lock.sha256,
        "seed": seed,
        "parent": {"path": lock.records[f"parent.seed-{seed}"]["path"], "sha256": parent_record["sha256"]},
        "data": data_records,
        "model_sha256": checkpoints.model_sha256(parent.model.state_dict()),
        "metrics": metrics,
        "eval_seconds": time.perf_counter() - started,
    }
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, anchor)
    return anchor


# --------------------------------------------------------------------------------------------------------------
# the run

class FormalRun:
    """The state of one run while it trains. Each method is one step of the module docstring's list."""

    def __init__(self, lock, arm_name: str, seed: int, runs_dir: Path, *, clock_factory=None,
                 progress: Callable[..., None] | None = None, say: Callable[[str], None] | None = None):
        self.lock = lock
        self.protocol = lock.protocol()
        if arm_name not in self.protocol.arms:
            raise BadInput(f"lock {lock.path} has no arm {arm_name!r}; its arms are "
                           f"{', '.join(self.protocol.arms)}")
        if seed not in self.protocol.seeds:
            raise BadInput(f"seed {seed} is not one of the lock's seeds "
                           f"({', '.join(map(str, self.protocol.seeds))})")
        self.arm_name, self.seed = arm_name, seed
        self.arm = self.protocol.arms[arm_name]
        self.paths = RunPaths.of(runs_dir, lock, arm_name, seed)
        self.clock_factory = clock_factory
        self.progress = progress or (lambda *args, **kwargs: None)
        self.say = say or (lambda text: None)
        self.device = self.protocol.training.device

    # -- setup ---------------------------------------------------------------------------------------------
    def _check_device(self) -> None:
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise BadInput("training.device is cuda but this machine has no CUDA device")
        if self.protocol.budget.clock == "gpu" and self.device != "cuda":
            raise BadInput("budget.clock is gpu, which needs training.device: cuda")

    def _claim_folder(self, resume: bool) -> None:
        run = self.paths.run
        started = (run / RESUME_FILE).exists() or (run / "start.json").exists()
        if resume:
            if not started:
                raise BadInput(f"there is no run to resume in {run}; start it without --resume")
            if (run / "report.json").exists():
                raise BadInput(f"run {run} already finished; its report is {run / 'report.json'}")
        elif started or (run / "report.json").exists():
            raise BadInput(f"run folder {run} already exists; a run is never overwritten (use --resume to continue "
                           f"an interrupted run, or --runs-dir for a separate copy)")
        run.mkdir(parents=True, exist_ok=True)
        self._lock_handle = open(run / ".running", "a+")
        # The steps helper of a run that was just killed holds the lock for the few milliseconds it takes to see
        # its input end (records.py), so a prompt resume waits a little before calling the folder busy.
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(self._lock_handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    self._lock_handle.close()
                    raise BadInput(f"another opalctl process is running {run} now; wait for it to finish") from None
                time.sleep(0.05)
        if not (run / RESUME_FILE).exists() and (run / "opal").exists():
            # an agent's records from a start that never reached its first resume checkpoint: nothing to keep
            shutil.rmtree(run / "opal")

    def _build(self) -> None:
        import torch

        from opalctl.driver.arm import BudgetSchedule, build_optimizer
        from opalctl.driver.budget import BudgetMeter, make_clock
        from opalctl.tasks import make_task

        protocol = self.protocol
        torch.set_num_threads(protocol.budget.threads)
        self.task = make_task(protocol.task.entry, protocol.task.config)
        self.splits = self.task.load({split: self.lock.data_path(split) for split in protocol.data})
        torch.manual_seed(self.seed)
        self.built = self.task.build(self.lock.parent_path(self.seed), self.arm.model, self.seed, self.device)
        self.model = self.built.model
        self.model.train()
        self.shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self.optimizer = build_optimizer(self.arm, self.model.parameters())
        self.schedule = BudgetSchedule(self.optimizer, self.arm.schedule)
        self.agent = None
        self.clip = protocol.training.gradient_clip
        self.sampler = self.task.sampler(self.splits["train"], self.seed, protocol.training.batch_size, self.device)
        total = protocol.budget.amount * self.arm.budget_multiplier
        self.meter = BudgetMeter(total, list(protocol.budget.fractions))
        factory = self.clock_factory or (lambda name: make_clock(name, self.device))
        self.clock = factory(protocol.budget.clock)
        if self.arm.agent is not None:
            from opalctl.driver.arm import wrap_agent

            # the agent optimizer wraps the arm's own optimizer: clipping is handed over to its starting program
            # and decisions happen between timed updates; the budget schedule keeps setting the base learning rate
            self.agent = wrap_agent(self.arm, self.optimizer, self.model, progress=lambda: self.meter.fraction_used,
                                    run_dir=self.paths.run / "opal", clip=self.clip, budget=protocol.budget)
            self.optimizer = self.agent
            self.clip = None
        self.totals = Totals()
        self.incumbent: dict[str, Any] = {"stage": None}
        self.stages: list[dict[str, Any]] = []
        self.next_checkpoint = 1  # the index k of the next resume checkpoint, due at k * checkpoint_every

    # -- checkpoints ---------------------------------------------------------------------------------------
    def _loop_state(self) -> dict[str, Any]:
        """The state a resume continues from; call it after ``steps.begin_sync`` (every line sent, sums settled)."""
        self._take_step_sums()
        return {
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "schedule": self.schedule.state_dict(),
            "meter": self.meter.state_dict(),
            "rng": rng_state(),
            "totals": dict(self.totals.values),
            "incumbent": self.incumbent,
            "stages": self.stages,
            "next_checkpoint": self.next_checkpoint,
            "steps_lines": self.steps.lines,
        }

    def _take_step_sums(self) -> None:
        """Add the per-update figures kept in the steps writer since the last call (train seconds, examples,
        non-finite losses) to the totals: the loop leaves the sums to the writer's flush (see records)."""
        for key, value in self.steps.take_sums().items():
            self.totals.values[key] += value

    def _fold_cpu(self) -> None:
        """Add the CPU time since the last mark to training (non-cpu clocks only) before non-training work."""
        if self.protocol.budget.clock != "cpu":
            self.totals.add("train_cpu", time.process_time() - self._cpu_mark)

    def _write_resume(self) -> None:
        started = time.perf_counter()
        # the steps helper makes every line so far durable while the state is encoded; the checkpoint, which counts
        # those lines, replaces the last one only once they are on the disk (records.py)
        self.steps.begin_sync()
        checkpoints.save(self.paths.run / RESUME_FILE, self.model.state_dict(), kind="resume",
                         extra=self._loop_state(), meta={"update": self.meter.updates},
                         before_replace=self.steps.finish_sync)
        self.totals.add("checkpoint_wall", time.perf_counter() - started)
        self._cpu_mark = time.process_time()

    def _restore(self) -> None:
        try:
            payload = checkpoints.load(self.paths.run / RESUME_FILE, limit_bytes=self.protocol.limits.checkpoint_bytes,
                                       expected_shapes=self.shapes, require_finite=False)
        except checkpoints.CheckpointRefused as error:
            raise checkpoints.CheckpointRefused(
                f"cannot resume: {error.message}; move the run folder {self.paths.run} aside and start the run "
                f"again") from None
        extra = payload["extra"]
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(extra["optimizer"])
        self.sampler.load_state_dict(extra["sampler"])
        self.schedule.load_state_dict(extra["schedule"])
        self.meter.load_state_dict(extra["meter"])
        set_rng_state(extra["rng"])
        self.totals.values.update(extra["totals"])
        self.totals.values["resumes"] += 1
        self.incumbent = extra["incumbent"]
        self.stages = list(extra["stages"])
        self.next_checkpoint = extra["next_checkpoint"]
        self.steps_lines = int(extra["steps_lines"])

    # -- the loop ------------------------------------------------------------------------------------------
    def _stage(self, indices: list[int], anchor: dict[str, Any]) -> None:
        from opalctl.driver.promotion import decide

        fraction_list = self.protocol.budget.fractions
        self._take_step_sums()
        loss = self.steps.last_loss
        started = time.perf_counter()
        saved = []
        for index in indices:
            path = self.paths.run / f"{stage_name(index)}.pt"
            saved.append(checkpoints.save(path, self.model.state_dict(), kind="stage",
                                          meta={"stage": index + 1, "update": self.meter.updates}))
        self.totals.add("checkpoint_wall", time.perf_counter() - started)
        if self.agent is not None:
            self.agent.report_dev(stage=indices[-1] + 1)  # opens the evaluation-integrity check around this update
        started = time.perf_counter()
        metrics = evaluate_all(self.task, self.model, self.splits)
        eval_seconds = time.perf_counter() - started
        self.totals.add("eval_wall", eval_seconds)
        for index, record in zip(indices, saved):
            incumbent_metrics = anchor["metrics"] if self.incumbent["stage"] is None else self.incumbent["metrics"]
            decision = decide(metrics, incumbent_metrics, anchor["metrics"], self.protocol.selection)
            before = self.incumbent["stage"]
            if decision.promoted:
                self.incumbent = {"stage": index + 1, "metrics": metrics,
                                  "checkpoint": {"file": Path(record["path"]).name, "sha256": record["sha256"],
                                                 "model_sha256": record["model_sha256"]}}
            stage = {
                "stage": index + 1,
                "fraction": fraction_list[index],
                "update": self.meter.updates,
                "budget_used": self.meter.used,
                "budget_fraction_used": self.meter.fraction_used,
                "examples": self.totals.values["examples"],
                "train_cpu_seconds": self.totals.values["train_cpu"],
                "train_wall_seconds": self.totals.values["train_wall"],
                "checkpoint": {"file": Path(record["path"]).name, "sha256": record["sha256"],
                               "model_sha256": record["model_sha256"], "bytes": record["bytes"]},
                "metrics": metrics,
                "eval_seconds": eval_seconds,
                "incumbent_before": before if before is not None else "anchor",
                "decision": decision.to_json(),
                "promoted": decision.promoted,
                "incumbent_after": self.incumbent["stage"] if self.incumbent["stage"] is not None else "anchor",
                "shared_state_with": [i + 1 for i in indices if i != index],
                "loss": loss,
            }
            atomic_write_json(self.paths.run / f"{stage_name(index)}.json", stage)
            self.stages.append({k: stage[k] for k in ("stage", "fraction", "update", "budget_used",
                                                       "train_cpu_seconds", "train_wall_seconds", "metrics",
                                                       "promoted")})
            verdict = "promoted" if decision.promoted else "kept " + str(stage["incumbent_after"])
            self.say(f"stage {index + 1}/{len(fraction_list)} at update {self.meter.updates}: {verdict}"
                     + ("" if decision.promoted else f" ({'; '.join(decision.reasons[:2])})"))
        self._cpu_mark = time.process_time()

    def execute(self, resume: bool = False) -> dict[str, Any]:
        from opalctl.protocol.verify import require_unchanged

        require_unchanged(self.lock)
        self._check_device()
        self._claim_folder(resume)
        run_started_wall, run_started_cpu = time.perf_counter(), time.process_time()
        self._build()
        model_digest = checkpoints.model_sha256(self.model.state_dict())
        # the anchor is evaluated by the first run of a seed only: keep the RNG as if it were not there at all
        saved_rng = rng_state()
        anchor = prepare_anchor(self.lock, self.task, self.splits, self.seed, self.paths.anchor, self.device,
                                model_digest if not self.arm.model else self._parent_digest())
        set_rng_state(saved_rng)
        self.steps_lines = 0  # the lines steps.jsonl.gz holds for the updates done before this session
        if resume and (self.paths.run / RESUME_FILE).exists():
            self._restore()
            self.say(f"resuming {self.paths.run} at update {self.meter.updates}")
        else:
            self._start_records(model_digest, anchor)
        steps_path = self.paths.run / "steps.jsonl.gz"
        steps_offset, seen = locate(steps_path, self.steps_lines)  # a fresh run: offset 0, the file starts over
        # A steps line carries a CPU figure only under the cpu clock, whose charge is the update's CPU time: reading
        # the process CPU clock is a system call, too dear to make per update for nothing. Under other clocks the
        # CPU spent training is the loop's CPU time less the stages and checkpoints, folded in around each of them.
        # The steps helper holds the folder's lock too, so no resume cuts the file back while it still writes.
        self.steps = StepsWriter(steps_path, offset=steps_offset, seen=seen, lines=self.steps_lines,
                                 cpu_charges=self.protocol.budget.clock == "cpu",
                                 inherit_fds=(self._lock_handle.fileno(),))
        try:
            return self._train(resume, anchor, run_started_wall, run_started_cpu)
        except BaseException:
            self.steps.abandon()  # its helper process ends; the lines not yet durable are cut by a resume
            raise

    def _train(self, resume: bool, anchor: dict[str, Any], run_started_wall: float,
               run_started_cpu: float) -> dict[str, Any]:
        """Steps 4 to 6 of the module docstring: the budget loop, its stages, and the records that close the run."""
        import torch

        from opalctl.driver.arm import make_update

        if not resume or not (self.paths.run / RESUME_FILE).exists():
            self._write_resume()

        clock = self.clock
        meter = self.meter
        agent = self.agent
        every = self.protocol.training.checkpoint_every
        totals = self.totals.values
        # The loop body runs once per update, and everything it does between two updates costs several times what
        # it would in a tight loop (the caches hold the model's work; see records.py): what does not change is
        # looked up once here, and a call is avoided wherever an inline operation does the same.
        update = make_update(self.task, self.model, self.optimizer, self.clip, pass_loss=agent is not None)
        next_batch = self.sampler.next_batch
        clock_start, clock_stop = clock.start, clock.stop
        charge_meter = meter.charge
        # the steps writer's tuple per update, appended here rather than through StepsWriter.add (same layout):
        # the loss as a number on the CPU, where reading it costs no synchronisation, and detached elsewhere; the
        # batch's ids themselves when the sampler promises they stay as they are (Sampler.fresh_ids), else a copy
        fresh_ids = bool(getattr(self.sampler, "fresh_ids", False))
        keep_step = self.steps.pending.append
        kept = self.steps.pending
        flush_lines = FLUSH_LINES
        flush_steps = self.steps.flush
        loss_value = torch.Tensor.item if self.device == "cpu" else torch.Tensor.detach
        needs_boundary = agent.needs_boundary if agent is not None else None
        perf_counter = time.perf_counter
        last_progress = 0.0
        loop_started = perf_counter()
        self._cpu_mark = time.process_time()
        scheduled = self.arm.schedule != "constant"  # a constant schedule set the learning rate once, at the start
        # k * every is compared with a tolerance: repeated float sums (0.05 * 3 = 0.15000000000000002) would
        # otherwise push a checkpoint one update late
        checkpoint_due = self.next_checkpoint * every - 1e-9
        while not meter.done:
            if scheduled:
                self.schedule.apply(meter.fraction_used)
            wall0 = perf_counter()
            token = clock_start()
            batch = next_batch()
            loss = update(batch)
            charge = clock_stop(token)
            wall1 = perf_counter()
            reached = charge_meter(charge)
            # everything below is outside the timed interval; the update's figures are added to the totals at the
            # next flush, and its line is digested and written by the steps helper (see records.py)
            keep_step((meter.updates, charge, meter.used, wall1 - wall0, loss_value(loss),
                       batch.ids if fresh_ids else batch.ids.copy()))
            if len(kept) >= flush_lines:
                flush_steps()
            if needs_boundary is not None and not meter.done and needs_boundary():
                # the agent's work (and training's waiting for it) happens here, outside the timed interval
                self._fold_cpu()
                started = perf_counter()
                agent.between_updates()
                totals["agent_wait_wall"] += perf_counter() - started
                self._cpu_mark = time.process_time()
            if reached:
                self._fold_cpu()
                self._stage(reached, anchor)
            if reached or (meter.used / meter.total >= checkpoint_due and not meter.done):
                while self.next_checkpoint * every - 1e-9 <= meter.fraction_used:
                    self.next_checkpoint += 1
                checkpoint_due = self.next_checkpoint * every - 1e-9
                self._fold_cpu()
                self._write_resume()
            if wall1 - last_progress > 0.25:
                last_progress = wall1
                self.progress(meter.used, meter.total, stage=len(self.stages), loss=float(loss.detach()))
        self.steps.close()
        self._take_step_sums()
        if agent is not None:
            self.agent_figures = agent.close()
        self.totals.values["loop_wall"] = perf_counter() - loop_started  # this session only
        report = self._finish(anchor, run_started_wall, run_started_cpu)
        (self.paths.run / RESUME_FILE).unlink(missing_ok=True)
        return report

    def _parent_digest(self) -> str:
        parent = self.task.build(self.lock.parent_path(self.seed), {}, self.seed, self.device)
        return checkpoints.model_sha256(parent.model.state_dict())

    def _start_records(self, model_digest: str, anchor: dict[str, Any]) -> None:
        initial = checkpoints.save(self.paths.run / "initial.pt", self.model.state_dict(), kind="initial",
                                   meta={"update": 0})
        atomic_write_json(self.paths.run / "start.json", {
            "lock": str(self.lock.path.resolve()),
            "lock_sha256": self.lock.sha256,
            "protocol": self.lock.name,
            "arm": self.arm_name,
            "arm_config": self.lock.resolved["arms"][self.arm_name],
            "seed": self.seed,
            "budget": {"clock": self.protocol.budget.clock, "total": self.meter.total,
                       "fractions": list(self.protocol.budget.fractions), "threads": self.protocol.budget.threads},
            "training": self.lock.resolved["training"],
            "initial": {"file": "initial.pt", "sha256": initial["sha256"], "model_sha256": model_digest},
            "inherited": self.built.inherited,
            "initialised": self.built.initialised,
            "anchor": {"folder": os.path.relpath(self.paths.anchor, self.paths.run),
                       "model_sha256": anchor["model_sha256"]},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.node(),
        })

    # -- the end -------------------------------------------------------------------------------------------
    def _finish(self, anchor: dict[str, Any], started_wall: float, started_cpu: float) -> dict[str, Any]:
        import torch

        from opalctl.driver.pilot import peak_memory_bytes

        run = self.paths.run
        last_stage = read_json(run / f"{stage_name(len(self.protocol.budget.fractions) - 1)}.json")
        last = {"stage": last_stage["stage"], "update": last_stage["update"], **last_stage["checkpoint"]}
        atomic_write_json(run / "last.json", last)
        if self.incumbent["stage"] is None:
            parent_record = self.lock.records[f"parent.seed-{self.seed}"]
            selected = {"source": "anchor", "stage": None, "flagged": True,
                        "reason": "no stage qualified under the promotion policy; the selected model is the anchor",
                        "checkpoint": {"file": str(self.lock.parent_path(self.seed)),
                                       "sha256": parent_record["sha256"],
                                       "model_sha256": anchor["model_sha256"]},
                        "metrics": anchor["metrics"]}
        else:
            selected = {"source": "stage", "stage": self.incumbent["stage"], "flagged": False,
                        "checkpoint": self.incumbent["checkpoint"], "metrics": self.incumbent["metrics"]}
        atomic_write_json(run / "selected.json", selected)
        initial = checkpoints.load(run / "initial.pt", limit_bytes=self.protocol.limits.checkpoint_bytes)["model"]
        final = {name: t.detach().cpu() for name, t in self.model.state_dict().items()}
        changes = {}
        total_delta, total_norm = 0.0, 0.0
        for name, tensor in final.items():
            if not tensor.is_floating_point():
                continue
            delta = float(torch.linalg.vector_norm((tensor - initial[name]).double()))
            norm = float(torch.linalg.vector_norm(initial[name].double()))
            changes[name] = {"l2": delta, "relative": delta / norm if norm > 0 else None}
            total_delta += delta ** 2
            total_norm += norm ** 2
        totals = self.totals.values
        budget = self.protocol.budget
        report = {
            "lock_sha256": self.lock.sha256,
            "protocol": self.lock.name,
            "arm": self.arm_name,
            "seed": self.seed,
            "budget": {"clock": budget.clock, "total": self.meter.total, "used": self.meter.used,
                       "overshoot": self.meter.overshoot, "fractions": list(budget.fractions),
                       "threads": budget.threads, "multiplier": self.arm.budget_multiplier},
            "updates": self.meter.updates,
            "examples_seen": totals["examples"],
            "rows_digest": self.steps.seen,
            "seconds": {"train_cpu": totals["train_cpu"], "train_wall": totals["train_wall"],
                        "eval_wall": totals["eval_wall"], "checkpoint_wall": totals["checkpoint_wall"],
                        "agent_wait_wall": totals["agent_wait_wall"],
                        "this_session_loop_wall": totals["loop_wall"],
                        "this_session_wall": time.perf_counter() - started_wall,
                        "this_session_cpu": time.process_time() - started_cpu},
            "peak_memory_bytes": peak_memory_bytes(),
            "parameter_change": {"l2": total_delta ** 0.5,
                                 "relative": (total_delta ** 0.5) / (total_norm ** 0.5) if total_norm else None,
                                 "tensors": changes},
            "stages": self.stages,
            "promoted_stages": [s["stage"] for s in self.stages if s["promoted"]],
            "selected": {"source": selected["source"], "stage": selected["stage"], "flagged": selected["flagged"]},
            "final_model_sha256": last["model_sha256"],
            "anchor_metrics": anchor["metrics"],
            "agent": getattr(self, "agent_figures", None),
            "resumes": totals["resumes"],
            "nonfinite_losses": totals["nonfinite_losses"],
            "limitations": self._limitations(totals),
        }
        if self.device == "cuda":
            report["peak_device_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        atomic_write_json(run / "report.json", report)
        return report

    def _limitations(self, totals: dict[str, Any]) -> list[str]:
        budget = self.protocol.budget
        out = [f"One run of arm {self.arm_name!r} on seed {self.seed}: a single seed says nothing about spread; "
               f"compare arms across all seeds with `opalctl compare`."]
        if budget.clock == "cpu":
            out.append(f"The cpu clock counts this process's CPU time on {budget.threads} thread(s); it is "
                       f"comparable only between runs with the same thread count on the same kind of machine.")
        elif budget.clock == "wall":
            out.append("The wall clock includes whatever else the machine was doing; treat small differences as noise.")
        elif budget.clock == "updates":
            out.append("The updates clock counts updates, not compute: arms whose updates cost differently are not at "
                       "equal compute.")
        else:
            out.append("The gpu clock counts device time of each update; host-side work between kernels is not charged.")
        if self.meter.overshoot > 0:
            out.append(f"The last update overshot the budget by {self.meter.overshoot:.6g} "
                       f"({100 * self.meter.overshoot / self.meter.total:.2f} %), as no update is cut short.")
        if self.incumbent["stage"] is None:
            out.append("No stage qualified under the promotion policy: the selected model is the anchor (flagged).")
        integrity = (getattr(self, "agent_figures", None) or {}).get("eval_integrity")
        if integrity and integrity["flagged"]:
            out.append(f"Evaluation integrity: {integrity['flagged']} round trip(s) of the parameters around an "
                       f"evaluation ({', '.join(integrity['tensors'][:3])}): a program moved them for the evaluation "
                       f"and back; do not trust this arm's stage metrics.")
        if totals["resumes"]:
            out.append(f"The run was resumed {totals['resumes']} time(s); clock totals are the sum of the sessions.")
        if totals["nonfinite_losses"]:
            out.append(f"{totals['nonfinite_losses']} update(s) had a non-finite loss.")
        sizes = {split: self.splits[split] for split in self.splits if split != "train"}
        out.append(f"Metrics come from {len(sizes)} held-out split(s) of fixed size; differences of a few counts can "
                   f"be noise.")
        return out


def run(lock_path: str | Path, arm: str, seed: int, *, runs_dir=None, resume: bool = False,
        clock_factory=None, progress=None, say=None) -> dict[str, Any]:
    from opalctl.protocol.lock import read_lock

    lock = read_lock(Path(lock_path))
    formal = FormalRun(lock, arm, seed, runs_dir_default(runs_dir), clock_factory=clock_factory,
                       progress=progress, say=say)
    report = formal.execute(resume=resume)
    report["run_dir"] = str(formal.paths.run)
    return report
