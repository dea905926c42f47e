"""The agent host: the process where the agent's work happens, outside the training process.

The agent optimizer starts it when it is built, before any agent program loads and before the formal run
confines the training process (no network, no writes outside its run folder): the host keeps both, and the
environment the training process had then (the API keys), which the training process then removes from its
own ``os.environ`` (``scrub_environment``). Each decision runs in a worker process of the host
(``python -m opalctl.opal.agents.worker``, its own process group) with a time limit; past it the worker's
group is killed and the decision fails, and training goes on. A worker is started ahead of its decision, so
that its imports are done when the question comes (one spare, started after each decision).

Training process and host talk over the host's standard input and output, one JSON object per line, each
request with an ``id`` its reply repeats:

    -> {"op": "start", "recipe": {...}}                                   (first line; no reply)
    -> {"op": "decide", "id": N, "workspace": ..., "message": ..., "facts": {...}, "seconds": S}
    <- {"id": N, "answer": Answer.to_json()}
    -> {"op": "cancel", "id": N}                                          (the decision's worker is killed)
    -> {"op": "environment", "id": N}
    <- {"id": N, "environment": {name: value, ...}}                      (the secret-looking variables it holds)

End of input ends the host (and its workers). The worker's own request and answer are one JSON object each on
its standard input and output: ``{"recipe", "carry", "workspace", "message", "facts"}`` in, ``{"answer",
"carry"}`` out.

A host that dies is one failed decision and one sentence: the training process cannot start another one with
the key and the network (it no longer has either), so every later decision fails with the same sentence.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from typing import Any

from opalctl.opal.agents.base import Answer

LIMIT_GRACE_SECONDS = 10.0  # a backend keeps its own limit first; the host's is that and this much more
STOP_SECONDS = 5.0
STDERR_CHARS = 2000


def _worker_command() -> list[str]:
    return [sys.executable, "-m", "opalctl.opal.agents.worker"]


def limit_of(backend) -> float:
    """The host's time limit for one decision of ``backend``."""
    return float(backend.seconds_per_decision) + LIMIT_GRACE_SECONDS


# -- the training process's side ---------------------------------------------------------------------------------

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
            except ValueError:
                continue
            with self.ready:
                self.replies[int(reply["id"])] = reply
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
    """The agent host as the training process sees it: requests out, replies collected by a reader thread."""

    def __init__(self, recipe: dict[str, Any]):
        self.process = subprocess.Popen([sys.executable, "-m", "opalctl.opal.agents.host"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        self.mailbox = _Mailbox()
        self._ids = iter(range(1 << 30, 1 << 31))  # ids of the host's own requests; decisions use their numbers
        self._send({"op": "start", "recipe": recipe})
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

    def ask(self, number: int, workspace, message: str, facts: dict[str, Any], seconds: float) -> None:
        """Send decision ``number`` (its answer is ``answer(number)``)."""
        if self.ended is None and not self._send({"op": "decide", "id": number, "workspace": str(workspace),
                                                  "message": message, "facts": facts, "seconds": seconds}):
            self._gone("could not be reached")

    def answer(self, number: int, wait: bool, seconds: float) -> Answer | None:
        """The answer of decision ``number`` (None while it works, unless ``wait``); a failed answer with the
        sentence when the host is gone, or when it did not answer within ``seconds`` (it is then ended)."""
        reply = self.mailbox.take(number, wait, seconds + LIMIT_GRACE_SECONDS)
        if reply is None:
            if not wait and self.ended is None:
                return None
            if self.ended is None:
                self._gone(f"did not answer within {seconds + LIMIT_GRACE_SECONDS:g} s")
            return Answer(rationale="", failed=self.ended)
        return Answer.from_json(reply["answer"])

    def cancel(self, number: int) -> None:
        self._send({"op": "cancel", "id": number})

    def environment(self) -> dict[str, str]:
        """The secret-looking variables the host holds (given back to this process when the agent is done)."""
        number = next(self._ids)
        if self.ended is not None or not self._send({"op": "environment", "id": number}):
            return {}
        reply = self.mailbox.take(number, True, STOP_SECONDS)
        return dict(reply["environment"]) if reply else {}

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

class Workers:
    """The host's workers: one spare started ahead, one decision's worker at a time, and what one decision's
    backend carries to the next."""

    def __init__(self, recipe: dict[str, Any], reply):
        self.recipe = recipe
        self.reply = reply  # writes one reply line (thread-safe)
        self.carried: dict[str, Any] = {}
        self.running: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self.spare: subprocess.Popen | None = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(_worker_command() + [str(self.recipe.get("backend", ""))], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    def decide(self, request: dict[str, Any]) -> None:
        number, seconds = int(request["id"]), float(request["seconds"])
        with self._lock:
            worker, self.spare = (self.spare or self._spawn()), None
            self.running[number] = worker
        question = {"recipe": self.recipe, "carry": self.carried, "workspace": request["workspace"],
                    "message": request["message"], "facts": request["facts"]}
        try:
            out, err = worker.communicate(json.dumps(question).encode(), timeout=seconds)
            answer = self._answer_of(worker, out, err)
        except subprocess.TimeoutExpired:
            _kill_group(worker)
            worker.communicate()
            answer = Answer(rationale="", failed=f"the decision ran past its limit of {seconds:g} s and was stopped "
                                                 f"(its worker process was killed); training goes on with the "
                                                 f"programs it has").to_json()
        with self._lock:
            cancelled = self.running.pop(number, None) is None
            if self.spare is None:
                self.spare = self._spawn()
        if not cancelled:
            self.reply({"id": number, "answer": answer})

    def _answer_of(self, worker: subprocess.Popen, out: bytes, err: bytes) -> dict[str, Any]:
        try:
            result = json.loads(out)
            self.carried = dict(result.get("carry") or {})
            return result["answer"]
        except (ValueError, KeyError, TypeError):
            tail = err.decode(errors="replace").strip()[-STDERR_CHARS:]
            return Answer(rationale="", failed=f"the agent's worker process exited with {worker.returncode} and no "
                                               f"answer: {tail}").to_json()

    def cancel(self, number: int) -> None:
        with self._lock:
            worker = self.running.pop(number, None)
        if worker is not None and worker.poll() is None:
            _kill_group(worker)

    def stop(self) -> None:
        with self._lock:
            workers = list(self.running.values()) + ([self.spare] if self.spare else [])
            self.running, self.spare = {}, None
        for worker in workers:
            if worker.poll() is None:
                _kill_group(worker)


def serve(requests, replies) -> int:
    """The host's loop: ``requests`` lines in, ``replies`` lines out, until the input ends."""
    from opalctl.opal.records import secret_names

    lock = threading.Lock()

    def reply(value: dict[str, Any]) -> None:
        with lock:
            replies.write((json.dumps(value) + "\n").encode())
            replies.flush()

    start = json.loads(requests.readline() or "{}")
    workers = Workers(start.get("recipe") or {}, reply)
    threads = []
    for line in requests:
        request = json.loads(line)
        if request["op"] == "decide":
            thread = threading.Thread(target=workers.decide, args=(request,), daemon=True)
            thread.start()
            threads.append(thread)
        elif request["op"] == "cancel":
            workers.cancel(int(request["id"]))
        elif request["op"] == "environment":
            reply({"id": request["id"], "environment": {name: os.environ[name] for name in secret_names(os.environ)}})
    workers.stop()
    for thread in threads:
        thread.join(timeout=STOP_SECONDS)
    return 0


def scrub_environment(environ=None) -> list[str]:
    """Remove the secret-looking variables from this process's environment (the host holds them); returns
    their names."""
    from opalctl.opal.records import secret_names

    environ = os.environ if environ is None else environ
    names = secret_names(environ)
    for name in names:
        del environ[name]
    return names


if __name__ == "__main__":
    sys.exit(serve(sys.stdin.buffer, sys.stdout.buffer))
