"""The mailbox backend (``backend: mailbox``): each decision is asked in a folder and answered elsewhere, by
``opalctl agent serve`` on a machine with the network and the key (``opalctl.opal.mailbox``).

For a cluster whose compute nodes have no route to the API: the training job's agent host writes each decision's
request (the message, the facts, the running programs, a fresh request id, the run's identity, a deadline and the
recipe of the backend that is to answer, ``answered_by`` with its model and options: never a key or a server
address) into the mailbox folder and waits for the answer, as the host waits for any backend (blocking or not,
outside the budget, the waiting recorded). The server runs the named backend with its own key and creates the
answer file; the key never enters the training job or the mailbox.

The answer is hostile until checked. It must be a regular file (no link, no fifo) within ``ANSWER_MAX_BYTES``,
a ``MailboxAnswer`` naming this request's id, this run and the sha256 of the request's bytes, carrying both programs
as text within ``MAX_PROGRAM_BYTES``; anything else is refused, recorded in the decision's transcript and the
host's decision record (``remote.refused``), removed, and waited past. An accepted answer's programs are written
into the host's workspace, from where the host reads them back by its own rules (links, sizes, UTF-8, the
redaction) exactly as for a backend that worked there, and the training process loads them through the same
checks. An answer after the deadline is never read: the request is withdrawn and the decision fails, as a local
backend past its limit does. Each request id is fresh, so an answer to an earlier request (another decision, or
the one a killed training job asked before it was resumed) never matches.

The mailbox folder is an absolute path, or one relative to the folder the run is started in.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from opalctl.errors import BadInput
from opalctl.formats import MailboxAnswer, MailboxRequest, RecordDamaged
from opalctl.opal.agents.anthropic import AnthropicOptions
from opalctl.opal.agents.anthropic import lock_defaults as answering_lock_defaults
from opalctl.opal.agents.anthropic import problems as answering_problems
from opalctl.opal.agents.base import Answer, Backend, BackendKind
from opalctl.opal.agents.workspace import MAX_PROGRAM_BYTES, read_program, write_file_here
from opalctl.opal.mailbox.box import Mailbox, decoded, new_request_id, request_prefix
from opalctl.opal.mailbox.folder import LocalMailboxFolder, MailboxRefusal
from opalctl.opal.programs import PROGRAM_FILES

POLL_SECONDS = 0.25
ANSWERING_KEYS = ("model", "max_tokens", "turns", "seconds_per_decision", "retries", "prices", "effort")


class MailboxOptions(AnthropicOptions):
    """The keys of a mailbox arm: the folder, the backend that answers, and its keys (model, turns, ...)."""

    mailbox: str | None = None
    answered_by: Literal["anthropic"] | None = None  # None: anthropic
    queue_seconds: Annotated[float, Field(ge=0)] = 600.0  # how long a request may wait for a free server


def run_label(workspace: Path) -> str:
    """The run's name for people: its folder's last three parts (``RUNS/LOCK/ARM/seed-N/agent/workspace``)."""
    parts = Path(workspace).resolve().parts
    return "/".join(parts[-5:-2]) if len(parts) >= 5 else "run"


class MailboxBackend(Backend):
    name = "mailbox"
    runs_in = "host"  # it waits on a folder the confined training process may not write

    def __init__(self, mailbox: str | None = None, answered_by: str | None = None, queue_seconds: float = 600.0,
                 prompt_text: str | None = None, session: str | None = None, **answering: Any):
        if not mailbox:
            raise BadInput("agent backend 'mailbox' needs arms.NAME.agent.mailbox, the mailbox folder that "
                           "`opalctl agent serve` answers")
        self.mailbox = os.path.abspath(mailbox)
        self.answered_by = answered_by or "anthropic"
        self.queue_seconds = float(queue_seconds)
        self.prompt_text = prompt_text
        given = {key: value for key, value in answering.items() if key in ANSWERING_KEYS}
        if hasattr(given.get("prices"), "model_dump"):
            given["prices"] = given["prices"].model_dump()
        self.answering = {**given, **answering_lock_defaults({"model": given.get("model"),
                                                              "prices": given.get("prices")})}
        self.seconds_per_decision = float(self.answering.get("seconds_per_decision") or 900.0) + self.queue_seconds
        self.session = session or secrets.token_hex(8)  # this training process's identity in the mailbox

    def recipe(self) -> dict[str, Any]:
        return {"backend": self.name, "options": {"mailbox": self.mailbox, "answered_by": self.answered_by,
                                                  "queue_seconds": self.queue_seconds, "session": self.session,
                                                  "prompt_text": self.prompt_text, **self.answering}}

    def answering_recipe(self) -> dict[str, Any]:
        """What a server builds to answer: the backend and its options, never a key or a server address."""
        options = {**self.answering, "prompt_text": self.prompt_text}
        return {"backend": self.answered_by, "options": options}

    def describe(self) -> dict[str, Any]:
        answering = self.answering_recipe()
        answering["options"].pop("prompt_text", None)
        return {"backend": self.name, "mailbox": self.mailbox, "answered_by": answering}

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        box = Mailbox(LocalMailboxFolder(self.mailbox))
        box.prepare()
        return Asking(box, self, Path(workspace), message, facts).wait()


class Asking:
    """One decision asked in the mailbox: the request posted, answers checked as they come, the request withdrawn."""

    def __init__(self, box, backend: MailboxBackend, workspace: Path, message: str, facts: dict[str, Any]):
        self.box, self.backend, self.workspace = box, backend, workspace
        self.started = time.time()
        label = run_label(workspace)
        decision = facts.get("decision") if isinstance(facts.get("decision"), int) else 0
        self.request = MailboxRequest(
            request=new_request_id(label, decision), run=backend.session, label=label, decision=decision,
            asked_at=self.started, deadline=self.started + backend.seconds_per_decision,
            backend=backend.answering_recipe(), message=message, facts=facts,
            programs={name: read_program(workspace, name)[0] for name in PROGRAM_FILES})
        self.refused: list[dict[str, Any]] = []
        self.withdrew: list[str] = []  # requests an earlier process of this run left

    def wait(self) -> Answer:
        request = self.request
        self.withdraw_stale()
        sha = self.box.post(request)
        try:
            while True:
                found = self._answer(sha)
                if found is not None:
                    return self._accepted(found)
                if time.time() >= request.deadline:
                    return self._unanswered()
                time.sleep(POLL_SECONDS)
        finally:
            self.box.withdraw(request.request)

    def withdraw_stale(self) -> None:
        """Withdraw the requests an earlier process of this run left (a training job killed while it waited, then
        resumed): its decision is asked again now, and no server should spend a decision on the old request."""

        # from the label, not by cutting this request's id at its last "-d": its random part may start with a d
        prefix = request_prefix(self.request.label)
        for request_id in self.box.requests():
            if not request_id.startswith(prefix):
                continue
            try:
                found = self.box.request(request_id)
            except (RecordDamaged, MailboxRefusal):
                continue
            if found is not None and found[0].label == self.request.label and found[0].run != self.request.run:
                self.box.withdraw(request_id)
                self.withdrew.append(request_id)

    def _refuse(self, sentence: str) -> None:
        self.refused.append({"at": time.time() - self.started, "refused": sentence})
        self.box.discard_answer(self.request.request)

    def _answer(self, sha: str):
        """The answer if one is there and passes the checks; a refused one is recorded and removed."""

        try:
            data = self.box.answer_bytes(self.request.request)
            if data is None:
                return None
            found = decoded(data, MailboxAnswer, "the answer")
        except (MailboxRefusal, RecordDamaged) as why:
            self._refuse(f"{why}; it is not applied")
            return None
        problem = answer_problem(found, self.request, sha)
        if problem is not None:
            self._refuse(problem)
            return None
        return found

    def _remote(self, found=None) -> dict[str, Any]:
        remote = {"request": self.request.request, "mailbox": self.box.folder.where,
                  "round_trip_seconds": time.time() - self.started, "refused": self.refused,
                  "withdrew": self.withdrew}
        if found is not None:
            remote.update(server=found.server, host=found.host, answer_seconds=found.seconds)
        return remote

    def _accepted(self, found) -> Answer:
        answer = Answer.from_json(found.answer)
        if not answer.failed:
            for name in PROGRAM_FILES:
                write_file_here(self.workspace / name, answer.programs[name].encode("utf-8"))
        answer.programs, answer.unreadable = None, None  # the host reads them back from its workspace
        answer.remote = self._remote(found)
        answer.transcript.append({"event": "mailbox", **answer.remote})
        return answer

    def _unanswered(self) -> Answer:
        remote = self._remote()
        where = self.box.folder.where
        return Answer(rationale="", remote=remote, transcript=[{"event": "mailbox", **remote}],
                      failed=f"no server answered request {self.request.request} in the mailbox {where} within "
                             f"{self.backend.seconds_per_decision:g} s (arms.NAME.agent.seconds_per_decision plus "
                             f"queue_seconds); start `opalctl agent serve {where} --backend "
                             f"{self.backend.answered_by}` where the network is"
                             + (f"; {len(self.refused)} answer(s) were refused" if self.refused else ""))


def answer_problem(found, request, sha: str) -> str | None:
    """Why an answer in the mailbox is not this request's (None: it is); the sentence is recorded."""
    if found.request != request.request:
        return f"the answer names request {found.request!r}, not {request.request!r}: an answer to another " \
               f"request is never applied"
    if found.run != request.run:
        return f"the answer names run {found.run!r}, not this run's {request.run!r}"
    if found.request_sha256 != sha:
        return "the answer names another request's bytes (a stale or forged answer): it answers not what was asked"
    payload = found.answer
    if isinstance(payload.get("failed"), str):
        return None
    programs = payload.get("programs")
    if not (isinstance(programs, dict) and set(programs) == set(PROGRAM_FILES)
            and all(isinstance(text, str) for text in programs.values())):
        return "the answer carries no programs (updater.py and analysis.py as text) and says no failure"
    for name, text in programs.items():
        if len(text.encode("utf-8", "surrogatepass")) > MAX_PROGRAM_BYTES:
            return f"the answer's {name} is over {MAX_PROGRAM_BYTES} bytes; a program must be shorter"
    if not isinstance(payload.get("rationale", ""), str):
        return "the answer's rationale is not text"
    return None


# -- what the registry knows of this backend ---------------------------------------------------------------------

def lock_defaults(agent: dict[str, Any]) -> dict[str, Any]:
    """The lock names the answering backend, its model and prices: the arm's agent is remote, and which it is."""
    return {**answering_lock_defaults(agent), "answered_by": agent.get("answered_by") or "anthropic"}


def problems(agent: MailboxOptions, where: str) -> list[tuple[str, str]]:
    found = [] if agent.mailbox else [("mailbox", f"backend mailbox needs {where}.mailbox, the folder that "
                                                  f"`opalctl agent serve` answers (absolute, or relative to where "
                                                  f"the run starts)")]
    return found + answering_problems(agent, where)


def unready(agent: MailboxOptions | None) -> str | None:
    if agent is None or not agent.mailbox or os.path.isdir(agent.mailbox):
        return None
    return (f"the mailbox folder {os.path.abspath(agent.mailbox)} does not exist: make it (on a file system the "
            f"server's machine shares) and start `opalctl agent serve {agent.mailbox} --backend "
            f"{agent.answered_by or 'anthropic'}` there")


KIND = BackendKind(name="mailbox", waits=True, factory=MailboxBackend, options=MailboxOptions, prompted=True,
                   lock_defaults=lock_defaults, problems=problems, unready=unready,
                   own_keys=("mailbox", "answered_by", "queue_seconds"))
