"""The agent host: the process where the agent's work happens, outside the training process, and which trusts nothing
on its pipe.

The agent optimizer starts it when it is built, before any agent program loads and before the formal run confines
the training process (no network, writes only to ``training/``). Everything the host is to work with is fixed
then, in its start message: the backend's recipe, its workspace (a formal run's ``agent/workspace``) and its records
folder (``agent/``), both outside what the confined training process may write, the time limit of a decision, and
the strings to redact besides the keys. The keys reach it without passing through the training process: an
``opalctl run`` process handed them over in a pipe when it re-executed itself (``opalctl.opal.handover``), which
the host reads into its own environment (``--handover FD``); a library caller's host inherits them from the
environment, and the training process then removes them from its ``os.environ`` for good (``scrub_environment``).
No request returns a key, and nothing puts one back into the training process.

Each decision runs in a worker process of the host (``python -m opalctl.opal.agents.worker``, its own process
group) with the time limit; past it the worker's group is killed and the decision fails, and training goes on. A
worker is started ahead of its decision, so that its imports are done when the question comes (one spare, started
after each decision but the last scheduled one). One decision is worked at a time.

Training process and host talk over the host's standard input and output, one JSON object per line (the records
are formats.py's):

    -> HostStart  {"op": "start", "recipe": {...}, "workspace": ABS, "records": ABS, "limit": S, "secrets": [...]}
                  (first line, no reply; a bad start ends the host, exit 2)
    -> HostDecide {"op": "decide", "id": N, "message": TEXT, "facts": {...}, "programs": {"updater.py": TEXT,
                  "analysis.py": TEXT}} (the running programs; nothing else, and no path)
    <- HostReply  {"id": N, "answer": Answer.to_json()} (with "programs" as the agent left them, or "unreadable")
    -> HostCancel {"op": "cancel", "id": N} (the decision's worker is killed; no reply)
    <- HostReply  {"id": N, "refused": SENTENCE} (any other request, or a decide the host will not work)

A decide request is refused, never followed, when it holds any other key (a ``workspace``, any path), when its id
is not above every id asked before, while another decision is worked, or when its fields are not of their types;
the refusal is recorded (``refused.jsonl``). For a decision it works, the host checks its workspace by real path
(``FixedWorkspace.checked``), writes the running programs, the facts and the message into it, hands it to the
worker, then checks it again, sweeps it (links and special files removed, the limits of one decision, every file
through the host's ``SecretRedaction``: ``workspace.sweep``), reads the programs back (``read_program``'s rules:
regular UTF-8 files, no links, a size limit), redacts everything it answers, records the decision as it saw it
(``HostRecords``: ``decisions/NNN``) and answers. End of input ends the host (and its workers).

The worker's own request and answer are one JSON object each on its standard input and output: a
``WorkerQuestion`` (``{"recipe", "carry", "workspace", "message", "facts"}``, the workspace the host's own) in, a
``WorkerAnswer`` (``{"answer", "carry"}``) out.

A host that dies is one failed decision and one sentence: the training process cannot start another one with the
key and the network (it has neither), so every later decision fails with the same sentence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

from opalctl.formats import (
    HOST_CANCEL_KEYS,
    HOST_DECIDE_KEYS,
    HostCancel,
    HostDecide,
    HostDecisionRecord,
    HostRefusal,
    HostReply,
    HostStart,
    RecordDamaged,
    WorkerAnswer,
    WorkerQuestion,
)
from opalctl.opal.agents.base import Answer
from opalctl.opal.agents.workspace import MAX_PROGRAM_BYTES, FixedWorkspace, WorkspaceMoved, sweep
from opalctl.opal.handover import HANDOVER, Handover, release, secret_names, take
from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import HostRecords, SecretRedaction, program_sha256, redact_json

LIMIT_GRACE_SECONDS = 10.0  # a backend keeps its own limit first; the host's is that and this much more
STOP_SECONDS = 5.0
STDERR_CHARS = 2000


def _worker_command() -> list[str]:
    return [sys.executable, "-m", "opalctl.opal.agents.worker"]


def limit_of(backend) -> float:
    """The host's time limit for one decision of ``backend``."""
    return float(backend.seconds_per_decision) + LIMIT_GRACE_SECONDS


# -- the training process's side ---------------------------------------------------------------------------------

def release_secrets() -> None:
    """Close this process's end of the pipe an ``opalctl run`` process handed its secret-looking variables over in
    (``opalctl.opal.handover``), without reading it: the agent host, if one was started, holds its own end. Call
    it once the agent optimizer is built and before the training process is confined; nothing happens where
    nothing was handed over."""

    release()


def scrub_environment(environ=None) -> list[str]:
    """Remove the secret-looking variables from this process's environment (the host holds them); returns their
    names. They do not come back: a library caller sets one again itself (docs/integrations.md)."""

    environ = os.environ if environ is None else environ
    names = secret_names(environ)
    for name in names:
        del environ[name]
    return names


class _Mailbox:
    """The host's replies by id, and why it is gone; filled by the reader thread (which holds only this, so an
    optimizer dropped without ``close`` still lets its host go: the host's input closes and it ends)."""

    def __init__(self) -> None:
        self.replies: dict[int, dict[str, Any]] = {}
        self.ready = threading.Condition()
        self.ended: str | None = None

    def read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            try:
                reply = json.loads(line)
                number = int(reply["id"])
            except (ValueError, KeyError, TypeError):
                continue
            with self.ready:
                self.replies[number] = reply
                self.ready.notify_all()
        code = process.wait()
        self.end(f"the agent host (process {process.pid}) ended with exit code {code}; no decision can be asked "
                 f"for the rest of this run (the host alone held the key and the network)")

    def end(self, why: str) -> None:
        with self.ready:
            if self.ended is None:
                self.ended = why
            self.ready.notify_all()

    def take(self, number: int, wait: bool, seconds: float) -> dict[str, Any] | None:
        with self.ready:
            if wait:
                self.ready.wait_for(lambda: number in self.replies or self.ended is not None, timeout=seconds)
            return self.replies.pop(number, None)


class AgentHost:
    """The agent host as the training process sees it: the start, requests out, replies collected by a reader
    thread. ``workspace`` and ``records`` are the host's for good (module docstring)."""

    def __init__(self, recipe: dict[str, Any], *, workspace: str | os.PathLike, records: str | os.PathLike,
                 limit: float, secrets: list[str] | tuple[str, ...] = ()):
        handover = Handover.here()
        command = [sys.executable, "-m", "opalctl.opal.agents.host"]
        command += ["--handover", str(handover.fd)] if handover is not None else []
        environment = {name: value for name, value in os.environ.items() if name != HANDOVER}
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        start_new_session=True, env=environment,
                                        pass_fds=(handover.fd,) if handover is not None else ())
        if handover is not None:
            release_secrets()  # the host holds its own end now; this process never reads it
        self.mailbox = _Mailbox()
        self.limit = float(limit)
        self._send(HostStart(recipe=recipe, workspace=os.path.abspath(workspace), records=os.path.abspath(records),
                             limit=self.limit, secrets=list(secrets)).to_json())
        self._reader = threading.Thread(target=self.mailbox.read, args=(self.process,), name="opal-agent-host",
                                        daemon=True)
        self._reader.start()
        weakref.finalize(self, self.process.stdin.close)

    @property
    def ended(self) -> str | None:
        """Why the host is gone (None while it runs)."""
        return self.mailbox.ended

    def _send(self, request: dict[str, Any]) -> bool:
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def ask(self, number: int, message: str, facts: dict[str, Any], programs: dict[str, str]) -> None:
        """Send decision ``number`` with the running programs (its answer is ``answer(number)``)."""
        request = HostDecide(id=number, message=message, facts=facts, programs=programs)
        if self.ended is None and not self._send(request.to_json()):
            self._gone("could not be reached")

    def answer(self, number: int, wait: bool, seconds: float) -> Answer | None:
        """The answer of decision ``number`` (None while it works, unless ``wait``); a failed answer with the
        sentence when the host refused it, is gone, or did not answer within ``seconds`` (it is then ended)."""
        reply = self.mailbox.take(number, wait, seconds + LIMIT_GRACE_SECONDS)
        if reply is None:
            if not wait and self.ended is None:
                return None
            if self.ended is None:
                self._gone(f"did not answer within {seconds + LIMIT_GRACE_SECONDS:g} s")
            return Answer(rationale="", failed=self.ended)
        try:
            reply = HostReply.from_json(reply)
        except RecordDamaged as error:
            return Answer(rationale="", failed=f"the agent host's reply to decision {number} is not one: "
                                               f"{error.message}")
        if reply.refused is not None:
            return Answer(rationale="", failed=f"the agent host refused decision {number}: {reply.refused}")
        return Answer.from_json(reply.answer or {})

    def cancel(self, number: int) -> None:
        self._send(HostCancel(id=number).to_json())

    def _gone(self, why: str) -> None:
        self.mailbox.end(f"the agent host {why} and was stopped; no decision can be asked for the rest of this run")
        self.stop()

    def stop(self) -> None:
        """End the host and its workers."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            _kill_group(self.process)
        self._reader.join(timeout=STOP_SECONDS)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.wait()


# -- the host's side ---------------------------------------------------------------------------------------------

class StartRefused(Exception):
    """The host's start message cannot start it; the message says why in one sentence."""


class Workers:
    """The host's workers: one spare started ahead, one decision's worker at a time, and what one decision's
    backend carries to the next."""

    def __init__(self, backend: str):
        self.backend = backend
        self.carried: dict[str, Any] = {}
        self.running: dict[int, subprocess.Popen] = {}
        self.cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.spare: subprocess.Popen | None = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(_worker_command() + [self.backend], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def run(self, number: int, question: WorkerQuestion, seconds: float) -> tuple[Answer, bool]:
        """Decision ``number`` in a worker, stopped after ``seconds``: its answer, and whether it was cancelled. The
        question carries what the previous decision's backend left (``carry``), whatever it held."""
        with self._lock:
            worker, self.spare = (self.spare or self._spawn()), None
            self.running[number] = worker
        question = replace(question, carry=self.carried)
        try:
            out, err = worker.communicate(json.dumps(question.to_json()).encode(), timeout=seconds)
            answer = self._answer_of(worker, out, err)
        except subprocess.TimeoutExpired:
            _kill_group(worker)
            worker.communicate()
            answer = Answer(rationale="", failed=f"the decision ran past its limit of {seconds:g} s and was stopped "
                                                 f"(its worker process was killed); training goes on with the "
                                                 f"programs it has")
        with self._lock:
            self.running.pop(number, None)
            cancelled = number in self.cancelled
            self.cancelled.discard(number)
            if self.spare is None and _more_expected(question.facts):
                self.spare = self._spawn()
        if cancelled:
            answer = Answer(rationale="", failed="cancelled: the training process stopped waiting for this decision "
                                                 "(the run ended before its answer could be applied)")
        return answer, cancelled

    def _answer_of(self, worker: subprocess.Popen, out: bytes, err: bytes) -> Answer:
        try:
            result = WorkerAnswer.from_json(json.loads(out))
            answer = Answer.from_json(result.answer)
            self.carried = dict(result.carry)
            return answer
        except (RecordDamaged, ValueError, KeyError, TypeError, AttributeError):
            tail = err.decode(errors="replace").strip()[-STDERR_CHARS:]
            return Answer(rationale="", failed=f"the agent's worker process exited with {worker.returncode} and no "
                                               f"answer: {tail}")

    def cancel(self, number: int) -> None:
        with self._lock:
            worker = self.running.get(number)
            if worker is not None:
                self.cancelled.add(number)
        if worker is not None and worker.poll() is None:
            _kill_group(worker)

    def stop(self) -> None:
        with self._lock:
            workers = list(self.running.values()) + ([self.spare] if self.spare else [])
            self.cancelled.update(self.running)
            self.spare = None
        for worker in workers:
            if worker.poll() is None:
                _kill_group(worker)


def _more_expected(facts: Any) -> bool:
    """Whether a scheduled decision follows this one (the facts' ``remaining``): only then is a worker started
    ahead for it, whose imports (the Messages API's SDK: 2 CPU-s) would otherwise be thrown away at the run's end; a
    wake-up or a non-finite loss after the last one starts its worker when it comes."""
    remaining = facts.get("remaining") if isinstance(facts, dict) else None
    return not isinstance(remaining, int) or remaining > 0


def _is_text_map(value: Any, names: tuple[str, ...], limit: int) -> bool:
    return (isinstance(value, dict) and set(value) == set(names)
            and all(isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) <= limit
                    for text in value.values()))


class Host:
    """The host's session: what its start fixed (the backend's recipe, the workspace, the records, the limit, the
    redaction), its workers, and the decisions asked so far; ``receive`` takes one line of its input."""

    def __init__(self, start: HostStart, reply):
        recipe, limit = start.recipe, start.limit
        if not isinstance(recipe.get("backend"), str):
            raise StartRefused("the start names no backend recipe")
        if not limit > 0:
            raise StartRefused("the start gives no time limit for a decision (a positive number of seconds)")
        for key, folder in (("workspace", start.workspace), ("records", start.records)):
            if not os.path.isabs(folder):
                raise StartRefused(f"the start names no {key} folder as an absolute path")
        try:
            self.workspace = FixedWorkspace(start.workspace)
        except (WorkspaceMoved, OSError) as error:
            raise StartRefused(f"its workspace cannot be made ({error})") from None
        options = recipe.get("options") if isinstance(recipe.get("options"), dict) else {}
        given_key = options.get("api_key")
        self.redaction = SecretRedaction([*start.secrets, *([given_key] if isinstance(given_key, str) else [])],
                                         environ=os.environ)
        self.records = HostRecords(Path(start.records), self.redaction)
        self.recipe, self.limit, self.reply = recipe, float(limit), reply
        self.workers = Workers(recipe["backend"])
        self.last = 0  # the highest decision id asked of this host
        self.busy: int | None = None  # the decision being worked on
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    # -- one line of input -----------------------------------------------------------------------------------
    def receive(self, line: bytes) -> None:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            request = None
        if not isinstance(request, dict):
            self.refuse({}, "a line of the agent host's input is not a JSON object; send one request per line")
            return
        op = request.get("op")
        if op == "decide":
            self._ask(request)
        elif op == "cancel":
            if isinstance(request.get("id"), int) and set(request) == HOST_CANCEL_KEYS:
                self.workers.cancel(request["id"])
            else:
                self.refuse(request, "a cancel request carries op and the id of the decision to stop, nothing else")
        elif op == "start":
            self.refuse(request, "the agent host has started already: its workspace and records were fixed then and "
                                 "never change; send decide or cancel requests")
        else:
            self.refuse(request, f"the agent host answers no {op!r} request: it takes decide and cancel requests "
                                 f"only, and gives no key or environment to anyone")

    def refuse(self, request: dict[str, Any], sentence: str) -> None:
        """Record a refused request (the names of its keys, never its values) and answer its id, if it has one."""

        number = request.get("id")
        op = request.get("op")
        try:
            self.records.refused(HostRefusal(op=op if isinstance(op, (str, int, float, type(None))) else repr(op),
                                             id=number if isinstance(number, (int, str, type(None))) else repr(number),
                                             keys=sorted(str(key) for key in request), refused=sentence))
        except OSError:
            pass  # a full disk does not make the host follow a request it refuses
        if isinstance(number, int) and not isinstance(number, bool):
            self.reply(HostReply(id=number, refused=self.redaction(sentence)).to_json())

    def _problem(self, request: dict[str, Any]) -> str | None:
        """Why the host will not work on this decide request (None: it will)."""

        number = request.get("id")
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            return "a decide request needs a positive integer id, the decision's number"
        extra = sorted(set(request) - HOST_DECIDE_KEYS)
        if extra:
            return (f"decision {number}'s request names {', '.join(map(repr, extra))}, which no request may name: "
                    f"the agent host works only in the workspace it was given when it started and takes no path "
                    f"from its input; send op, id, message, facts and programs only")
        if self.busy is not None:
            return (f"decision {number} was asked while decision {self.busy} is still being worked on; the agent "
                    f"host works on one decision at a time: wait for its answer or cancel it")
        if number <= self.last:
            return (f"decision {number} was asked after decision {self.last}; each decision is asked once, in "
                    f"order: ask decision {self.last + 1} or a later one")
        if not (isinstance(request.get("message"), str) and isinstance(request.get("facts"), dict)
                and _is_text_map(request.get("programs"), PROGRAM_FILES, MAX_PROGRAM_BYTES)):
            return (f"decision {number}'s request must carry message (text), facts (an object) and programs (the "
                    f"text of updater.py and analysis.py, each at most {MAX_PROGRAM_BYTES} bytes)")
        return None

    def _ask(self, request: dict[str, Any]) -> None:
        with self._lock:
            problem = self._problem(request)
            if problem is None:
                self.busy = self.last = request["id"]
        if problem is not None:
            self.refuse(request, problem)
            return
        thread = threading.Thread(target=self._decide, args=(request,), daemon=True)
        thread.start()
        self.threads.append(thread)

    # -- one decision ----------------------------------------------------------------------------------------
    def _decide(self, request: dict[str, Any]) -> None:
        number = request["id"]
        try:
            answer, cancelled = self._work(number, request)
        finally:
            with self._lock:
                self.busy = None  # before the answer: the next decision may be asked as soon as it arrives
        if not cancelled:
            self.reply(HostReply(id=number, answer=answer.to_json()).to_json())

    def _work(self, number: int, request: dict[str, Any]) -> tuple[Answer, bool]:
        started = time.monotonic()
        redaction = self.redaction
        message = redaction(request["message"])
        facts = redact_json(request["facts"], redaction)
        running = {name: redaction(text) for name, text in request["programs"].items()}
        cancelled, swept, programs, unreadable = False, [], dict(running), None
        try:
            root = self.workspace.put(running, json.dumps(facts, sort_keys=True, default=float), message)
        except (WorkspaceMoved, OSError) as error:
            answer = Answer(rationale="", failed=str(error))
        else:
            question = WorkerQuestion(recipe=self.recipe, workspace=str(root), message=message, facts=facts, carry={})
            answer, cancelled = self.workers.run(number, question, self.limit)
            try:
                swept = sweep(self.workspace.checked(), redaction, keep=PROGRAM_FILES)
                programs, unreadable = self.workspace.programs()
            except (WorkspaceMoved, OSError) as error:
                answer.failed = answer.failed or str(error)
            programs = {name: redaction(text) for name, text in programs.items()}
        if swept:
            answer.transcript.append({"event": "sweep", "done": swept})
        answer.rationale = redaction(answer.rationale)
        answer.transcript = redact_json(answer.transcript, redaction)
        answer.usage = redact_json(answer.usage, redaction)
        answer.failed = redaction(answer.failed) if answer.failed is not None else None
        answer.programs, answer.unreadable = (None, None) if answer.failed else (programs, unreadable)
        record = HostDecisionRecord(
            decision=number, backend=self.recipe["backend"], seconds=time.monotonic() - started, usage=answer.usage,
            cost_usd=float(answer.cost_usd or 0.0), failed=answer.failed, unreadable=unreadable,
            programs={name: program_sha256(text) for name, text in programs.items()},
            running={name: program_sha256(text) for name, text in running.items()}, swept=swept,
            remote=redact_json(answer.remote, redaction) if answer.remote is not None else None)
        try:
            self.records.save_decision(record, message=message, facts=facts, running=running,
                                       rationale=answer.rationale, transcript=answer.transcript, programs=programs)
        except OSError as error:
            answer = Answer(rationale="", usage=answer.usage, cost_usd=answer.cost_usd,
                            failed=f"the agent host could not record decision {number} ({error.strerror or error}); "
                                   f"an answer it did not record is not given to training")
        return answer, cancelled

    def stop(self) -> None:
        self.workers.stop()
        for thread in self.threads:
            thread.join(timeout=STOP_SECONDS)


def serve(requests, replies, handover_fd: int | None = None) -> int:
    """The host's loop: the handed-over keys taken, the start read, then ``requests`` lines in and ``replies``
    lines out, until the input ends."""
    if handover_fd is not None:
        take(handover_fd)
    lock = threading.Lock()

    def reply(value: dict[str, Any]) -> None:
        with lock:
            replies.write((json.dumps(value) + "\n").encode())
            replies.flush()

    try:
        start = json.loads(requests.readline() or "null")
        if not isinstance(start, dict) or start.get("op") != "start":
            raise StartRefused("its first line is not a start request")
        host = Host(HostStart.from_json(start), reply)
    except RecordDamaged as refusal:
        sys.stderr.write(f"opalctl: the agent host cannot start: {refusal.message}; no decision can be asked\n")
        return 2
    except (StartRefused, ValueError, UnicodeDecodeError) as refusal:
        sys.stderr.write(f"opalctl: the agent host cannot start: {refusal}; no decision can be asked\n")
        return 2
    for line in requests:
        host.receive(line)
    host.stop()
    return 0


def main(argv: list[str]) -> int:
    handover_fd = int(argv[1]) if argv[:1] == ["--handover"] and len(argv) > 1 and argv[1].isdigit() else None
    return serve(sys.stdin.buffer, sys.stdout.buffer, handover_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
