"""The mailbox's layout and its leases, on top of a ``MailboxFolder`` (its six operations only).

    requests/ID.json        a decision asked (``MailboxRequest``), created by the training side's agent host
    leases/ID.NNNNNN        generation NNNNNN of a server's hold on request ID (``MailboxLease``)
    answers/ID.json         the answer (``MailboxAnswer``), created once by the server that held the lease

ID is ``LABEL-dNNN-RANDOM``: the run's label, the decision's number and a fresh random part, so that a request
asked again (a resumed run asks its pending decision anew) never shares a name with the one before.

A lease is taken by *creating* the next generation's file: a free request (no lease file) is taken with
generation 1; a lease whose holder let it expire (it died, or stalled past ``expires``) is taken over with the
generation after the highest. ``create`` fails when the name exists, so of two servers reaching for one generation
exactly one gets it, and nothing is ever removed to take a lease. The holder renews its file while it works; a
holder that finds a higher generation than its own has lost the request and stops. Even a server that does not
know it lost cannot make a second answer: the answer is *created* too, so one request has at most one answer, and
the training side takes that one (after checking it: ``opalctl.opal.agents.mailbox``). Expiry compares a lease's
``expires`` with the reading server's clock: the servers of one mailbox are expected to keep time within seconds.

The training side withdraws a request when it has its answer or stops waiting (its request, answer and leases
removed); a server that finds its request withdrawn stops working on it, and removes an answer or lease whose
request is gone.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from opalctl.files import sha256_bytes
from opalctl.formats import MailboxAnswer, MailboxLease, MailboxRequest, RecordDamaged, decode_record
from opalctl.opal.mailbox.folder import MailboxFolder, MailboxRefusal

REQUESTS, ANSWERS, LEASES = "requests", "answers", "leases"
LEASE_SECONDS = 60.0  # how long a lease holds without renewal; a holder renews it every third of that
REQUEST_MAX_BYTES = MailboxRequest.MAX_BYTES
ANSWER_MAX_BYTES = MailboxAnswer.MAX_BYTES


def request_prefix(label: str) -> str:
    """How every request id of the run labelled ``label`` starts, whatever its decision (``new_request_id``)."""
    safe = "".join(c if c.isalnum() or c in "_-" else "-" for c in label)[-60:] or "run"
    return f"{safe}-d"


def new_request_id(label: str, decision: int) -> str:
    return f"{request_prefix(label)}{decision:03d}-{secrets.token_hex(6)}"


def server_identity() -> tuple[str, str]:
    """A fresh server id (host, process, random part) and this machine's name."""
    host = socket.gethostname()
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}", host


def encoded(record: Any) -> bytes:
    """A record's bytes in the mailbox (a loss that is not finite, as the facts may show, is written as NaN)."""
    return json.dumps(record.to_json(), sort_keys=True, ensure_ascii=False).encode("utf-8")


def decoded(data: bytes, cls, what: str):
    """``cls`` from a mailbox file's bytes; ``RecordDamaged`` naming ``what`` when they are not one."""
    value, why = decode_record(data)
    if why is not None:
        raise RecordDamaged(f"{what} {why}")
    return cls.from_json(value, what)


@dataclass
class Lease:
    request: str
    generation: int
    record: MailboxLease

    @property
    def path(self) -> str:
        return f"{LEASES}/{self.request}.{self.generation:06d}"


class Mailbox:
    """One mailbox, over ``folder``."""

    def __init__(self, folder: MailboxFolder, lease_seconds: float = LEASE_SECONDS):
        self.folder = folder
        self.lease_seconds = float(lease_seconds)

    def prepare(self) -> None:
        for sub in (REQUESTS, ANSWERS, LEASES):
            self.folder.makedirs(sub)

    # -- the training side -----------------------------------------------------------------------------------
    def post(self, request: MailboxRequest) -> str:
        """Create the request's file; returns the sha256 of its bytes (its answer must name it)."""
        data = encoded(request)
        if not self.folder.create(f"{REQUESTS}/{request.request}.json", data):
            raise FileExistsError(f"{self.folder.where}: request {request.request} exists already")
        return sha256_bytes(data)

    def answer_bytes(self, request_id: str) -> bytes | None:
        """The answer file's bytes (None: none yet); ``MailboxRefusal`` for a link, a special file, one too large."""
        return self.folder.read(f"{ANSWERS}/{request_id}.json", ANSWER_MAX_BYTES)

    def discard_answer(self, request_id: str) -> None:
        self.folder.remove(f"{ANSWERS}/{request_id}.json")

    def withdraw(self, request_id: str) -> None:
        """The request, its answer and its leases removed: no server works on it any more."""
        self.folder.remove(f"{REQUESTS}/{request_id}.json")
        self.discard_answer(request_id)
        for generation in self.generations(request_id):
            self.folder.remove(f"{LEASES}/{request_id}.{generation:06d}")

    # -- the server's side -----------------------------------------------------------------------------------
    def requests(self) -> list[str]:
        return [name[:-len(".json")] for name in self.folder.names(REQUESTS) if name.endswith(".json")]

    def answered(self, request_id: str) -> bool:
        return f"{request_id}.json" in self.folder.names(ANSWERS)

    def request(self, request_id: str) -> tuple[MailboxRequest, str] | None:
        """The request and the sha256 of its bytes (None: withdrawn); ``RecordDamaged``/``MailboxRefusal`` for a
        file that is no request."""
        data = self.folder.read(f"{REQUESTS}/{request_id}.json", REQUEST_MAX_BYTES)
        if data is None:
            return None
        request = decoded(data, MailboxRequest, f"{self.folder.where}/{REQUESTS}/{request_id}.json")
        if request.request != request_id:
            raise RecordDamaged(f"{self.folder.where}/{REQUESTS}/{request_id}.json names request "
                                f"{request.request!r}, not its own")
        return request, sha256_bytes(data)

    def generations(self, request_id: str) -> list[int]:
        prefix = request_id + "."
        found = [name[len(prefix):] for name in self.folder.names(LEASES) if name.startswith(prefix)]
        return sorted(int(suffix) for suffix in found if suffix.isdigit())

    def holder(self, request_id: str, generation: int) -> MailboxLease | None:
        """The lease of that generation; None when it is gone, unreadable or not a lease (it then holds nothing
        once its file is older than a lease: see ``take``)."""
        try:
            data = self.folder.read(f"{LEASES}/{request_id}.{generation:06d}", MailboxLease.MAX_BYTES)
            return decoded(data, MailboxLease, "a lease") if data is not None else None
        except (RecordDamaged, MailboxRefusal):
            return None

    def take(self, request_id: str, server: str, host: str) -> Lease | None:
        """The lease on the request for ``server``, or None when another server holds it (or won it just now)."""
        generations = self.generations(request_id)
        if generations:
            held = self.holder(request_id, generations[-1])
            if held is not None and held.expires > time.time():
                return None
        lease = Lease(request_id, (generations[-1] + 1) if generations else 1,
                      MailboxLease(request=request_id, server=server, host=host, pid=os.getpid(),
                                   expires=time.time() + self.lease_seconds))
        return lease if self.folder.create(lease.path, encoded(lease.record)) else None

    def renew(self, lease: Lease) -> bool:
        """Push the lease's expiry on; False when it is lost (a later generation took it, or it was withdrawn)."""
        generations = self.generations(lease.request)
        if not generations or generations[-1] != lease.generation:
            return False
        lease.record.expires = time.time() + self.lease_seconds
        self.folder.replace(lease.path, encoded(lease.record))
        return True

    def release(self, lease: Lease) -> None:
        self.folder.remove(lease.path)

    def answer(self, answer: MailboxAnswer) -> bool:
        """Create the answer's file; False when the request has an answer already."""
        return self.folder.create(f"{ANSWERS}/{answer.request}.json", encoded(answer))

    def sweep(self, now: float, grace: float) -> list[str]:
        """Remove what no one will read: answers and leases of withdrawn requests, and requests whose deadline
        passed ``grace`` seconds ago (a training job that died before it withdrew them). Returns their ids."""
        answers, leases = self.folder.names(ANSWERS), self.folder.names(LEASES)
        live = set(self.requests())  # listed after them: a request is made before its answer and its leases
        removed = []
        for request_id in sorted(live):
            try:
                found = self.request(request_id)
            except (RecordDamaged, MailboxRefusal):
                continue
            if found is not None and found[0].deadline + grace < now:
                self.withdraw(request_id)
                removed.append(request_id)
        for name in answers:
            if name.endswith(".json") and name[:-len(".json")] not in live:
                self.folder.remove(f"{ANSWERS}/{name}")
        for name in leases:
            if name.rpartition(".")[0] not in live:
                self.folder.remove(f"{LEASES}/{name}")
        return removed
