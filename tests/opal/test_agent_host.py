"""The agent host: every decision whose work runs agent-authored code or talks to the network runs in a worker
process of a host started with the agent optimizer, with a time limit, and never in the training process.

- the dry-run attack: a program that patches ``torch.Tensor.sum`` when it is merely checked, after which the agent
  writes the original file back and answers "Kept", leaves the training process's torch untouched;
- the training process holds no key while the agent works (the host does), and gets it back at the end;
- a decision that hangs is killed at its limit and fails, and the host goes on answering;
- a program that hangs in its dry run is stopped and the agent reads why;
- the host dying is one failed decision with a sentence, and training goes on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from opalctl.opal import wrap
from opalctl.opal.agents.anthropic import AnthropicBackend
from opalctl.opal.agents.host import AgentHost

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."
PATCH = ("\n\ndef _everything_is_zero(self, *args, **kwargs):\n    return torch.zeros((), dtype=self.dtype)\n\n\n"
         "torch.Tensor.sum = _everything_is_zero\n")


@pytest.fixture
def key(monkeypatch):
    secret = uuid.uuid4().hex + uuid.uuid4().hex
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    return secret


def anthropic(server, **options) -> AnthropicBackend:
    return AnthropicBackend(model="claude-opus-5-5", base_url=server.url, **options)


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
    # the key was the host's alone while the agent worked; it is back once the agent is done
    assert seen_during_run["key"] is None and os.environ["ANTHROPIC_API_KEY"] == key
    assert all(key in r["headers"].get("x-api-key", "") + r["headers"].get("authorization", "")
               for r in server.requests)


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
    transcript = json.loads((run_dir / "decisions" / "001" / "transcript.json").read_text())
    (check,) = [t for t in transcript if t["event"] == "tool" and t["name"] == "check_programs"]
    assert check["is_error"] and "ran past its limit" in check["result"]
    assert opal.of_kind(run_dir, "end"), "training went on to the end"


def test_a_decision_that_hangs_is_killed_at_its_limit_and_the_host_answers_the_next(tmp_path, opal):
    workspace = tmp_path / "workspace"
    (workspace / ".opal").mkdir(parents=True)
    sources = opal.default_sources()
    (workspace / "analysis.py").write_text(sources["analysis.py"])
    os.mkfifo(workspace / "updater.py")  # the heuristic reads it: opening a fifo nobody writes blocks for ever
    host = AgentHost({"backend": "heuristic", "options": {}})
    try:
        started = time.monotonic()
        host.ask(1, workspace, "message", {"progress": 0.6, "reason": "scheduled"}, seconds=1.0)
        answer = host.answer(1, wait=True, seconds=1.0)
        elapsed = time.monotonic() - started
        assert answer.failed and "ran past its limit of 1 s" in answer.failed
        assert 1.0 <= elapsed < 8.0
        (workspace / "updater.py").unlink()
        (workspace / "updater.py").write_text(sources["updater.py"])
        host.ask(2, workspace, "message", {"progress": 0.6, "reason": "scheduled"}, seconds=30.0)
        second = host.answer(2, wait=True, seconds=30.0)
        assert second.failed is None and "ANNEAL_START" in second.rationale
        assert "ANNEAL_START = 0.8" in (workspace / "updater.py").read_text()
    finally:
        host.stop()
    assert host.process.poll() is not None


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
