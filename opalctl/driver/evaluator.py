"""The evaluator: the process that evaluates, decides promotion and writes every record that states a result.

A formal run starts it first, before any agent program can load (docs/architecture.md, "Why the evaluator is a
process of its own"). It re-reads the lock, loads the evaluation splits (the training process loads only
``train``), evaluates the anchor or checks its record, and keeps its own judge, incumbent and stage records for
the whole run: the model and the splits stay loaded between stages, so a stage costs one checkpoint read and one
evaluation.

The training process talks to it over a pipe, one JSON object per line each way: a request ``{"kind": K,
"body": ...}`` and one answer, ``{"ok": ...}`` or ``{"error": sentence, "exit": code, "class": name}``. The
kinds are ``formats.Message``'s, each body and answer the record it names there, and this module is the only one
that reads or writes them.

It trusts nothing the training process says once an agent program may have run there. It writes ``start.json``
from what training sent before any agent code could run (the initial checkpoint it wrote, the confinement it
applied) and every other record of a result (``stage-NN.json``, ``last.json``, ``selected.json``,
``report.json``, the anchor) into the run folder beside ``training/``, where a confined training process cannot
write (opalctl/layout.py). A stage names its index; the evaluator reads the checkpoint the layout puts there itself,
without following a link (``checkpoints.read_beneath``), hashes the bytes it loads, and records that digest. A
resume's stages are the evaluator's own records, their checkpoints hashed again. The results go back to the
training process only for an arm without an agent, and to an agent arm's only at the close, after its last
update: agent code learns no evaluation result it could act on. The training facts at the close are reported as
the training process's own account, beside what the kernel counted of that process (driver/kernel_account.py).
The evaluator ends when its input ends, and on Linux the kernel kills it when the training process dies (the
parent-death signal), even inside a task's ``evaluate`` that hangs, so a killed training process leaves no evaluator
behind; one call of ``evaluate`` past ``limits.evaluate_seconds`` ends it with a sentence (driver/evaluation.py).
The run folder's lock is inherited, so a resume waits until it has ended.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.driver.build import choose_arm
from opalctl.driver.closing import ClosingInputs, close_run
from opalctl.driver.evaluation import EvaluateLimit, evaluate_all, limit_evaluate
from opalctl.driver.judge import Incumbent, Judge, SavedStage
from opalctl.driver.kernel_account import KernelAccount, SessionCpu
from opalctl.driver.sharing import MachineWatch
from opalctl.errors import InputChanged, OpalctlError
from opalctl.files import atomic_write_json, sha256_file
from opalctl.formats import (
    Acknowledged,
    AnchorRecord,
    CarriedStages,
    Closed,
    Message,
    Opening,
    RecordChanged,
    RecordDamaged,
    RecordedStage,
    StageFacts,
    StageReached,
    StageRecord,
    StageSaved,
    StageVerdict,
    Starting,
    StartRecord,
    TrainingFacts,
    anchor_sha256,
    read_record,
    record_sha256,
)
from opalctl.layout import AnchorFolder, RunLayout
from opalctl.protocol.lock import read_lock
from opalctl.quick_exit import end_without_teardown
from opalctl.tasks import make_task
from opalctl.training_folder import training_folder_bytes, training_folder_excess

# --------------------------------------------------------------------------------------------------------------
# the training process's side

class EvaluatorFailed(OpalctlError):
    """The evaluator stopped or answered something outside its protocol (exit 1)."""


class EvaluatorProcess:
    """The training process's handle on its evaluator: one request, one answer, in order."""

    def __init__(self, opening: Opening, inherit_fds: tuple[int, ...] = ()):
        self.run_dir = opening.run_dir
        self.advice = "start the run again"  # what to do when it stops; a run that has a resume point resumes
        self.asked: deque[str] = deque()  # the kinds of the requests sent whose answer was not read, in order
        package_root = str(Path(__file__).resolve().parents[2])  # the evaluator runs this very copy of opalctl
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.stderr = tempfile.TemporaryFile()  # never fills up and blocks the evaluator, read when it stopped
        self.process = subprocess.Popen([sys.executable, "-m", "opalctl.driver.evaluator", opening.run_dir,
                                         str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
                                        pass_fds=inherit_fds)
        self.send(Message.OPEN, opening)  # answered by ``answer`` once the anchor is ready

    @property
    def unanswered(self) -> int:
        """The requests sent whose answer was not read: a busy evaluator, when the run ends."""
        return len(self.asked)

    def send(self, kind: str, body) -> None:
        """A request (``body``: the record ``Message.BODIES`` names for ``kind``) whose answer ``answer`` reads
        later (so the evaluator works while training builds)."""
        assert isinstance(body, Message.BODIES[kind]), f"a {kind} request's body is a {Message.BODIES[kind]}"
        line = json.dumps({"kind": kind, "body": body.to_json()}, allow_nan=True) + "\n"
        self.asked.append(kind)
        try:
            self.process.stdin.write(line.encode())
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._stopped()

    def answer(self):
        """The next answer, as the record ``Message.ANSWERS`` names for its request's kind; an error answer is
        raised as the error the evaluator met, with its sentence."""
        line = self.process.stdout.readline()
        if not line:
            self._stopped()
        kind = self.asked.popleft()
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "error" in answer:
            raise _error_from(answer)
        try:
            if not isinstance(answer, dict) or "ok" not in answer:
                raise RecordDamaged("no answer")
            return Message.ANSWERS[kind].from_json(answer["ok"])
        except RecordDamaged:
            self.end()
            raise EvaluatorFailed(f"the evaluator of {self.run_dir} answered outside its protocol "
                                  f"({line[:120]!r}); {self.advice}") from None

    def ask(self, kind: str, body):
        self.send(kind, body)
        return self.answer()

    END_WAIT_SECONDS = 5.0

    def end(self) -> None:
        """Close its input (it ends there) and wait for it, up to ``END_WAIT_SECONDS``. An evaluator with a request
        unanswered (the run failed or was stopped while it evaluated, perhaps in a task's evaluate that hangs), or
        still there after the wait, works for nobody any more and is killed at once: every record it writes is
        written whole or not at all, so nothing is lost that a resume needs."""
        if self.unanswered > 0:
            self._kill()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=self.END_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            if self._kill():
                self.process.wait()

    def _kill(self) -> bool:
        """SIGKILL it; False where this process may not (a confined training process cannot signal a process
        outside its confinement): it dies with this process then, by its parent-death signal."""
        if self.process.poll() is not None:
            return True
        try:
            self.process.kill()
        except OSError:
            return False
        return True

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
        # torch is imported here, once the request to open came: the evaluator process starts without it, so that
        # its parent-death signal is armed and the stop signals ignored at once (``main``)
        import torch

        sys.path[:] = list(opening.sys_path)
        self.lock = read_lock(Path(opening.lock))
        if self.lock.sha256 != opening.lock_sha256:
            raise InputChanged(f"lock {self.lock.path} changed while the run started; run it again")
        self.protocol = self.lock.protocol()
        if _channel is not None:  # the evaluator process: a task's evaluate past its limit ends it (evaluation.py)
            limit_evaluate(EvaluateLimit(self.protocol.limits.evaluate_seconds, _channel.expire))
        self.arm_name, self.seed = opening.arm, opening.seed
        self.arm = choose_arm(self.protocol, opening.arm, opening.seed, f"lock {self.lock.path}", "the lock's")
        self.layout = RunLayout(Path(opening.run_dir), AnchorFolder(Path(opening.anchor_dir)))
        self.run_dir = self.layout.root
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
        self.started = False
        self.machine = MachineWatch()  # lives as long as the run: sampled at each stage, written at the close
        self.training_process = KernelAccount(os.getppid())  # the evaluator is the training process's child
        self.cpu: SessionCpu | None = None

    def _anchor(self, device: str) -> dict[str, Any]:
        parent = self.task.build(self.lock.parent_path(self.seed), {}, self.seed, device).model
        parent.train()
        digest = checkpoints.model_sha256(parent.state_dict())
        return prepare_anchor(self.lock, self.task, self.splits, self.seed, self.layout.anchor, parent, digest)

    def handle(self, kind: str, body):
        """The answer to a request after ``OPEN`` (``body``: the record ``Message.BODIES`` names for ``kind``), as
        the record ``Message.ANSWERS`` names."""
        if kind == Message.START:
            return self.start(body)
        if not self.started:
            raise EvaluatorFailed(f"the training process of {self.run_dir} sent {kind!r} before it started the run; "
                                  f"this is a bug in opalctl")
        if kind == Message.CARRIED:
            return self.carried(body)
        if kind == Message.STAGE:
            return self.stage(body)
        if kind == Message.CLOSE:
            return Closed(report=self.close(body))
        raise EvaluatorFailed(f"the evaluator of {self.run_dir} was sent {kind!r}, which is not one of "
                              f"{', '.join(Message.ALL)}; this is a bug in opalctl")

    # -- the start -----------------------------------------------------------------------------------------------
    def start(self, starting: Starting) -> Acknowledged:
        """The run's start, as the training process tells it before any agent program can have run in it: a new
        run's ``start.json``; a resumed run's must be there, of this lock, arm and seed."""
        if self.started:
            raise EvaluatorFailed(f"the training process of {self.run_dir} started the run twice; this is a bug")
        self.started = True
        self.confinement = starting.confinement
        self.cpu = SessionCpu(self.training_process)
        if starting.initial is not None:
            write_start_record(self, starting)
        else:
            check_start_record(self.layout.start, self.lock.sha256, self.arm_name, self.seed)
        return Acknowledged()

    # -- stages ----------------------------------------------------------------------------------------------
    def _saved(self, claim: StageSaved) -> SavedStage:
        """The stage's checkpoint where the layout puts it, with what the training process says it saved there."""
        layout = self.layout
        return SavedStage(root=layout.root, name=layout.name_of(layout.stage_checkpoint(claim.index + 1)),
                          **claim.to_json())

    def _judge(self, saved, facts: StageFacts) -> list[StageRecord]:
        """Judge the stages one update reached, which must be the next ones, and keep their records."""
        expected = list(range(len(self.stages), len(self.stages) + len(saved)))
        if [stage.index for stage in saved] != expected or expected[-1] >= len(self.judge.fractions):
            raise RecordDamaged(f"the training process of {self.run_dir} sent stage(s) "
                                f"{[stage.index + 1 for stage in saved]} where stage {len(self.stages) + 1} was next; "
                                f"move the run folder aside and start the run again")
        records, self.incumbent = self.judge.judge(saved, facts, self.incumbent, self.anchor["metrics"],
                                                   self.anchor_sha256)
        cpu = self.cpu.total() if self.cpu is not None else None
        records = [replace(record, process_cpu_seconds=cpu) for record in records]
        self.stages.extend(records)
        return records

    def check_training_folder(self) -> None:
        """An agent arm's ``training/`` within ``limits.training_folder_bytes``, measured from here (the training
        process's own count could say anything); past it the run ends in the sentence, and a resume clears what the
        run never writes (opalctl/training_folder.py)."""
        if self.arm.agent is None:
            return
        limit, _ = training_folder_bytes(self.protocol.limits, len(self.judge.fractions))
        excess = training_folder_excess(self.layout, limit)
        if excess is not None:
            raise OpalctlError(excess)

    def stage(self, reached: StageReached) -> StageVerdict:
        self.check_training_folder()
        records = self._judge([self._saved(claim) for claim in reached.saved], reached.facts)
        self.machine.sample()
        for record in records:
            atomic_write_json(self.layout.stage_record(record.stage), record.to_json())
        # an agent arm's training process runs agent code: it learns that the stage was recorded, not its result
        tell = self.arm.agent is None
        return StageVerdict(stages=[RecordedStage(stage=record.stage, said=said_of(record) if tell else None)
                                    for record in records])

    def carried(self, carried: CarriedStages) -> Acknowledged:
        """A resume's first ``count`` stages: the evaluator's own records in the run folder, each judged again from
        its checkpoint (which must still be the file it was judged on) and refused, naming the file, when it is not
        what a new judgement gives or not as opalctl wrote it; the incumbent and the kernel's count of CPU seconds
        go on from the last of them."""
        count = carried.stages
        advice = f"move the run folder {self.run_dir} aside and start the run again"
        if not 0 <= count <= len(self.judge.fractions):
            raise RecordDamaged(f"the resume checkpoint of {self.run_dir} says it passed {count} stages, and the run "
                                f"has {len(self.judge.fractions)}; {advice}")
        records = [_read_own_stage(self.layout.stage_record(number), number, advice) for number in range(1, count + 1)]
        groups: list[list[StageRecord]] = []
        for record in records:  # the stages one update reached share its weights and are judged together
            if groups and groups[-1][-1].update == record.update:
                groups[-1].append(record)
            else:
                groups.append([record])
        for group in groups:
            saved = [self._saved(StageSaved.of(record.stage - 1, record.checkpoint)) for record in group]
            for again, record in zip(self._judge(saved, StageFacts.of(group[0])), group, strict=True):
                _require_same(again, record, self.layout.stage_record(record.stage), saved[0].path)
        self.stages[:count] = records  # the records as written (their eval_seconds too): report.json's are the files
        last = records[-1] if records else None
        if last is not None and last.process_cpu_seconds is not None and self.cpu is not None:
            self.cpu.carried = last.process_cpu_seconds
        return Acknowledged()

    # -- the close -------------------------------------------------------------------------------------------
    def close(self, training: TrainingFacts) -> dict[str, Any]:
        self.check_training_folder()
        if len(self.stages) != len(self.judge.fractions):
            raise RecordDamaged(f"the training process of {self.run_dir} closed the run after {len(self.stages)} of "
                                f"{len(self.judge.fractions)} stages; move the run folder aside and start the run "
                                f"again")
        last = self.stages[-1]
        final = self.judge.weights_of(self._saved(StageSaved.of(last.stage - 1, last.checkpoint)))
        initial = checkpoints.load(self.layout.initial, limit_bytes=self.judge.limit_bytes)["model"]
        process = {"cpu_seconds": self.cpu.total() if self.cpu is not None else None,
                   "peak_rss_bytes": self.training_process.peak_rss_bytes()}
        outcome = ClosingInputs(stages=self.stages, incumbent=self.incumbent, training=training,
                             initial_model=initial, final_model=final, confinement=self.confinement,
                             machine=self.machine.to_json(), process=process)
        return close_run(self.layout, self.lock, self.arm_name, self.seed, self.protocol, outcome, self.anchor,
                         self.splits)


def said_of(record: StageRecord) -> str:
    """A stage's outcome in words, as a run prints it: promoted, or kept and the first reasons why."""
    if record.promoted:
        return "promoted"
    return f"kept {record.incumbent_after} ({'; '.join(record.decision['reasons'][:2])})"


def write_start_record(evaluator: Evaluator, starting: Starting) -> None:
    """``start.json``: what the run starts from, from the lock and what the training process sent before any agent
    program could run in it."""
    lock, protocol, layout = evaluator.lock, evaluator.protocol, evaluator.layout
    arm = protocol.arms[evaluator.arm_name]
    start = StartRecord(
        lock=str(lock.path.resolve()), lock_sha256=lock.sha256, protocol=lock.name, arm=evaluator.arm_name,
        seed=evaluator.seed,
        budget={"clock": protocol.budget.clock, "total": protocol.budget.amount * arm.budget_multiplier,
                "fractions": list(protocol.budget.fractions), "threads": protocol.budget.threads},
        anchor={"folder": os.path.relpath(layout.anchor.folder, layout.root),
                "model_sha256": evaluator.anchor["model_sha256"]},
        arm_config=lock.resolved["arms"][evaluator.arm_name], training=lock.resolved["training"],
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), ranks=protocol.training.ranks,
        **{**starting.to_json(), "host": starting.host or platform.node()})
    atomic_write_json(layout.start, start.to_json())


def check_start_record(path: Path, lock_sha256: str, arm: str, seed: int) -> None:
    """A resumed run's ``start.json``: there, of this lock, arm and seed, and as opalctl wrote it."""
    advice = "restore it, or start the run again from update 0 with --restart"
    if not path.is_file():
        raise RecordChanged(f"{path} is missing, and the run's resume checkpoint says it started; {advice}")
    start = read_record(path, StartRecord, advice=advice)
    if (start.lock_sha256, start.arm, start.seed) != (lock_sha256, arm, seed) or \
            sha256_file(path) != record_sha256(start.to_json()):
        raise RecordChanged(f"{path} is not the one this run wrote (it names another lock, arm or seed, or was "
                            f"edited); {advice}")


def _read_own_stage(path: Path, number: int, advice: str) -> StageRecord:
    """Stage ``number``'s record as this evaluator wrote it: of that stage, and byte for byte its canonical form
    (a key added or a value retyped by hand is an edit)."""
    record = read_record(path, StageRecord, advice=advice)
    if record.stage != number:
        raise RecordChanged(f"stage record {path} holds the record of stage {record.stage}; {advice}")
    if sha256_file(path) != record_sha256(record.to_json()):
        raise RecordChanged(f"stage record {path} is not as opalctl wrote it (it was edited); {advice}")
    return record


def _require_same(judged: StageRecord, written: StageRecord, path: Path, checkpoint: Path) -> None:
    """Refuse a stage record whose judged fields (or training facts) differ from a new judgement of its checkpoint."""
    mine, theirs = judged.to_json(), written.to_json()
    differ = [key for key in mine if key not in ("eval_seconds", "process_cpu_seconds") and mine[key] != theirs.get(key)]
    if differ:
        raise RecordChanged(f"stage record {path} does not match a new evaluation of {checkpoint} ({', '.join(differ[:4])} "
                            f"differ); move the run folder {path.parent} aside and start the run again")


def prepare_anchor(lock, task, splits, seed: int, anchor_folder: AnchorFolder, parent,
                   model_digest: str) -> dict[str, Any]:
    """Evaluate the parent once per lock and seed; when it was done before, check its record instead of redoing
    it: it must be of this lock, parent and data, and its metrics must match its digest (a record written before
    the chain has none: its metrics are evaluated again and must be the same)."""
    folder, record_path = anchor_folder.folder, anchor_folder.record
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


class AnswerChannel:
    """The evaluator's answers: written whole, one at a time, by the main thread or by the evaluate limit's timer,
    which answers the request in progress with its sentence and ends the process (nothing else can end a task's
    evaluate that hangs)."""

    def __init__(self, answers):
        self.answers = answers
        self.lock = threading.Lock()

    def write(self, answer: dict[str, Any]) -> None:
        with self.lock:
            self.answers.write(json.dumps(answer, allow_nan=True) + "\n")
            self.answers.flush()

    def expire(self, sentence: OpalctlError) -> None:
        sys.stderr.write(f"{sentence.message}\n")
        try:
            self.write(_failure(sentence))
        except (OSError, ValueError):
            pass  # the training process is gone
        finally:
            os._exit(1)


_channel: AnswerChannel | None = None  # set by ``serve`` in the evaluator process


def serve(requests, answers) -> int:
    """Answer each request line until the input ends (the training process closed it, or is gone)."""
    global _channel
    _channel = channel = AnswerChannel(answers)
    evaluator: Evaluator | None = None
    for line in requests:
        try:
            request = json.loads(line)
            kind = request["kind"]
            if kind not in Message.BODIES:
                raise EvaluatorFailed(f"the evaluator was sent {kind!r}, which is not one of {', '.join(Message.ALL)}; "
                                      f"this is a bug in opalctl")
            body = Message.BODIES[kind].from_json(request["body"], advice="this is a bug in opalctl")
            if kind == Message.OPEN:
                evaluator, done = Evaluator(body), Acknowledged()
            elif evaluator is None:
                raise EvaluatorFailed("the evaluator was asked for work before it was opened; this is a bug")
            else:
                done = evaluator.handle(kind, body)
            answer: dict[str, Any] = {"ok": done.to_json()}
        except Exception as error:  # every failure is an answer; after it the training process ends the run
            traceback.print_exc(file=sys.stderr)
            answer = _failure(error)
        try:
            channel.write(answer)
        except (BrokenPipeError, OSError):
            return 0  # the training process is gone: nothing waits for the answer
        if "error" in answer:
            return 1
    return 0


def die_with_parent(parent: int) -> None:
    """The kernel kills this process when the training process that started it dies (Linux's parent-death
    signal), whatever it is doing then, a task's evaluate that hangs included: a run killed with SIGKILL leaves no
    evaluator holding its folder's lock. Where the system has no such signal the input's end and the evaluate
    limit end it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


def main() -> int:
    if len(sys.argv) > 2:
        die_with_parent(int(sys.argv[2]))
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # they stop the run (a terminal signals the
        signal.signal(number, signal.SIG_IGN)                      # whole group); the evaluator sees its input end
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a task prints goes to stderr, never into the answers
    return serve(sys.stdin, answers)


if __name__ == "__main__":
    status = main()
    end_without_teardown(status)  # every answer written: the training process waits for this process's end
    sys.exit(status)
