"""The agent host: every decision whose work runs agent-authored code or talks to the network runs in a worker
process of a host started with the agent optimizer, with a time limit, never in the training process; and the host
trusts nothing on its pipe.

- the dry-run attack: a program that patches ``torch.Tensor.sum`` when it is merely checked, after which the agent
  writes the original file back and answers "Kept", leaves the training process's torch untouched;
- the training process holds no key while the agent works (the host does), and gets none back at ``close()``;
- a decide request that names another folder (the seed's anchors, the protocol's folder holding a sealed split, an
  unrelated folder of 80 files) is refused and recorded, and nothing there is read, written or deleted; the dry run
  of a program reads nothing outside the host's own workspace;
- no request returns a key: an ``environment`` request, and any other the host does not know, is refused, and the
  host goes on answering;
- a workspace replaced by a link after the host started is never worked in;
- each decision is recorded by the host as it saw it (the request, the answer, the programs and their sha256);
- a decision that hangs is killed at its limit and fails, and the host answers the next;
- a program that hangs in its dry run is stopped and the agent reads why;
- the host dying is one failed decision with a sentence, and training goes on.

The attacks speak to a host process directly, one JSON line at a time, as code with arbitrary execution in the
training process would (``RawHost``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from opalctl.formats import WorkerQuestion
from opalctl.opal import wrap
from opalctl.opal.agents.anthropic import AnthropicBackend
from opalctl.opal.agents.host import AgentHost, Workers, serve
from opalctl.sandbox import _landlock_abi

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."
PATCH = ("\n\ndef _everything_is_zero(self, *args, **kwargs):\n    return torch.zeros((), dtype=self.dtype)\n\n\n"
         "torch.Tensor.sum = _everything_is_zero\n")
FACTS = {"progress": 0.6, "reason": "scheduled", "decision": 1}


@pytest.fixture
def key(monkeypatch):
    secret = uuid.uuid4().hex + uuid.uuid4().hex
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    return secret


def anthropic(server, **options) -> AnthropicBackend:
    return AnthropicBackend(model="claude-opus-5-5", base_url=server.url, **options)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time."""
    return {path.relative_to(folder).as_posix(): (path.read_bytes(), path.stat().st_mtime_ns)
            for path in sorted(folder.rglob("*")) if path.is_file()}


class RawHost:
    """An agent host process spoken to line by line, as code with arbitrary execution in the training process can."""

    def __init__(self, tmp_path: Path, recipe: dict, env: dict | None = None):
        self.workspace, self.records = tmp_path / "agent" / "workspace", tmp_path / "agent"
        self.process = subprocess.Popen([sys.executable, "-m", "opalctl.opal.agents.host"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        self.send({"op": "start", "recipe": recipe, "workspace": str(self.workspace), "records": str(self.records),
                   "limit": 60.0, "secrets": []})

    def send(self, request) -> None:
        line = request if isinstance(request, str) else json.dumps(request)
        self.process.stdin.write((line + "\n").encode())
        self.process.stdin.flush()

    def reply(self, seconds: float = 90.0) -> dict | None:
        try:
            return json.loads(self.lines.get(timeout=seconds))
        except queue.Empty:
            return None

    def decide(self, number: int, sources: dict[str, str], **more) -> None:
        self.send({"op": "decide", "id": number, "message": "# Decision", "facts": {**FACTS, "decision": number},
                   "programs": sources, **more})

    def refusals(self) -> list[dict]:
        path = self.records / "refused.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# -- what the host does for the training process -------------------------------------------------------------------

START = {"op": "start", "recipe": {"backend": "keep", "options": {}}, "limit": 60.0, "secrets": []}


@pytest.mark.parametrize(("start", "said"), [
    ({**START, "workspace": "/tmp/w"}, "the agent host's start lacks records"),
    ({**START, "workspace": "/tmp/w", "records": "/tmp/r", "limit": "60"}, "holds a value of the wrong type in limit"),
    ({**START, "workspace": "/tmp/w", "records": "/tmp/r", "secrets": "k"},
     "holds a value of the wrong type in secrets"),
    ({**START, "workspace": "w", "records": "/tmp/r"}, "the start names no workspace folder as an absolute path"),
    ({**START, "workspace": "/tmp/w", "records": "/tmp/r", "limit": 0}, "the start gives no time limit"),
    ({**START, "op": "decide", "workspace": "/tmp/w", "records": "/tmp/r"}, "its first line is not a start request"),
])
def test_a_host_whose_start_is_not_a_start_record_ends_at_once_saying_why(tmp_path, capsys, start, said):
    """The host's first line is read as ``formats.HostStart``: a start that is not one ends the host with exit 2
    and one sentence, and nothing is made."""
    for key in ("workspace", "records"):
        if isinstance(start.get(key), str):
            start[key] = start[key].replace("/tmp", str(tmp_path))
    replies = io.BytesIO()
    assert serve(io.BytesIO((json.dumps(start) + "\n").encode()), replies) == 2
    error = capsys.readouterr().err
    assert said in error and error.count("\n") == 1 and "Traceback" not in error
    assert replies.getvalue() == b"" and list(tmp_path.iterdir()) == []


def test_the_dry_run_attack_leaves_the_training_process_torch_untouched(opal, run_dir, key):
    original = torch.Tensor.sum
    source = opal.default_sources()["updater.py"]
    script = [ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": source + PATCH})),
              ms.reply(ms.tool_use("check_programs", {})),
              ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": source})),
              ms.reply(ms.text(KEPT))]
    seen_during_run = {}
    with ms.MessagesServer(script) as server:
        model = opal.make_model()
        optimizer = wrap(opal.adamw(model), model, backend=anthropic(server), decisions=1, schedule=[0.5],
                         total_steps=20, run_dir=run_dir)
        seen_during_run["key"] = os.environ.get("ANTHROPIC_API_KEY")
        opal.train(model, optimizer, 20)
        optimizer.close()
    assert len(server.requests) == 4, "the whole decision ran, in the host"
    (checked,) = ms.last_tool_results(server.bodies[2])
    assert checked["content"], "the check answered"
    assert torch.Tensor.sum is original and float(torch.ones(3).sum()) == 3.0
    assert [e["kind"] for e in opal.of_kind(run_dir, "kept", "applied", "load_failed")] == ["kept"]
    assert sorted(p.name for p in (run_dir / "programs").iterdir()) == ["v000"]
    # the key was the host's alone while the agent worked, and it does not come back when the agent is done
    assert seen_during_run["key"] is None and "ANTHROPIC_API_KEY" not in os.environ
    assert all(key in r["headers"].get("x-api-key", "") + r["headers"].get("authorization", "")
               for r in server.requests)


def test_after_close_the_training_process_environment_holds_no_key(opal, run_dir, monkeypatch):
    secret = "sk-ant-api03-" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.setenv("GH_TOKEN", uuid.uuid4().hex)
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", decisions=1, schedule=[0.5], total_steps=20,
                     run_dir=run_dir)
    opal.train(model, optimizer, 20)
    optimizer.close()
    assert "ANTHROPIC_API_KEY" not in os.environ and "GH_TOKEN" not in os.environ
    assert secret not in repr(dict(os.environ))


def test_the_host_records_each_decision_as_it_saw_it(opal, run_dir):
    from opalctl.opal.records import DecisionRecord, program_sha256

    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", decisions=1, schedule=[0.6], total_steps=100,
                     run_dir=run_dir)
    opal.train(model, optimizer, 100)
    optimizer.close()
    (applied,) = opal.of_kind(run_dir, "applied")
    folder = run_dir / "agent" / "decisions" / "001"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "analysis.py", "answer.json", "facts.json", "message.md", "response.md", "running/analysis.py",
        "running/updater.py", "transcript.json", "updater.py"]
    record = DecisionRecord(folder)
    answer = record.answer()
    assert answer.decision == 1 and answer.backend == "heuristic" and answer.failed is None and answer.seconds > 0
    assert record.running() == opal.default_sources()
    answered = record.answered()
    assert answered["updater.py"] == (run_dir / "programs" / "v001" / "updater.py").read_text()
    assert answer.programs == {name: program_sha256(text) for name, text in answered.items()}
    assert json.loads((folder / "facts.json").read_text())["decision"] == 1
    assert record.rationale.splitlines()[0] == applied["rationale"]
    # the training process keeps its account of the outcome, not the texts the host records
    assert sorted(p.name for p in (run_dir / "decisions" / "001").iterdir()) == ["meta.json"]
    meta = json.loads((run_dir / "decisions" / "001" / "meta.json").read_text())
    assert meta["outcome"] == "applied" and meta["programs_sha256"] == answer.programs


# -- requests the host refuses ---------------------------------------------------------------------------------------

def _anchors(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "runs" / "digits-0123456789ab" / "anchors" / "seed-1"
    folder.mkdir(parents=True)
    (folder / "anchor.json").write_text(json.dumps({"metrics": {"correct": 281}, "sha256": "0" * 64}))
    return folder, "anchor.json"


def _protocol(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "protocol"
    folder.mkdir()
    (folder / "digits.yaml").write_text("name: digits\n")
    (folder / "final-test.sealed.npz").write_text(f"SEALED-{uuid.uuid4().hex}")
    return folder, "final-test.sealed.npz"


def _unrelated(tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "photos"
    folder.mkdir()
    for index in range(80):
        (folder / f"img{index:03d}.txt").write_text(f"picture {index}\n")
    return folder, "img000.txt"


@pytest.mark.parametrize("target", [_anchors, _protocol, _unrelated], ids=["anchors", "protocol", "unrelated"])
def test_a_request_naming_another_folder_is_refused_and_nothing_there_is_touched(opal, tmp_path, key, target):
    folder, name = target(tmp_path)
    before = snapshot(folder)
    # what an agent would do there: read a file, rewrite it, check the programs (the sweep follows each decision)
    script = [ms.reply(ms.tool_use("read_file", {"path": name}),
                       ms.tool_use("write_file", {"path": name, "content": "forged"}),
                       ms.tool_use("check_programs", {})),
              ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        host = RawHost(tmp_path, anthropic(server).recipe())
        try:
            host.decide(1, opal.default_sources(), workspace=str(folder), seconds=60.0)
            reply = host.reply()
        finally:
            host.close()
    assert reply is not None and reply["id"] == 1 and "answer" not in reply
    assert "'workspace'" in reply["refused"] and "takes no path" in reply["refused"]
    assert server.requests == [], "the agent was never asked"
    assert snapshot(folder) == before, "nothing there was written or deleted"
    (refusal,) = host.refusals()
    assert refusal["id"] == 1 and "workspace" in refusal["keys"] and str(folder) not in json.dumps(refusal)
    assert not list((host.records / "decisions").iterdir()), "no decision was worked"


SITECUSTOMIZE = '''
import os
import sys

# arbitrary execution inside the dry run's child, after it is confined: the check of a program reads a file
if sys.orig_argv[1:3] == ["-m", "opalctl.opal.agents.dry_run"]:
    import opalctl.opal.programs as programs

    def _reads_the_sealed_split(name, source, *, label=""):
        try:
            with open(os.environ["PROBE_SEALED"], encoding="utf-8") as handle:
                raise programs.ProgramRejected("PROBE READ " + handle.read())
        except OSError as error:
            raise programs.ProgramRejected("PROBE " + type(error).__name__) from None

    programs.check_program = _reads_the_sealed_split
'''


def test_the_dry_run_reads_nothing_outside_the_hosts_own_workspace(opal, tmp_path, key):
    protocol, sealed = _protocol(tmp_path)
    secret_split = (protocol / sealed).read_text()
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]),
           "PROBE_SEALED": str(protocol / sealed)}
    script = [ms.reply(ms.tool_use("check_programs", {}), ms.tool_use("read_file", {"path": f"../{sealed}"}),
                       ms.tool_use("read_file", {"path": str(protocol / sealed)})),
              ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        host = RawHost(tmp_path, anthropic(server).recipe(), env=env)
        try:
            host.decide(1, opal.default_sources(), workspace=str(protocol), seconds=60.0)  # refused
            first = host.reply()
            host.decide(2, opal.default_sources())  # worked in the host's own workspace
            second = host.reply()
        finally:
            host.close()
    assert "refused" in first and second["answer"]["failed"] is None
    assert len(server.requests) == 2 and secret_split not in json.dumps(server.bodies)
    checked, *reads = ms.last_tool_results(server.bodies[1])
    assert all(result["is_error"] for result in reads)
    if _landlock_abi()[0] is not None:  # the dry run's child is confined to what training reads and the workspace
        assert checked["content"].startswith("PROBE PermissionError"), checked["content"]


def test_no_request_returns_a_key_and_unknown_requests_do_not_stop_the_host(opal, tmp_path, key):
    host = RawHost(tmp_path, {"backend": "heuristic", "options": {}})
    try:
        host.send({"op": "environment", "id": 7})
        environment = host.reply(30)
        for line in ("not json", "[1, 2]", json.dumps({"op": 5, "id": 8}), json.dumps({"op": "start", "id": 9})):
            host.send(line)
        others = [host.reply(30), host.reply(30)]
        host.decide(1, opal.default_sources())
        answered = host.reply()
    finally:
        host.close()
    assert environment == {"id": 7, "refused": environment["refused"]} and "no key" in environment["refused"]
    assert key not in json.dumps([environment, others, answered])
    assert [reply["id"] for reply in others] == [8, 9]
    assert answered["id"] == 1 and answered["answer"]["failed"] is None, "the host goes on answering"
    assert [refusal["id"] for refusal in host.refusals()] == [7, None, None, 8, 9]


def test_decisions_are_worked_one_at_a_time_in_order(opal, tmp_path):
    host = RawHost(tmp_path, {"backend": "heuristic", "options": {}})
    sources = opal.default_sources()
    try:
        host.decide(2, sources)
        host.decide(3, sources)  # while 2 is worked
        replies = {reply["id"]: reply for reply in (host.reply(), host.reply())}
        host.decide(1, sources)  # below one already asked
        late = host.reply()
        host.decide(4, {"updater.py": sources["updater.py"]})  # a program missing
        partial = host.reply()
    finally:
        host.close()
    assert replies[2]["answer"]["failed"] is None
    assert "one decision at a time" in replies[3]["refused"]
    assert "asked once, in order" in late["refused"] and "programs" in partial["refused"]
    assert [path.name for path in (host.records / "decisions").iterdir()] == ["002"]


def test_a_workspace_replaced_by_a_link_after_the_start_is_never_worked_in(opal, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine\n")
    host = RawHost(tmp_path, {"backend": "heuristic", "options": {}})
    try:
        host.decide(1, opal.default_sources())
        assert host.reply()["answer"]["failed"] is None
        moved = host.workspace.with_name("moved")
        host.workspace.rename(moved)
        host.workspace.symlink_to(victim)
        host.decide(2, opal.default_sources())
        answer = host.reply()["answer"]
    finally:
        host.close()
    assert "no longer the folder it was when the host started" in answer["failed"]
    assert answer["programs"] is None
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"], "nothing was written through the link"


# -- time limits and a dying host --------------------------------------------------------------------------------------

def test_a_program_that_hangs_in_its_dry_run_is_stopped_and_the_agent_reads_why(opal, run_dir, key):
    source = opal.default_sources()["updater.py"]
    hanging = source.replace("def build(params, previous, spec):\n",
                             "def build(params, previous, spec):\n    while True:\n        pass\n", 1)
    assert hanging != source
    script = [ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": hanging}),
                       ms.tool_use("check_programs", {})),
              ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        model = opal.make_model()
        optimizer = wrap(opal.adamw(model), model, backend=anthropic(server, seconds_per_decision=4.0),
                         decisions=1, schedule=[0.5], total_steps=20, run_dir=run_dir)
        started = time.monotonic()
        opal.train(model, optimizer, 20)
        optimizer.close()
    assert time.monotonic() - started < 30
    outcomes = opal.of_kind(run_dir, "kept", "applied", "load_failed", "decision_failed")
    assert len(outcomes) == 1 and outcomes[0]["kind"] == "decision_failed"
    assert "limit of 4 s" in outcomes[0]["message"]
    transcript = json.loads((run_dir / "agent" / "decisions" / "001" / "transcript.json").read_text())
    (check,) = [t for t in transcript if t["event"] == "tool" and t["name"] == "check_programs"]
    assert check["is_error"] and "ran past its limit" in check["result"]
    assert opal.of_kind(run_dir, "end"), "training went on to the end"


@contextlib.contextmanager
def host_whose_first_decision_hangs(tmp_path: Path, limit: float):
    """An agent host on the loopback Messages server, whose first request is answered after 60 s and the next at
    once (KEPT); yields the host and the server, and stops the host."""
    def never_in_time(body):
        time.sleep(60)
        return ms.reply(ms.text(KEPT))

    with ms.MessagesServer([never_in_time, ms.reply(ms.text(KEPT))]) as server:
        host = AgentHost(anthropic(server).recipe(), workspace=tmp_path / "agent" / "workspace",
                         records=tmp_path / "agent", limit=limit)
        try:
            yield host, server
        finally:
            host.stop()


def test_a_decision_that_hangs_is_killed_at_its_limit_and_the_host_answers_the_next(tmp_path, opal, key):
    sources = opal.default_sources()
    with host_whose_first_decision_hangs(tmp_path, limit=5.0) as (host, _):
        started = time.monotonic()
        host.ask(1, "message", FACTS, sources)
        answer = host.answer(1, wait=True, seconds=5.0)
        elapsed = time.monotonic() - started
        assert answer.failed and "ran past its limit of 5 s" in answer.failed
        assert 5.0 <= elapsed < 15.0
        host.ask(2, "message", {**FACTS, "decision": 2}, sources)
        second = host.answer(2, wait=True, seconds=5.0)
        assert second.failed is None and second.rationale == KEPT and second.programs == sources
    assert host.process.poll() is not None
    assert [p.name for p in sorted((tmp_path / "agent" / "decisions").iterdir())] == ["001", "002"]


def test_a_cancelled_decision_is_stopped_unanswered_and_the_host_answers_the_next(tmp_path, opal, key):
    """``cancel`` (``formats.HostCancel``) kills the decision's worker long before its limit, no reply comes for
    it, and the next decision is worked as soon as the host is free (a host still busy refuses it, so the
    decision numbers go on until one is answered)."""
    sources = opal.default_sources()
    with host_whose_first_decision_hangs(tmp_path, limit=50.0) as (host, server):
        host.ask(1, "message", FACTS, sources)
        deadline = time.monotonic() + 30.0
        while not server.bodies and time.monotonic() < deadline:  # decision 1 is with the agent
            time.sleep(0.05)
        started = time.monotonic()
        host.cancel(1)
        number, answer = 1, None
        while answer is None or "still being worked on" in (answer.failed or ""):
            assert time.monotonic() - started < 20.0, "the cancelled decision still held the host"
            time.sleep(0.1)
            number += 1
            host.ask(number, "message", {**FACTS, "decision": number}, sources)
            answer = host.answer(number, wait=True, seconds=50.0)
        assert answer.failed is None and answer.rationale == KEPT
        assert host.answer(1, wait=False, seconds=50.0) is None  # no reply for the cancelled one


def test_the_host_dying_fails_one_decision_with_a_sentence_and_training_goes_on(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", decisions=2, schedule=[0.25, 0.75],
                     total_steps=40, run_dir=run_dir)
    opal.train(model, optimizer, 20)
    host = optimizer.decisions.agent.host
    os.killpg(host.process.pid, signal.SIGKILL)
    host.process.wait()
    opal.train(model, optimizer, 20, start=20)
    figures = optimizer.close()
    outcomes = opal.of_kind(run_dir, "kept", "applied", "load_failed", "decision_failed")
    assert [e["decision"] for e in outcomes] == [1, 2]
    assert outcomes[1]["kind"] == "decision_failed" and "agent host" in outcomes[1]["message"]
    assert figures["decisions_failed"] == 1 and opal.of_kind(run_dir, "end")
    assert optimizer.t == 40


def test_a_non_blocking_hosted_decision_abandoned_at_close_kills_its_worker(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", decisions=1, schedule=[0.5],
                     total_steps=20, run_dir=run_dir, blocking=False)
    opal.train(model, optimizer, 10)
    optimizer.between_updates()  # asks decision 1 in the background
    assert optimizer.decisions.state.inflight is not None
    optimizer.close(wait=False)
    assert opal.of_kind(run_dir, "abandoned")
    assert optimizer.decisions.agent.host.process.poll() is not None, "closing ends the host"


@pytest.mark.parametrize("remaining", [1, 0])
def test_a_worker_is_started_ahead_only_while_a_scheduled_decision_remains(tmp_path, remaining):
    workers = Workers("heuristic")
    try:
        first = workers.spare
        assert first is not None  # ahead of the first decision
        question = WorkerQuestion(recipe={"backend": "heuristic", "options": {}}, workspace=str(tmp_path),
                                  message="m", facts={**FACTS, "remaining": remaining}, carry={})
        workers.run(1, question, 60.0)
        assert first.poll() is not None  # it worked decision 1
        assert (workers.spare is not None) == (remaining > 0)
        if remaining == 0:  # a wake-up after the last one still gets a worker, started when it comes
            workers.run(2, replace(question, facts={**FACTS, "decision": 2, "remaining": 0}), 60.0)
            assert workers.spare is None and not workers.running
    finally:
        workers.stop()
