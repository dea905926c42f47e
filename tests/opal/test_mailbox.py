"""The mailbox's folder, its leases, and the training side's checks of an answer (``backend: mailbox``).

The folder and the leases are exercised on a real folder; the hostile answers are written into a real mailbox
while the training side's ``Asking`` waits in a thread, each followed by the server's real answer: each hostile
one is refused, recorded (``remote.refused``) and removed, and only the real one is taken.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from opalctl.formats import MailboxAnswer
from opalctl.opal.agents import mailbox as mailbox_backend
from opalctl.opal.agents.mailbox import Asking, MailboxBackend
from opalctl.opal.mailbox.box import ANSWER_MAX_BYTES, Mailbox, encoded
from opalctl.opal.mailbox.folder import LocalMailboxFolder, MailboxRefusal

PROGRAMS = {"updater.py": "# updater\n", "analysis.py": "# analysis\n"}


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    """The training side looks for its answer every 0.02 s here, not every 0.25 s: each test waits for an answer or
    two, and what it checks is which answer is taken, not how often the folder is read."""
    monkeypatch.setattr(mailbox_backend, "POLL_SECONDS", 0.02)


def test_create_makes_a_file_only_once_and_names_lists_no_temporary_file(tmp_path):
    folder = LocalMailboxFolder(tmp_path)
    folder.makedirs("requests")
    assert folder.create("requests/a.json", b"first") is True
    assert folder.create("requests/a.json", b"second") is False
    assert folder.read("requests/a.json", 100) == b"first"
    (tmp_path / "requests" / ".b.json.123.tmp").write_bytes(b"half")
    assert folder.names("requests") == ["a.json"] and folder.names("missing") == []
    folder.replace("requests/a.json", b"third")
    assert folder.read("requests/a.json", 100) == b"third"
    folder.remove("requests/a.json")
    folder.remove("requests/a.json")  # missing is fine
    assert folder.read("requests/a.json", 100) is None
    with pytest.raises(ValueError):
        folder.read("../outside", 10)


def test_a_link_a_fifo_and_a_file_over_the_limit_are_refused_unread(tmp_path):
    folder = LocalMailboxFolder(tmp_path)
    (tmp_path / "secret").write_bytes(b"s" * 10)
    os.symlink(tmp_path / "secret", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 101)
    for name, clause in (("link", "symbolic link"), ("fifo", "not a regular file"), ("big", "over the limit")):
        with pytest.raises(MailboxRefusal, match=clause):
            folder.read(name, 100)


def test_a_lease_is_held_by_one_server_and_taken_over_only_after_it_expires(tmp_path):
    box = Mailbox(LocalMailboxFolder(tmp_path), lease_seconds=0.5)
    box.prepare()
    first = box.take("r1", "server-a", "host")
    assert first is not None and first.generation == 1
    assert box.take("r1", "server-b", "host") is None  # held
    assert box.renew(first)
    time.sleep(0.6)
    second = box.take("r1", "server-b", "host")
    assert second is not None and second.generation == 2  # taken over with the next generation, nothing removed
    assert box.renew(first) is False  # the first holder learns it lost the request
    assert box.take("r1", "server-c", "host") is None
    box.release(second)
    assert box.take("r1", "server-c", "host").generation == 2  # released: the next server takes it at once


def test_two_servers_reaching_for_an_expired_lease_get_one_generation_between_them(tmp_path):
    box = Mailbox(LocalMailboxFolder(tmp_path), lease_seconds=0.01)
    box.prepare()
    box.take("r1", "dead", "host")
    time.sleep(0.05)
    won: list = []
    barrier = threading.Barrier(8)

    def reach(index: int) -> None:
        barrier.wait()
        won.append(Mailbox(LocalMailboxFolder(tmp_path), lease_seconds=60).take("r1", f"s{index}", "host"))

    threads = [threading.Thread(target=reach, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken = [lease for lease in won if lease is not None]
    assert len(taken) == 1 and taken[0].generation == 2


# -- the training side's checks ------------------------------------------------------------------------------

@pytest.fixture
def asking(tmp_path):
    """A decision asked in a real mailbox by the training side, waiting in a thread; ``result`` holds its answer."""
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    workspace = tmp_path / "runs" / "lock" / "arm" / "seed-1" / "agent" / "workspace"
    workspace.mkdir(parents=True)
    for name, text in PROGRAMS.items():
        (workspace / name).write_text(text)
    backend = MailboxBackend(mailbox=str(mailbox), model="claude-haiku-4-5", seconds_per_decision=20.0,
                             queue_seconds=0.0)
    box = Mailbox(LocalMailboxFolder(mailbox))
    box.prepare()
    waiting = Asking(box, backend, workspace, "the message", {"decision": 3})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(answer=waiting.wait()), daemon=True)
    thread.start()
    while not box.requests():
        time.sleep(0.02)
    (request_id,) = box.requests()
    request, sha = box.request(request_id)
    yield box, request, sha, workspace, result, thread, mailbox


def _answer(asked, sha, **changes) -> MailboxAnswer:
    fields = dict(request=asked.request, run=asked.run, request_sha256=sha, server="s:1:x", host="login",
                  answered_at=time.time(), seconds=1.0,
                  answer={"rationale": "Changed: updater.py.", "programs": {**PROGRAMS,
                                                                            "updater.py": "# the real answer\n"}})
    return MailboxAnswer(**{**fields, **changes})


def _plant(path, data: bytes) -> None:
    """A file put in the answers folder whole (written aside, then renamed), as a remote side's would land: the
    training side reads it at once, never half written."""
    aside = path.with_name(f".{path.name}.planting")
    aside.write_bytes(data)
    os.replace(aside, path)


def _refused(path) -> None:
    """Wait until the training side has removed a hostile answer (it refused it)."""
    deadline = time.monotonic() + 10
    while os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.lexists(path), "the hostile answer was not removed"


def test_the_request_names_its_run_its_deadline_and_the_answering_backend_never_a_key(asking, monkeypatch):
    box, request, _, _, _, _, _ = asking
    assert request.decision == 3 and request.label == "lock/arm/seed-1" and request.request.startswith("lock-arm")
    assert request.deadline - request.asked_at == pytest.approx(20.0)
    assert request.backend["backend"] == "anthropic" and request.backend["options"]["model"] == "claude-haiku-4-5"
    assert request.programs == PROGRAMS and request.message == "the message"
    assert not {"api_key", "base_url"} & set(request.backend["options"])


@pytest.mark.parametrize("hostile", ["another request", "another run", "stale", "symlink", "oversized",
                                     "malformed", "no programs", "program too large"])
def test_a_hostile_answer_is_refused_recorded_and_removed_and_the_real_one_is_taken(asking, hostile, tmp_path):
    box, request, sha, workspace, result, thread, mailbox = asking
    path = mailbox / "answers" / f"{request.request}.json"
    if hostile == "another request":
        _plant(path, encoded(_answer(request, sha, request="lock-arm-seed-1-d002-000000000000")))
    elif hostile == "another run":
        box.answer(_answer(request, sha, run="0123456789abcdef"))
    elif hostile == "stale":
        box.answer(_answer(request, "0" * 64))
    elif hostile == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_bytes(encoded(_answer(request, sha)))
        os.symlink(elsewhere, path)
    elif hostile == "oversized":
        _plant(path, b" " * (ANSWER_MAX_BYTES + 1))
    elif hostile == "malformed":
        _plant(path, b'{"request": "not an answer"}')
    elif hostile == "no programs":
        box.answer(_answer(request, sha, answer={"rationale": "nothing"}))
    else:
        box.answer(_answer(request, sha, answer={"rationale": "big", "programs": {**PROGRAMS, "updater.py":
                                                                                 "#" * 1_000_001}}))
    _refused(path)
    assert thread.is_alive(), "a refused answer does not end the wait"
    box.answer(_answer(request, sha))
    thread.join(timeout=10)
    answer = result["answer"]
    assert answer.failed is None and (workspace / "updater.py").read_text() == "# the real answer\n"
    (refusal,) = answer.remote["refused"]
    assert answer.remote["server"] == "s:1:x" and answer.remote["host"] == "login"
    assert answer.remote["round_trip_seconds"] > 0
    assert any(event.get("event") == "mailbox" and event["refused"] for event in answer.transcript)
    words = {"another request": "names request", "another run": "names run", "stale": "another request's bytes",
             "symlink": "symbolic link", "oversized": "over the limit", "malformed": "lacks",
             "no programs": "carries no programs", "program too large": "over 1000000 bytes"}[hostile]
    assert words in refusal["refused"], refusal
    assert box.requests() == [] and not box.answered(request.request)  # withdrawn once answered


def test_no_answer_by_the_deadline_fails_the_decision_and_withdraws_the_request(tmp_path):
    mailbox = tmp_path / "mailbox"
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    for name, text in PROGRAMS.items():
        (workspace / name).write_text(text)
    backend = MailboxBackend(mailbox=str(mailbox), seconds_per_decision=0.3, queue_seconds=0.0)
    answer = backend.decide(workspace, "message", {"decision": 1})
    assert answer.failed.startswith("no server answered request") and "opalctl agent serve" in answer.failed
    box = Mailbox(LocalMailboxFolder(mailbox))
    assert box.requests() == []
    late = _answer(type("R", (), {"request": "x", "run": "y"})(), "z")
    assert box.answer(late)  # a late answer lands in no one's hands: its request is gone, the sweep removes it
    assert box.sweep(time.time(), 0.0) == [] and box.folder.names("answers") == []


def test_a_program_from_the_mailbox_that_fails_the_load_check_is_not_applied_and_is_recorded(tmp_path, opal):
    """A training loop wrapped with the mailbox backend (the real agent host and worker); a thread in the place of
    the server answers with an updater that imports what no program may: the load check refuses it, as it refuses
    a local backend's, and the host's record says where the answer came from."""
    from opalctl.opal import wrap

    mailbox = tmp_path / "mailbox"
    box = Mailbox(LocalMailboxFolder(mailbox))
    box.prepare()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for request_id in box.requests():
                if not box.answered(request_id):
                    request, sha = box.request(request_id)
                    programs = {**request.programs, "updater.py": "import os\n" + request.programs["updater.py"]}
                    box.answer(_answer(request, sha, answer={"rationale": "Changed: updater.py.",
                                                             "programs": programs}))
            time.sleep(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    model = opal.make_model()
    run_dir = tmp_path / "opal"
    optimizer = wrap(opal.adamw(model), model, backend=MailboxBackend(mailbox=str(mailbox), seconds_per_decision=30.0,
                                                                      queue_seconds=0.0),
                     total_steps=40, decisions=1, schedule=[0.5], run_dir=run_dir, trial_steps=5)
    try:
        opal.train(model, optimizer, 40)
    finally:
        optimizer.close()
        stop.set()
    (failed,) = opal.of_kind(run_dir, "load_failed")
    assert failed["decision"] == 1 and "import of 'os' is not allowed" in failed["message"]
    assert not opal.of_kind(run_dir, "applied")
    record = json.loads((run_dir / "agent" / "decisions" / "001" / "answer.json").read_text())
    assert record["remote"]["server"] == "s:1:x" and record["remote"]["refused"] == []


def test_agent_serve_refuses_a_missing_folder_and_a_backend_that_cannot_answer_in_one_sentence(tmp_path, capsys):
    from opalctl.cli import main

    def serve(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["agent", "serve", *args])
        return exit_info.value.code, capsys.readouterr().err

    code, err = serve(str(tmp_path / "nowhere"), "--backend", "anthropic")
    assert code == 2 and "the mailbox folder" in err and "does not exist" in err and "Traceback" not in err
    code, err = serve(str(tmp_path), "--backend", "keep")
    assert code == 2 and "--backend 'keep' is no backend a mailbox can be answered by" in err
    code, err = serve(str(tmp_path), "--backend", "anthropic", "--max-concurrent", "0")
    assert code == 2 and "--max-concurrent" in err


def _posted(tmp_path, model: str) -> tuple:
    """A real mailbox in which the training side posted one decision asking for ``model``: (its folder, the
    ``Mailbox``, the ``Asking``)."""
    mailbox, workspace = tmp_path / "mailbox", tmp_path / "workspace"
    workspace.mkdir()
    for name, text in PROGRAMS.items():
        (workspace / name).write_text(text)
    box = Mailbox(LocalMailboxFolder(mailbox))
    box.prepare()
    asked = Asking(box, MailboxBackend(mailbox=str(mailbox), model=model, seconds_per_decision=60.0), workspace,
                   "Decide.", {"decision": 1})
    box.post(asked.request)
    return mailbox, box, asked


def test_a_server_leaves_a_request_for_another_model_to_another_server_and_takes_no_lease(tmp_path):
    from opalctl.opal.mailbox.serve import Server

    mailbox, box, asked = _posted(tmp_path, "claude-haiku-4-5")
    events: list = []
    server = Server(LocalMailboxFolder(mailbox), "anthropic", model="claude-opus-4-5", show=events.append)
    server.scan()
    server.scan()
    server.stop()
    (left,) = [event for event in events if event["event"] == "left"]
    assert left["request"] == asked.request.request and "model 'claude-haiku-4-5'" in left["why"]
    assert box.folder.names("leases") == [] and box.requests() == [asked.request.request]


class WithdrawnAfter(LocalMailboxFolder):
    """The server's view of a mailbox whose training side reads its answer and withdraws the request right after
    the server's ``after``-th folder operation (0: before the first)."""

    def __init__(self, root, after: int, request_id: str):
        super().__init__(root)
        self.after, self.request_id, self.operations, self.withdrawn = after, request_id, 0, False
        if after == 0:
            self.withdraw()

    def withdraw(self) -> None:
        Mailbox(LocalMailboxFolder(self.root)).withdraw(self.request_id)
        self.withdrawn = True

    def _counted(self, result):
        self.operations += 1
        if self.operations == self.after:
            self.withdraw()
        return result

    def names(self, sub):
        return self._counted(super().names(sub))

    def read(self, path, limit):
        return self._counted(super().read(path, limit))

    def create(self, path, data):
        return self._counted(super().create(path, data))

    def replace(self, path, data):
        return self._counted(super().replace(path, data))

    def remove(self, path):
        return self._counted(super().remove(path))


@pytest.mark.parametrize("after", range(8))
def test_a_request_the_server_answered_is_never_taken_again_however_its_withdrawal_interleaves(tmp_path, after):
    """A server that answered a request looks at it again while the training side reads the answer and withdraws
    the request (its answer, then its leases, after the request): whatever folder operation of the server's the
    withdrawal follows, the request is not taken, so never worked (and paid) twice. Reading the request before
    looking for its answer once found a request that was there and, a moment later, no answer (the withdrawal
    between the two): a run answered over ssh under load sent 6 requests to the Messages API for its 4."""
    from opalctl.opal.mailbox.serve import Server

    mailbox, box, asked = _posted(tmp_path, "claude-opus-4-5")
    _, sha = box.request(asked.request.request)
    assert box.answer(_answer(asked.request, sha))  # answered by this server, its lease released
    events: list = []
    folder = WithdrawnAfter(mailbox, after, asked.request.request)
    server = Server(folder, "anthropic", show=events.append)
    server.consider(asked.request.request)
    server.stop()
    assert [event["event"] for event in events] == ["stopped"]
    if not folder.withdrawn:  # the server had done with it first
        folder.withdraw()
    assert box.requests() == [] and box.folder.names("answers") == [] and box.folder.names("leases") == []


@pytest.mark.parametrize("random_part", ["0320972d8e58", "d65c2f836ff5"])
def test_a_resumed_run_withdraws_the_request_its_killed_process_left_whatever_its_new_ids_random_part(
        tmp_path, monkeypatch, random_part):
    """The stale request of an earlier process of the run is found by the run's label: a new id whose random part
    starts with a ``d`` (1 resume in 16; seen in tests/driver/test_mailbox_run.py) once hid it, and both stayed."""
    import secrets

    mailbox, workspace = tmp_path / "mailbox", tmp_path / "runs" / "lock" / "arm" / "seed-1" / "agent" / "workspace"
    workspace.mkdir(parents=True)
    for name, text in PROGRAMS.items():
        (workspace / name).write_text(text)
    box = Mailbox(LocalMailboxFolder(mailbox))
    box.prepare()
    killed = Asking(box, MailboxBackend(mailbox=str(mailbox), model="claude-haiku-4-5"), workspace, "Decide.",
                    {"decision": 1})
    box.post(killed.request)  # the killed process's request, left behind
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: random_part)
    resumed = Asking(box, MailboxBackend(mailbox=str(mailbox), model="claude-haiku-4-5"), workspace, "Decide.",
                     {"decision": 1})
    assert resumed.request.request.endswith("-d001-" + random_part)
    resumed.withdraw_stale()
    assert resumed.withdrew == [killed.request.request] and box.requests() == []
