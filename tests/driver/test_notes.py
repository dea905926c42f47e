"""``opalctl say``: a note a person leaves for the agent of a running arm (opalctl/opal/notes.py).

A real ``opalctl run`` of an agent arm (digits, 300 updates, the anthropic backend against the loopback Messages
server, two decisions) whose protocol allows notes: while the server holds the first decision, the test leaves a
note with the real command. The second decision's message carries it (the first's does not), the training
process's ``requested`` event of decision 2 names it (who, when), the agent host's record of decision 2 holds it,
and compare and the report page flag the arm. ``say`` on the finished run is refused (exit 2), and a protocol
without the key freezes to a lock without it.
"""

from __future__ import annotations

import getpass
import json
import os
import socket

from opalctl.formats import read_jsonl
from tests import support
from tests.support.cli import call_cli

UPDATES = 300
NOTE = "The loss plateaued near 0.3 last time with this setup; try a lower learning rate late. (said 'twice')"


def _agent(**more) -> dict:
    return {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
            "agent": {"backend": "anthropic", "model": "claude-opus-5-5", "decisions": 2, "schedule": [0.3, 0.7],
                      "every": 25, "trial_steps": 5, **more}}


def _first_message(body: dict) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else "".join(block.get("text", "") for block in content)


def test_a_note_left_mid_run_is_shown_at_the_next_decision_recorded_and_flagged(project):
    project.freeze(budget={"clock": "updates", "amount": UPDATES},
                   arms={"adamw": support.ADAMW, "agent": _agent(notes="allowed")})
    resolved = json.loads(project.lock.read_text())["protocol"]["arms"]
    assert resolved["agent"]["agent"]["notes"] == "allowed"
    project.run("adamw", 1)
    run_dir = project.run_dir("agent", 1)
    said: dict = {}

    def leave_note_then_answer(body):
        # the first decision is pending (blocking: training waits for it): a person leaves a note now, with the
        # command in a process of its own
        said["say"] = project.process(["say", str(run_dir), NOTE, "--json"], timeout=120)
        return ms.reply(ms.text("Observed: the loss falls.\nKept: the programs as they are."))

    ms = support.messages_server()
    script = [leave_note_then_answer, ms.reply(ms.text("Observed: a note.\nKept: the programs as they are."))]
    with ms.MessagesServer(script) as server:
        env = project.env(ANTHROPIC_API_KEY="sk-ant-api03-" + "n" * 40, ANTHROPIC_BASE_URL=server.url)
        result = project.process(project.run_args("agent", 1), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert said["say"].returncode == 0, said["say"].stderr
    note = json.loads(said["say"].stdout)
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    assert note["note"] == 1 and note["who"] == who and note["text"] == NOTE
    assert os.path.basename(note["path"]) == "001.json"

    # the message: decision 2's carries the note, decision 1's does not
    first, second = (_first_message(body) for body in server.bodies)
    assert NOTE not in first and "Notes from a person" not in first
    assert f"- note 1, from {who} at {note['at']}: {NOTE}" in second

    # the records: which decision saw it, who left it and when
    events = list(read_jsonl(run_dir / "training" / "opal" / "events.jsonl"))
    requested = {e["decision"]: e for e in events if e["kind"] == "requested"}
    assert "notes" not in requested[1]
    assert requested[2]["notes"] == [{"note": 1, "who": who, "at": note["at"]}]
    host_record = run_dir / "agent" / "decisions" / "002"
    assert any(NOTE in path.read_text() for path in host_record.iterdir() if path.is_file())
    assert not any(NOTE in path.read_text() for path in (run_dir / "agent" / "decisions" / "001").iterdir()
                   if path.is_file())

    shown = call_cli("show", run_dir)
    assert shown.code == 0, shown.stderr
    assert f"decision 2 was shown note 1 from {who} ({note['at']})" in shown.stderr
    assert "decision 1 was shown" not in shown.stderr

    # a finished run takes no note
    late = call_cli("say", run_dir, "too late")
    assert late.code == 2, late.stderr
    assert "is finished" in late.stderr and late.stderr.count("\n") == 1
    assert sorted(os.listdir(run_dir / "notes")) == [".lock", "001.json"]

    # compare and the report mark the arm that received notes
    compared = call_cli("compare", project.lock, "--runs-dir", project.runs, "--json")
    assert compared.code == 0, compared.stderr
    arms = {arm["arm"]: arm for arm in json.loads(compared.stdout)["arms"]}
    flag = "a person left 1 note(s) for the agent on seed 1 (1 shown at a decision)"
    assert any(f.startswith(flag) for f in arms["agent"]["flags"]), arms["agent"]["flags"]
    assert arms["agent"]["notes"] == {"1": {"left": 1, "shown": 1}}
    assert arms["adamw"]["notes"] == {} and not any("note" in f for f in arms["adamw"]["flags"])
    reported = call_cli("report", project.lock, "--runs-dir", project.runs)
    assert reported.code == 0, reported.stderr
    assert flag in (project.base / "report.html").read_text()


def test_a_protocol_without_the_key_resolves_as_before(project):
    lock = project.freeze(budget={"clock": "updates", "amount": UPDATES}, arms={"agent": _agent()})
    digest = support.sha256_of(lock)
    agent = json.loads(lock.read_text())["protocol"]["arms"]["agent"]["agent"]
    assert "notes" not in agent  # no key: the lock's bytes, and so its digest, are those of before notes
    verified = call_cli("verify", lock)
    assert verified.code == 0, verified.stderr
    allowed = project.freeze(budget={"clock": "updates", "amount": UPDATES}, arms={"agent": _agent(notes="allowed")})
    assert support.sha256_of(allowed) != digest
