"""The evaluator: the process that evaluates, decides promotion and writes every record that states a result.

A formal run starts it first, before any agent program can load (docs/architecture.md, "Why the evaluator is a
process of its own"). It re-reads the lock, loads the evaluation splits (the training process loads only
``train``), evaluates the anchor or checks its record, and keeps its own judge, incumbent and stage records for
the whole run: the model and the splits stay loaded between stages, so a stage costs one checkpoint load and
one evaluation.

The training process talks to it over a pipe, one JSON object per line each way: a request ``{"kind": K,
"body": ...}`` and one answer, ``{"ok": ...}`` or ``{"error": sentence, "exit": code, "class": name}``. The
kinds are ``Message``'s, and this module is the only one that reads or writes them. What arrives after an agent
program may have run is a claim, never a result: a stage names its checkpoint, which the evaluator loads from the
run folder itself; the stages a resume carries are judged again from their files and refused, naming the file,
when they differ; the training facts at the close (ledger, meter, rows digest, agent figures) are reported as the
training process's own account. The evaluator ends when its input ends, so a killed training process leaves no
evaluator behind; the run folder's lock is inherited, so a resume waits until it has ended.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import OpalctlError
from opalctl.formats import (
    AnchorRecord,
    RecordChanged,
    RecordDamaged,
    StageRecord,
    TrainingFacts,
    anchor_sha256,
    read_record,
    record_sha256,
)

# the record fields a judge computes; a carried record must match a new evaluation in every one of them
JUDGED_FIELDS = ("stage", "fraction", "checkpoint", "metrics", "incumbent_before", "decision", "promoted",
                 "incumbent_after", "shared_state_with")


class Message:
    """The kinds of request, in the order a run sends them (``CONFINED`` and ``CARRIED`` at most once)."""

    OPEN = "open"  # body: Opening; answer: {"anchor": the anchor record}
    CONFINED = "confined"  # body: {"confinement": dict | None}; answer: {}
    CARRIED = "carried"  # body: {"stages": [StageRecord json]}; answer: Verdict
    STAGE = "stage"  # body: {"saved": [SavedStage json], "facts": StageFacts json}; answer: Verdict
    CLOSE = "close"  # body: TrainingFacts json; answer: {"report": RunReport json}
    ALL = (OPEN, CONFINED, CARRIED, STAGE, CLOSE)


@dataclass(frozen=True)
class Opening:
    """What the evaluator needs to start: sent by the training process before any agent code exists in it."""

    lock: str
    lock_sha256: str
    arm: str
    seed: int
    run_dir: str
    anchor_dir: str
    sys_path: list[str]  # where the task's module is found (a test's or a user's folder)


def stage_name(index: int) -> str:
    return f"stage-{index + 1:02d}"


# --------------------------------------------------------------------------------------------------------------
# the training process's side

class EvaluatorFailed(OpalctlError):
    """The evaluator stopped or answered something outside its protocol (exit 1)."""


class EvaluatorProcess:
    """The training process's handle on its evaluator: one request, one answer, in order."""

    def __init__(self, opening: Opening, inherit_fds: tuple[int, ...] = ()):
        self.run_dir = opening.run_dir
        self.advice = "start the run again"  # what to do when it stops; a run that has a resume point resumes
        package_root = str(Path(__file__).resolve().parents[2])  # the evaluator runs this very copy of opalctl
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.stderr = tempfile.TemporaryFile()  # never fills up and blocks the evaluator, read when it stopped
        self.process = subprocess.Popen([sys.executable, "-m", "opalctl.driver.evaluator", opening.run_dir],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
                                        pass_fds=inherit_fds)
        self.send(Message.OPEN, opening.__dict__)  # answered by ``answer``: the anchor record

    def send(self, kind: str, body: Any) -> None:
        """A request whose answer ``answer`` reads later (so the evaluator works while training builds)."""
        line = json.dumps({"kind": kind, "body": body}, allow_nan=True) + "\n"
        try:
            self.process.stdin.write(line.encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._stopped()

    def answer(self) -> Any:
        """The next answer; an error answer is raised as the error the evaluator met, with its sentence."""
        line = self.process.stdout.readline()
        if not line:
            self._stopped()
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "error" in answer:
            raise _error_from(answer)
        if not isinstance(answer, dict) or "ok" not in answer:
            self.end()
            raise EvaluatorFailed(f"the evaluator of {self.run_dir} answered outside its protocol "
                                  f"({line[:120]!r}); {self.advice}")
        return answer["ok"]

    def ask(self, kind: str, body: Any) -> Any:
        self.send(kind, body)
        return self.answer()

    def end(self) -> None:
        """Close its input (it ends there) and wait for it."""
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _stopped(self) -> None:
        self.end()
        raise EvaluatorFailed(f"the evaluator of {self.run_dir} stopped (exit status {self.process.returncode}: "
                              f"{self._last_words()}); {self.advice}")

    def _last_words(self) -> str:
        try:
            self.stderr.seek(0)
            lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        except (ValueError, OSError):
            lines = []
        return (lines or ["no message"])[-1][:300]


def _error_from(answer: dict[str, Any]) -> OpalctlError:
    """The evaluator's error as the same opalctl error class, so a caller tells them apart as before."""
    module, _, name = str(answer.get("class", "")).rpartition(".")
    cls: type = OpalctlError
    if module.startswith("opalctl."):
        found = getattr(importlib.import_module(module), name, None)
        if isinstance(found, type) and issubclass(found, OpalctlError):
            cls = found
    error = cls.__new__(cls)
    OpalctlError.__init__(error, str(answer["error"]), details=list(answer.get("details") or []))
    if cls is OpalctlError:
        error.exit_code = int(answer.get("exit", 1))
    return error


# --------------------------------------------------------------------------------------------------------------
# the evaluator's side

class Evaluator:
    """The evaluator's state: the lock, the task and its splits, the judge, the anchor and the stage records."""

    def __init__(self, opening: Opening):
        import torch

        from opalctl.driver.build import choose_arm
        from opalctl.driver.judge import Incumbent, Judge
        from opalctl.errors import InputChanged
        from opalctl.protocol.lock import read_lock
        from opalctl.tasks import make_task

        sys.path[:] = list(opening.sys_path)
        self.lock = read_lock(Path(opening.lock))
        if self.lock.sha256 != opening.lock_sha256:
            raise InputChanged(f"lock {self.lock.path} changed while the run started; run it again")
        self.protocol = self.lock.protocol()
        self.arm_name, self.seed = opening.arm, opening.seed
        self.arm = choose_arm(self.protocol, opening.arm, opening.seed, f"lock {self.lock.path}", "the lock's")
        self.run_dir, self.anchor_dir = Path(opening.run_dir), Path(opening.anchor_dir)
        torch.set_num_threads(self.protocol.budget.threads)  # the threads the training process evaluated with
        self.task = make_task(self.protocol.task.entry, self.protocol.task.config)
        self.splits = self.task.load({split: self.lock.data_path(split) for split in self.protocol.data
                                      if split != "train"})
        device = self.protocol.training.device
        self.judge = Judge.build(self.task, self.splits, self.lock.parent_path(self.seed), self.arm, self.seed,
                                 device, self.protocol)
        self.anchor = self._anchor(device)
        self.anchor_sha256 = anchor_sha256(self.anchor)
        self.incumbent = Incumbent()
        self.stages: list[StageRecord] = []
        self.confinement: dict[str, Any] | None = None
        from opalctl.driver.sharing import MachineWatch

        self.machine = MachineWatch()  # lives as long as the run: sampled at each stage, written at the close

    def _anchor(self, device: str) -> dict[str, Any]:
        from opalctl import checkpoints

        parent = self.task.build(self.lock.parent_path(self.seed), {}, self.seed, device).model
        parent.train()
        digest = checkpoints.model_sha256(parent.state_dict())
        return prepare_anchor(self.lock, self.task, self.splits, self.seed, self.anchor_dir, parent, digest)

    def handle(self, kind: str, body: Any) -> Any:
        if kind == Message.CONFINED:
            self.confinement = body.get("confinement")
            return {}
        if kind == Message.CARRIED:
            return self.carried([StageRecord.from_json(stage, what=f"a stage record in {self.run_dir}/resume.pt")
                                 for stage in body["stages"]])
        if kind == Message.STAGE:
            return self.stage(body["saved"], body["facts"])
        if kind == Message.CLOSE:
            return {"report": self.close(TrainingFacts.from_json(body))}
        raise EvaluatorFailed(f"the evaluator of {self.run_dir} was sent {kind!r}, which is not one of "
                              f"{', '.join(Message.ALL)}; this is a bug in opalctl")

    # -- stages ----------------------------------------------------------------------------------------------
    def _saved(self, entry: dict[str, Any]):
        """The stage's checkpoint as the evaluator finds it: the file is the run folder's, whatever was sent."""
        from opalctl.driver.judge import SavedStage

        index = int(entry["index"])
        return SavedStage(index=index, path=self.run_dir / f"{stage_name(index)}.pt", sha256=str(entry["sha256"]),
                          model_sha256=str(entry["model_sha256"]), bytes=int(entry["bytes"]))

    def _judge(self, saved, facts) -> list[StageRecord]:
        """Judge the stages one update reached, which must be the next ones, and keep their records."""
        expected = list(range(len(self.stages), len(self.stages) + len(saved)))
        if [stage.index for stage in saved] != expected or expected[-1] >= len(self.judge.fractions):
            raise RecordDamaged(f"the training process of {self.run_dir} sent stage(s) "
                                f"{[stage.index + 1 for stage in saved]} where stage {len(self.stages) + 1} was next; "
                                f"move the run folder aside and start the run again")
        records, self.incumbent = self.judge.judge(saved, facts, self.incumbent, self.anchor["metrics"],
                                                   self.anchor_sha256)
        self.stages.extend(records)
        return records

    def _verdict(self) -> dict[str, Any]:
        return {"stages": [stage.to_json() for stage in self.stages], "incumbent": self.incumbent.to_json()}

    def stage(self, saved: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
        from opalctl.driver.judge import StageFacts
        from opalctl.files import atomic_write_json

        records = self._judge([self._saved(entry) for entry in saved], StageFacts(**facts))
        self.machine.sample()
        for record in records:
            atomic_write_json(self.run_dir / f"{stage_name(record.stage - 1)}.json", record.to_json())
        return {"stages": [record.to_json() for record in records], "incumbent": self.incumbent.to_json()}

    def carried(self, stages: list[StageRecord]) -> dict[str, Any]:
        """Judge a resume's carried stages again from their files; each must match its record, and its stage file
        must be, byte for byte, the record carried: the evaluator keeps the records as they were written."""
        from opalctl.driver.judge import StageFacts
        from opalctl.files import sha256_file

        groups: list[list[StageRecord]] = []
        for record in stages:  # the stages one update reached share its weights and are judged together
            if groups and groups[-1][-1].update == record.update:
                groups[-1].append(record)
            else:
                groups.append([record])
        resume_file = self.run_dir / "resume.pt"
        for group in groups:
            first = group[0]
            saved = [self._saved({"index": record.stage - 1, **record.checkpoint}) for record in group]
            facts = StageFacts(update=first.update, budget_used=first.budget_used,
                               budget_fraction_used=first.budget_fraction_used, examples=first.examples,
                               train_cpu_seconds=first.train_cpu_seconds,
                               train_wall_seconds=first.train_wall_seconds, loss=first.loss)
            for again, record in zip(self._judge(saved, facts), group, strict=True):
                stage_file = self.run_dir / f"{stage_name(record.stage - 1)}.json"
                _require_same(again, record, f"stage {record.stage}'s record in {resume_file}", saved[0].path)
                on_disk = _read_stage_file(stage_file)
                _require_same(again, on_disk, f"stage record {stage_file}", saved[0].path)
                if sha256_file(stage_file) != record_sha256(record.to_json()):
                    raise RecordChanged(f"stage record {stage_file} is not the record {resume_file} carries (it was "
                                        f"edited); move the run folder {self.run_dir} aside and start the run again")
        # the records as written (their eval_seconds too), so that report.json's stages are the stage files
        self.stages[:len(stages)] = stages
        return self._verdict()

    # -- the close -------------------------------------------------------------------------------------------
    def close(self, training: TrainingFacts) -> dict[str, Any]:
        from opalctl import checkpoints
        from opalctl.driver.closing import RunOutcome, close_run

        last = self.stages[-1]
        final = checkpoints.load(self.run_dir / last.checkpoint["file"], limit_bytes=self.judge.limit_bytes,
                                 expected_shapes=self.judge.shapes, require_finite=False)
        outcome = RunOutcome(stages=self.stages, incumbent=self.incumbent, training=training,
                             final_model=final["model"], confinement=self.confinement,
                             machine=self.machine.to_json())
        return close_run(self.run_dir, self.lock, self.arm_name, self.seed, self.protocol, outcome, self.anchor,
                         self.splits)


def _read_stage_file(path: Path) -> StageRecord:
    return read_record(path, StageRecord, advice=f"move the run folder {path.parent} aside and start the run again")


def _require_same(judged: StageRecord, claimed: StageRecord, what: str, checkpoint: Path) -> None:
    """Refuse a claimed record whose judged fields (or training facts) differ from the evaluator's own."""
    mine, theirs = judged.to_json(), claimed.to_json()
    differ = [key for key in mine if key != "eval_seconds" and mine[key] != theirs.get(key)]
    if differ:
        raise RecordChanged(f"{what} does not match a new evaluation of {checkpoint} ({', '.join(differ[:4])} "
                            f"differ); move the run folder {checkpoint.parent} aside and start the run again")


def prepare_anchor(lock, task, splits, seed: int, folder: Path, parent, model_digest: str) -> dict[str, Any]:
    """Evaluate the parent once per lock and seed; when it was done before, check its record instead of redoing
    it: it must be of this lock, parent and data, and its metrics must match its digest (a record written before
    the chain has none: its metrics are evaluated again and must be the same)."""
    from opalctl.driver.evaluation import evaluate_all
    from opalctl.files import atomic_write_json

    record_path = folder / "anchor.json"
    parent_record = lock.records[f"parent.seed-{seed}"]
    data_records = {role: record["sha256"] for role, record in lock.records.items() if role.startswith("data.")}
    again = f"delete the folder {folder} so it is evaluated again"
    if record_path.exists():
        anchor = read_record(record_path, AnchorRecord, advice=again).to_json()
        problems = []
        if anchor["lock_sha256"] != lock.sha256:
            problems.append("it was made from another lock")
        if anchor["parent"].get("sha256") != parent_record["sha256"]:
            problems.append("the parent's digest differs")
        if anchor["data"] != data_records:
            problems.append("the data digests differ")
        if anchor["model_sha256"] != model_digest:
            problems.append("the parent loads to other weights")
        if problems:
            raise OpalctlError(f"anchor record {record_path} does not match this run ({'; '.join(problems)}); {again}")
        if anchor["sha256"] is None and evaluate_all(task, parent, splits) != anchor["metrics"]:
            raise RecordChanged(f"anchor record {record_path}'s metrics are not the parent's (evaluated again); "
                                f"it was edited: {again}")
        if anchor["sha256"] is not None and anchor["sha256"] != anchor_sha256(anchor):
            raise RecordChanged(f"anchor record {record_path} no longer matches its digest (it was edited after it "
                                f"was written); {again}")
        return anchor
    started = time.perf_counter()
    metrics = evaluate_all(task, parent, splits)
    anchor = AnchorRecord(lock_sha256=lock.sha256, seed=seed,
                          parent={"path": parent_record["path"], "sha256": parent_record["sha256"]},
                          data=data_records, model_sha256=model_digest, metrics=metrics,
                          eval_seconds=time.perf_counter() - started).to_json()
    anchor["sha256"] = anchor_sha256(anchor)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record_path, anchor)
    return anchor


def _failure(error: BaseException) -> dict[str, Any]:
    if isinstance(error, OpalctlError):
        return {"error": error.message, "details": error.details, "exit": error.exit_code,
                "class": f"{type(error).__module__}.{type(error).__qualname__}"}
    return {"error": f"the evaluator failed ({type(error).__name__}: {str(error)[:300]}); this is a bug in opalctl",
            "exit": 1, "class": "opalctl.errors.OpalctlError"}


def serve(requests, answers) -> int:
    """Answer each request line until the input ends (the training process closed it, or is gone)."""
    evaluator: Evaluator | None = None
    for line in requests:
        try:
            request = json.loads(line)
            if request["kind"] == Message.OPEN:
                evaluator = Evaluator(Opening(**request["body"]))
                answer: dict[str, Any] = {"ok": {"anchor": evaluator.anchor}}
            elif evaluator is None:
                raise EvaluatorFailed("the evaluator was asked for work before it was opened; this is a bug")
            else:
                answer = {"ok": evaluator.handle(request["kind"], request["body"])}
        except Exception as error:  # every failure is an answer; after it the training process ends the run
            import traceback

            traceback.print_exc(file=sys.stderr)
            answer = _failure(error)
        try:
            answers.write(json.dumps(answer, allow_nan=True) + "\n")
            answers.flush()
        except (BrokenPipeError, OSError):
            return 0  # the training process is gone: nothing waits for the answer
        if "error" in answer:
            return 1
    return 0


def main() -> int:
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # they stop the run (a terminal signals the
        signal.signal(number, signal.SIG_IGN)                      # whole group); the evaluator sees its input end
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a task prints goes to stderr, never into the answers
    return serve(sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(main())
