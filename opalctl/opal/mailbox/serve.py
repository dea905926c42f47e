"""``opalctl agent serve MAILBOX --backend anthropic``: answer the decisions asked in a mailbox, on a machine with
the network and the key.

The server scans the mailbox (``box.Mailbox`` over any ``MailboxFolder``: a local or shared folder, or one over
ssh), takes each open request it may answer under a lease, and works it as the training job's agent host would
have: an agent host of its own (``opalctl.opal.agents.host.Host``) with a scratch workspace, the decision in a
worker process with the time limit, the workspace swept and the programs read back by the host's rules, everything
redacted against the server's own keys. The answering backend is built from the request's recipe, restricted to
the protocol keys that backend reads (never a key or a server address from the mailbox: the server's own
environment gives those), and only when it is the backend this server was started for (and the model, when
``--model`` is given); another request is left for another server. At most ``max_concurrent`` decisions are worked
at once, from any number of runs. The answer is created once (``box``): a request has one answer whatever the
servers do.

While a decision is worked its lease is renewed; a lease that is lost (taken over after it expired, or the request
withdrawn) stops the work without an answer. Ctrl-C (or SIGTERM) stops the workers and releases every lease, so
the next server takes each request again at once; a server killed outright leaves leases that expire after
``lease_seconds``.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.formats import HostDecide, HostReply, HostStart, MailboxAnswer, MailboxRequest, RecordDamaged
from opalctl.layout import WORKSPACE
from opalctl.opal.agents import registry
from opalctl.opal.agents.host import LIMIT_GRACE_SECONDS, Host
from opalctl.opal.mailbox.box import LEASE_SECONDS, Lease, Mailbox, server_identity
from opalctl.opal.mailbox.folder import LocalMailboxFolder, MailboxFolder, MailboxRefusal
from opalctl.opal.mailbox.ssh import SshMailboxFolder

POLL_SECONDS = 0.5
SWEEP_GRACE_SECONDS = 300.0  # a request past its deadline by this much is removed (its training job died)
DEADLINE_MARGIN_SECONDS = 5.0  # the answer must be written before the training side stops waiting


@dataclass
class Work:
    request: MailboxRequest
    sha: str
    lease: Lease
    started: float
    renewed: float
    lost: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Server:
    def __init__(self, folder: MailboxFolder, backend: str, *, model: str | None = None, max_concurrent: int = 4,
                 lease_seconds: float = LEASE_SECONDS, poll_seconds: float = POLL_SECONDS,
                 show: Callable[[dict[str, Any]], None] = lambda event: None):
        found = registry.find(backend)
        if found is None or not found[0].waits or backend == "mailbox":
            raise BadInput(f"--backend {backend!r} is no backend a mailbox can be answered by; use anthropic")
        if max_concurrent < 1:
            raise BadInput("--max-concurrent must be 1 or more")
        if not lease_seconds > 0:
            raise BadInput("--lease-seconds must be a positive number of seconds")
        self.kind = found[0]
        self.box = Mailbox(folder, lease_seconds)
        self.backend, self.model, self.max_concurrent = backend, model, max_concurrent
        self.poll_seconds, self.show_event = poll_seconds, show
        self.server, self.host = server_identity()
        self.working: dict[str, Work] = {}
        self.noticed: set[str] = set()
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="opalctl-serve")
        self.lock = threading.Lock()
        self.answered = 0

    def show(self, event: str, **fields: Any) -> None:
        self.show_event({"event": event, "at": time.time(), **fields})

    # -- the loop --------------------------------------------------------------------------------------------
    def serve(self) -> int:
        """Serve until stopped (Ctrl-C, SIGTERM: ``KeyboardInterrupt``); returns the number of answers written."""
        self.box.prepare()
        self.show("serving", mailbox=self.box.folder.where, server=self.server, backend=self.backend,
                  model=self.model, max_concurrent=self.max_concurrent)
        try:
            while not self.stopping.is_set():
                self.scan()
                self.stopping.wait(self.poll_seconds)
        finally:
            self.stop()
        return self.answered

    def scan(self) -> None:
        self.renew()
        for request_id in self.box.sweep(time.time(), SWEEP_GRACE_SECONDS):
            self.show("expired", request=request_id)
        for request_id in self.box.requests():
            with self.lock:
                if request_id in self.working or len(self.working) >= self.max_concurrent:
                    continue
            if (request_id, "left") not in self.noticed and (request_id, "unreadable") not in self.noticed:
                self.consider(request_id)  # a request left for another server is not read again

    def notice(self, request_id: str, event: str, **fields: Any) -> None:
        if (request_id, event) not in self.noticed:
            self.noticed.add((request_id, event))
            self.show(event, request=request_id, **fields)

    def open_request(self, request_id: str) -> bool:
        """Whether the request is still open: unanswered, and still there. In this order: the training side
        withdraws a request before its answer (``Mailbox.withdraw``), so a request found after no answer was found
        was not answered and withdrawn meanwhile; read the other way round, a request this server answered could
        be read just before its withdrawal and found unanswered just after it, and be worked (and paid) again."""
        return not self.box.answered(request_id) and request_id in self.box.requests()

    def consider(self, request_id: str) -> None:
        if not self.open_request(request_id):
            return
        try:
            found = self.box.request(request_id)
        except (RecordDamaged, MailboxRefusal) as why:
            self.notice(request_id, "unreadable", why=str(why))
            return
        if found is None:
            return
        request, sha = found
        if request.deadline - DEADLINE_MARGIN_SECONDS < time.time():
            return
        other = self.not_ours(request)
        if other is not None:
            self.notice(request_id, "left", why=other, run=request.label)
            return
        lease = self.box.take(request_id, self.server, self.host)
        if lease is None:
            return
        if not self.open_request(request_id):  # answered, or withdrawn, while the lease was taken
            self.box.release(lease)
            return
        now = time.time()
        work = Work(request, sha, lease, started=now, renewed=now)
        with self.lock:
            self.working[request_id] = work
        self.show("taken", request=request_id, run=request.label, decision=request.decision,
                  generation=lease.generation)
        self.pool.submit(self.work, work)

    def not_ours(self, request: MailboxRequest) -> str | None:
        """Why this server leaves the request to another (None: it answers it)."""
        wanted = request.backend.get("backend") if isinstance(request.backend, dict) else None
        if wanted != self.backend:
            return f"it asks for backend {wanted!r}; this server answers {self.backend!r}"
        options = request.backend.get("options")
        if not isinstance(options, dict):
            return "its backend recipe has no options"
        if self.model is not None and options.get("model") != self.model:
            return f"it asks for model {options.get('model')!r}; this server answers {self.model!r}"
        return None

    def renew(self) -> None:
        with self.lock:
            works = list(self.working.values())
        for work in works:
            if work.lost or time.time() - work.renewed < self.box.lease_seconds / 3:
                continue
            if self.box.renew(work.lease):
                work.renewed = time.time()
            else:
                work.lost = True
                self.show("lost", request=work.request.request, why="its lease was taken over or the request "
                                                                    "withdrawn; no answer is written")

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            left = list(self.working)
        self.pool.shutdown(wait=True)  # each work sees the stop within a poll, cancels and releases its lease
        self.show("stopped", answered=self.answered, released=left)

    # -- one request -----------------------------------------------------------------------------------------
    def recipe(self, request: MailboxRequest) -> dict[str, Any]:
        """The answering backend's recipe: the keys it reads from the request, its limit within the deadline."""
        keys = set(self.kind.options.model_fields) if self.kind.options else set()
        options = {key: value for key, value in request.backend["options"].items() if key in keys}
        if self.kind.prompted and isinstance(request.backend["options"].get("prompt_text"), str):
            options["prompt_text"] = request.backend["options"]["prompt_text"]
        remaining = request.deadline - DEADLINE_MARGIN_SECONDS - time.time()
        limit = float(options.get("seconds_per_decision") or 900.0)
        options["seconds_per_decision"] = max(1.0, min(limit, remaining))
        return {"backend": self.backend, "options": options}

    def work(self, work: Work) -> None:
        request = work.request
        scratch = Path(tempfile.mkdtemp(prefix="opalctl-serve-"))
        try:
            answer = self.decide(work, scratch)
            if answer is None or work.lost:
                return
            record = MailboxAnswer(request=request.request, run=request.run, request_sha256=work.sha,
                                   server=self.server, host=self.host, answered_at=time.time(),
                                   seconds=time.time() - work.started, answer=answer)
            if self.box.answer(record):
                with self.lock:
                    self.answered += 1
                self.show("answered", request=request.request, run=request.label, decision=request.decision,
                          seconds=record.seconds, cost_usd=answer.get("cost_usd"),
                          failed=(answer.get("failed") or "").split("\n")[0] or None)
            else:
                self.show("already answered", request=request.request)
        except Exception as error:  # one request's failure is shown; the server goes on with the others
            self.show("error", request=request.request, why=f"{type(error).__name__}: {error}")
        finally:
            self.box.release(work.lease)
            shutil.rmtree(scratch, ignore_errors=True)
            with self.lock:
                self.working.pop(request.request, None)

    def decide(self, work: Work, scratch: Path) -> dict[str, Any] | None:
        """The answer (``Answer.to_json()``) of an agent host of this server's, or None when the work stopped."""

        request = work.request
        recipe = self.recipe(request)
        replies: queue.Queue = queue.Queue()
        host = Host(HostStart(recipe=recipe, workspace=str(scratch / WORKSPACE), records=str(scratch),
                              limit=recipe["options"]["seconds_per_decision"] + LIMIT_GRACE_SECONDS, secrets=[]),
                    replies.put)
        try:
            host.receive(json.dumps(HostDecide(id=1, message=request.message, facts=request.facts,
                                               programs=request.programs).to_json()).encode())
            while True:
                try:
                    reply = replies.get(timeout=self.poll_seconds)
                    break
                except queue.Empty:
                    if work.lost or self.stopping.is_set():
                        host.workers.cancel(1)
                        return None
        finally:
            host.stop()
        reply = HostReply.from_json(reply)
        if reply.refused is not None:
            return {"rationale": "", "failed": f"the server refused the request: {reply.refused}"}
        return reply.answer


def mailbox_folder(mailbox: str, ssh_target: str | None) -> MailboxFolder:
    """The mailbox's folder: here (a local or shared folder), or ``mailbox`` on ``ssh_target`` over ssh."""

    if ssh_target is None:
        if not Path(mailbox).is_dir():
            raise BadInput(f"the mailbox folder {mailbox} does not exist; give the folder the runs' "
                           f"arms.NAME.agent.mailbox names (on a file system this machine shares)")
        return LocalMailboxFolder(mailbox)

    return SshMailboxFolder(f"{ssh_target}:{mailbox}")


def line_of(event: dict[str, Any]) -> str:
    """One event as a line for people."""
    stamp = time.strftime("%H:%M:%S", time.localtime(event["at"]))
    kind = event["event"]
    if kind == "serving":
        return (f"{stamp} serving {event['mailbox']} as {event['server']}: backend {event['backend']}"
                + (f", model {event['model']}" if event.get("model") else "")
                + f", at most {event['max_concurrent']} decisions at once (Ctrl-C stops and releases every lease)")
    if kind == "taken":
        return f"{stamp} taken   {event['run']} decision {event['decision']} ({event['request']})"
    if kind == "answered":
        tail = f"failed: {event['failed']}" if event.get("failed") else f"${event.get('cost_usd') or 0:.4f}"
        return f"{stamp} answered {event['run']} decision {event['decision']} in {event['seconds']:.1f} s ({tail})"
    if kind == "stopped":
        return f"{stamp} stopped: {event['answered']} answered, {len(event['released'])} lease(s) released"
    rest = ", ".join(f"{key} {value}" for key, value in event.items() if key not in ("event", "at"))
    return f"{stamp} {kind}: {rest}"
