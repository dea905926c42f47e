"""Formal agent-arm runs whose decisions are answered by ``opalctl agent serve`` over a shared folder, over ssh,
and for a run started by ``opalctl grid --executor slurm``.

The same anthropic backend (the real SDK against the loopback Messages API of tests/opal/messages_server.py, which
answers each request from its content, so the same question always gets the same answer) answers a formal run of
the digits task in the run's own agent host (``backend: anthropic``): the module's reference, run once. The same
lock's mailbox arm (``backend: mailbox``) is then answered by a real ``python -m opalctl agent serve`` process,
whose environment alone holds the key and the server's address: with the mailbox as a folder it shares, with the
mailbox reached through a real loopback sshd (``--ssh HOST``, the ``sshd`` fixture of tests/conftest.py), and with
the run started as a task of the local Slurm by ``opalctl grid --executor slurm``. Blocking decisions: each time
the same programs are applied at the same updates and the final weights are the same as the reference's; the key is
in no file of the run or the mailbox; the run's records say where each decision was answered. A server killed
(SIGKILL) in the middle of a decision and started again answers the request once.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import string
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import support
from tests.support.cli import call_cli

UPDATES = 200


def _key() -> str:
    alphabet = string.ascii_letters + string.digits
    return "sk-ant-api03-" + "".join(secrets.choice(alphabet) for _ in range(40))


def _agent(backend: str, mailbox: Path | None = None) -> dict:
    agent = {"backend": backend, "model": "claude-opus-4-5", "decisions": 2, "schedule": [0.3, 0.6], "every": 25,
             "trial_steps": 5, "blocking": True}
    if mailbox is not None:
        agent.update(mailbox=str(mailbox), queue_seconds=60.0)
    return {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "agent": agent}


def _answering(hold: threading.Event | None = None):
    """The Messages API's answer to a request, from its content: a first turn writes the halved updater, a later
    one ends with the rationale. ``hold``: the first turn waits for it (a decision in the middle)."""
    ms = support.messages_server()

    def answer(body: dict) -> dict:
        if ms.last_tool_results(body):
            return ms.reply(ms.text(support.RATIONALE))
        if hold is not None:
            hold.wait(120)
        return ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": support.HALVED}))

    return answer


class Serving:
    """``python -m opalctl agent serve MAILBOX --backend anthropic --json`` with the key and the server's address;
    ``env``: more of its environment (``OPALCTL_SSH_CONFIG`` for ``--ssh``)."""

    def __init__(self, project, mailbox: Path, key: str, url: str, *more: str, env: dict[str, str] | None = None):
        env = project.env(ANTHROPIC_API_KEY=key, ANTHROPIC_BASE_URL=url, **(env or {}))
        self.process = subprocess.Popen(
            support.opalctl_command("agent", "serve", mailbox, "--backend", "anthropic", "--json", *more),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.events: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.events.append(json.loads(line))

    def wait_for(self, kind: str, seconds: float = 120) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = [event for event in self.events if event["event"] == kind]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"the server showed no {kind!r} event: {self.events}")

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=30)
        self.reader.join(timeout=5)
        return code, self.process.stderr.read()


def _applied(run_dir: Path) -> list[tuple[int, int, list]]:
    events = (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()
    return [(event["decision"], event["update"], event["files"]) for event in map(json.loads, events)
            if event["kind"] == "applied"]


def _programs(run_dir: Path) -> dict[str, str]:
    folder = run_dir / "training" / "opal" / "programs"
    return {str(path.relative_to(folder)): path.read_text() for path in sorted(folder.rglob("*.py"))}


def _posted(requests: Path) -> list[str]:
    """The requests posted in a mailbox's requests folder: not a '.' file, which is one still being written."""
    return sorted(name for name in os.listdir(requests) if not name.startswith("."))


def _pieces(key: str) -> list[bytes]:
    return [key[i:i + 8].encode() for i in range(len(key) - 7)]


def _weights(run_dir: Path) -> list[str]:
    return [stage["checkpoint"]["model_sha256"] for stage in support.stage_files(run_dir)]


@dataclass
class Reference:
    """The module's lock (arms ``local``: anthropic in the run's agent host; ``remote``: the same through the
    mailbox folder), the key the servers hold, and the local arm's finished run (the reference)."""

    project: object
    mailbox: Path
    key: str
    local_dir: Path
    requests: int  # the Messages API requests the local run made


@pytest.fixture(scope="module")
def reference(digits_template, tmp_path_factory) -> Reference:
    ms = support.messages_server()
    folder = tmp_path_factory.mktemp("mailbox-run")
    mailbox = folder / "mailbox"
    mailbox.mkdir()
    key = _key()
    with pytest.MonkeyPatch.context() as monkeypatch:
        project = support.Project(digits_template, folder / "project", monkeypatch)
        project.freeze(budget={"clock": "updates", "amount": UPDATES},
                       arms={"local": _agent("anthropic"), "remote": _agent("mailbox", mailbox)})
    with ms.MessagesServer([_answering()] * 8) as api:
        local = project.process(project.run_args("local", 1),
                                env=project.env(ANTHROPIC_API_KEY=key, ANTHROPIC_BASE_URL=api.url))
        requests = len(api.requests)
    assert local.returncode == 0, local.stderr[-3000:]
    local_dir = project.run_dir("local", 1)
    assert len(_applied(local_dir)) == 1 and requests == 4
    return Reference(project, mailbox, key, local_dir, requests)


def _same_as_the_reference(reference: Reference, remote_dir: Path) -> None:
    """The same programs applied at the same updates, the same final weights, as the local run's."""
    assert _applied(remote_dir) == _applied(reference.local_dir)
    assert _programs(remote_dir) == _programs(reference.local_dir)
    assert _weights(reference.local_dir) and _weights(remote_dir) == _weights(reference.local_dir)
    local_report, remote_report = support.read(reference.local_dir / "report.json"), support.read(remote_dir / "report.json")
    assert remote_report["final_model_sha256"] == local_report["final_model_sha256"]
    assert local_report["agent"]["decisions_applied"] == remote_report["agent"]["decisions_applied"] == 1
    assert remote_report["agent"]["decisions_kept"] == 1
    for number in (1, 2):  # where each decision was answered, and its round trip
        record = support.read(remote_dir / "agent" / "decisions" / f"{number:03d}" / "answer.json")
        assert record["remote"]["server"].startswith(record["remote"]["host"] + ":")
        assert record["remote"]["round_trip_seconds"] > 0 and record["remote"]["refused"] == []


def _key_nowhere(reference: Reference, *folders: Path) -> None:
    """The key is in no file of ``folders`` (every 8-character piece of it)."""
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert not any(piece in data for piece in _pieces(reference.key)), path


def _answered_through(reference: Reference, tmp_path: Path, start, *serve: str,
                      env: dict[str, str] | None = None) -> tuple[Path, Serving, object]:
    """The remote arm, started by ``start(runs)`` (a finished CompletedProcess), while ``agent serve MAILBOX
    SERVE...`` answers it from the loopback Messages API: (the run folder, the stopped server, the API)."""
    ms, project = support.messages_server(), reference.project
    runs = tmp_path / "runs"
    with ms.MessagesServer([_answering()] * 8) as api:
        server = Serving(project, reference.mailbox, reference.key, api.url, *serve, env=env)
        try:
            finished = start(runs)
        except subprocess.TimeoutExpired:
            finished = None
        finally:
            code, err = server.stop()
    assert finished is not None, f"the run did not finish; the server showed {server.events}, said {err[-3000:]}"
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert code == 0 and "Traceback" not in err, err
    assert len(api.requests) == reference.requests
    assert [event["decision"] for event in server.events if event["event"] == "answered"] == [1, 2]
    assert sorted(os.listdir(reference.mailbox / "requests")) == []
    assert sorted(os.listdir(reference.mailbox / "answers")) == []
    return project.run_dir("remote", 1, runs), server, api


def _plain_run(reference: Reference):
    project = reference.project
    return lambda runs: project.process(project.run_args("remote", 1, runs=runs), env=project.env())  # no key


def test_a_run_answered_through_the_mailbox_matches_the_same_backend_answering_locally(reference, tmp_path):
    lock = json.loads(reference.project.lock.read_text())
    remote_agent = lock["protocol"]["arms"]["remote"]["agent"]
    assert remote_agent["backend"] == "mailbox" and remote_agent["answered_by"] == "anthropic"
    assert remote_agent["model"] == "claude-opus-4-5" and remote_agent["mailbox"] == str(reference.mailbox)
    assert "mailbox" not in lock["protocol"]["arms"]["local"]["agent"]  # another arm's lock is as it was

    remote_dir, server, _ = _answered_through(reference, tmp_path, _plain_run(reference))
    _same_as_the_reference(reference, remote_dir)
    show = call_cli("show", remote_dir, "--json")
    assert show.code == 0, show.stderr
    for decision in show.json()["decisions"]:
        assert decision["answered_by"].startswith("opalctl agent serve on ") and decision["round_trip_seconds"] > 0
    _key_nowhere(reference, remote_dir, reference.mailbox)


def test_a_run_answered_over_ssh_matches_the_same_backend_answering_locally(reference, tmp_path, sshd):
    """``agent serve MAILBOX --ssh HOST``: the server reaches the run's mailbox through a real sshd (its ssh config
    from ``OPALCTL_SSH_CONFIG``, as a user's would come from ~/.ssh/config)."""
    remote_dir, server, _ = _answered_through(reference, tmp_path, _plain_run(reference), "--ssh", sshd.host,
                                              env={"OPALCTL_SSH_CONFIG": str(sshd.config)})
    assert server.wait_for("serving")["mailbox"] == f"{sshd.host}:{reference.mailbox}"
    _same_as_the_reference(reference, remote_dir)
    _key_nowhere(reference, remote_dir, reference.mailbox)


def _slurm_missing() -> str | None:
    """Why the local Slurm cannot run a job here (None: it can)."""
    if shutil.which("sbatch") is None:
        return "Slurm (sbatch); ci/slurm/setup.sh sets one up"
    listed = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30)
    if listed.returncode != 0 or not any(s.startswith(("idle", "mixed", "alloc")) for s in listed.stdout.split()):
        return "a running Slurm (sinfo lists no usable node); run ci/slurm/setup.sh"
    return None


def test_a_slurm_grid_task_answered_through_the_mailbox_matches_the_same_backend_answering_locally(reference, tmp_path):
    """``opalctl grid LOCK --executor slurm`` runs the remote arm as a Slurm job (the node has no key and no
    address of the API); ``agent serve`` answers its decisions over the shared folder."""
    missing = _slurm_missing()
    if missing:
        pytest.skip(f"needs a system component: {missing}")
    project = reference.project

    def grid(runs: Path) -> subprocess.CompletedProcess:
        return project.process(["grid", str(project.lock), "--arm", "remote", "--seed", "1", "--jobs", "1",
                                "--executor", "slurm", "--runs-dir", str(runs), "--json"], timeout=600)

    remote_dir, _, _ = _answered_through(reference, tmp_path, grid)
    report = support.read(remote_dir / "report.json")
    assert report["machine"]["slurm"]["job_id"], "trained in a Slurm job"
    _same_as_the_reference(reference, remote_dir)
    _key_nowhere(reference, remote_dir, reference.mailbox)


def test_a_server_killed_mid_decision_is_replaced_and_the_request_is_answered_once(project, tmp_path):
    ms = support.messages_server()
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    key = _key()
    agent = _agent("mailbox", mailbox)
    agent["agent"].update(decisions=1, schedule=[0.5])
    project.freeze(budget={"clock": "updates", "amount": UPDATES}, arms={"remote": agent})
    hold = threading.Event()
    with ms.MessagesServer([_answering(hold)] * 6) as api:
        first = Serving(project, mailbox, key, api.url, "--lease-seconds", "3")
        run = support.spawn(project, project.run_args("remote", 1))
        try:
            taken = first.wait_for("taken")
            while not api.requests:  # the decision is in the middle: its first turn is at the API
                time.sleep(0.05)
            os.killpg(first.process.pid, signal.SIGKILL)
            first.process.wait()
            second = Serving(project, mailbox, key, api.url, "--lease-seconds", "3")
            hold.set()
            again = second.wait_for("taken")
            answered = second.wait_for("answered")
            out, err = run.communicate(timeout=240)
        finally:
            hold.set()
            if run.poll() is None:
                run.kill()
            code, _ = second.stop()
    assert run.returncode == 0, err[-3000:]
    assert taken["request"] == again["request"] == answered["request"] and again["generation"] == 2
    run_dir = project.run_dir("remote", 1)
    assert [decision for decision, _, _ in _applied(run_dir)] == [1]
    record = support.read(run_dir / "agent" / "decisions" / "001" / "answer.json")
    assert record["remote"]["server"] == second.wait_for("serving")["server"] != first.wait_for("serving")["server"]
    assert record["remote"]["request"] == taken["request"]
    assert [event["event"] for event in second.events].count("answered") == 1


def test_a_training_job_killed_with_a_request_pending_and_resumed_applies_the_decision_once(project, tmp_path):
    ms = support.messages_server()
    mailbox = tmp_path / "mailbox"
    mailbox.mkdir()
    key = _key()
    agent = _agent("mailbox", mailbox)
    agent["agent"].update(decisions=1, schedule=[0.5])
    project.freeze(budget={"clock": "updates", "amount": UPDATES}, training={"checkpoint_every": 0.05},
                   arms={"remote": agent})
    requests = mailbox / "requests"
    run = support.spawn(project, project.run_args("remote", 1), new_session=True)
    deadline = time.monotonic() + 180
    while not (requests.is_dir() and _posted(requests)) and time.monotonic() < deadline:
        time.sleep(0.1)
    (old,) = _posted(requests)
    os.killpg(run.pid, signal.SIGKILL)  # no server yet: the request is pending
    run.communicate()
    time.sleep(1.0)
    assert _posted(requests) == [old], "the killed job's request is still there"

    with ms.MessagesServer([_answering()] * 4) as api:
        resumed = support.spawn(project, project.run_args("remote", 1, "--resume"))
        deadline = time.monotonic() + 180
        # until one request is there and it is not the old one (a listing taken while the resumed run withdraws the
        # old and posts the new may hold both for a moment; if both stayed, the unpacking below fails at the deadline)
        while not (len(_posted(requests)) == 1 and _posted(requests) != [old]) and time.monotonic() < deadline:
            time.sleep(0.1)
        (new,) = _posted(requests)  # the resumed run withdrew the old request and asked again
        server = Serving(project, mailbox, key, api.url)
        try:
            out, err = resumed.communicate(timeout=240)
        finally:
            if resumed.poll() is None:
                resumed.kill()
            server.stop()
    assert resumed.returncode == 0, err[-3000:]
    assert new != old
    run_dir = project.run_dir("remote", 1)
    assert [decision for decision, _, _ in _applied(run_dir)] == [1]
    assert support.read(run_dir / "report.json")["agent"]["decisions_applied"] == 1
    assert [event["request"] for event in server.events if event["event"] == "answered"] == [new[:-len(".json")]]
    record = support.read(run_dir / "agent" / "decisions" / "001" / "answer.json")
    assert record["remote"]["withdrew"] == [old[:-len(".json")]]
    assert len(api.requests) == 2


def test_ctrl_c_releases_the_lease_and_the_next_server_answers_at_once(project, tmp_path):
    from opalctl.opal.agents.mailbox import Asking, MailboxBackend
    from opalctl.opal.mailbox.box import Mailbox
    from opalctl.opal.mailbox.folder import LocalMailboxFolder
    from opalctl.opal.optimizer import default_sources

    ms = support.messages_server()
    mailbox, workspace = tmp_path / "mailbox", tmp_path / "runs" / "l" / "a" / "seed-1" / "agent" / "workspace"
    workspace.mkdir(parents=True)
    for name, text in default_sources().items():
        (workspace / name).write_text(text)
    box = Mailbox(LocalMailboxFolder(mailbox))
    box.prepare()
    backend = MailboxBackend(mailbox=str(mailbox), model="claude-opus-4-5", seconds_per_decision=120.0)
    asked = Asking(box, backend, workspace, "Decide.", {"decision": 1})
    box.post(asked.request)
    key, hold = _key(), threading.Event()
    with ms.MessagesServer([_answering(hold)] * 6) as api:
        first = Serving(project, mailbox, key, api.url, "--lease-seconds", "600")
        try:
            first.wait_for("taken")
            while not api.requests:
                time.sleep(0.05)
            code, err = first.stop()  # Ctrl-C in the middle of the decision
            assert code == 0 and "Traceback" not in err, err
            assert first.wait_for("stopped")["released"] == [asked.request.request]
            assert os.listdir(mailbox / "leases") == [] and os.listdir(mailbox / "answers") == []
            hold.set()
            second = Serving(project, mailbox, key, api.url, "--lease-seconds", "600")
            started = time.monotonic()
            taken = second.wait_for("taken", 30)
            answered = second.wait_for("answered")
        finally:
            hold.set()
            if first.process.poll() is None:
                first.process.kill()
        second.stop()
    assert time.monotonic() - started < 60, "taken at once, not after the 600 s lease"
    assert taken["generation"] == 1 and answered["request"] == asked.request.request and answered["failed"] is None
    (name,) = os.listdir(mailbox / "answers")
    answer = json.loads((mailbox / "answers" / name).read_text())
    assert answer["answer"]["programs"]["updater.py"] == support.HALVED and answer["server"] != first.events[0]["server"]


def test_a_mailbox_arm_whose_folder_is_missing_is_refused_before_any_work_and_needs_no_key(project, monkeypatch,
                                                                                           tmp_path):
    from opalctl.errors import BadInput

    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    missing = tmp_path / "no-mailbox"
    project.freeze(budget={"clock": "updates", "amount": UPDATES}, arms={"remote": _agent("mailbox", missing)})
    with pytest.raises(BadInput, match=f"the mailbox folder {missing} does not exist"):
        project.run("remote", 1)
    assert not project.run_dir("remote", 1).exists()
