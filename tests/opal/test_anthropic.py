"""The Anthropic Messages API agent (``backend: anthropic``) in formal runs, through the real ``anthropic`` SDK
talking to a loopback server that speaks the Messages API (``messages_server.py``), scripted per test.

Each run is the digits project on an ``updates`` clock of 60 updates, its agent arm asking one decision at half
the budget (update 30) unless a test says otherwise. What is shown:

- a decision that reads ``updater.py``, writes a version with ``LR_SCALE`` halved, checks it and ends with a
  rationale is applied at update 30 (the run's losses equal the plain arm's up to the first update the new
  program steps, and differ after), with its usage, a cost above zero, a transcript and a diff summary, shown by
  ``opalctl show``; the API key reaches the server and no file;
- a 429 then a success: retried, and the decision is applied; a 401: the decision fails, the run finishes;
- paths out of the workspace (``../``, absolute, a symlink out) are refused and the agent reads the refusal;
- a program that fails its check: the agent reads the error and fixes it in its next turn;
- ``max_cost_usd``: once the rest of the budget is below the expected cost, no further request is sent;
- the last turn goes without tools, and an agent that still calls one fails the decision;
- freeze refuses a model without prices; a run without an API key is refused before any work.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from opalctl.driver.records import read_steps
from opalctl.driver.run import run
from opalctl.errors import BadInput
from opalctl.opal.agents.anthropic import DEFAULT_PRICES, Workspace, cost_of, default_prices
from opalctl.opal.agents.dry_run import dry_run
from opalctl.opal.messages import prompt_text
from opalctl.protocol.freeze import freeze
from tests.support.cli import call_cli

_spec = importlib.util.spec_from_file_location("messages_server", Path(__file__).with_name("messages_server.py"))
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

AMOUNT = 60
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01}}
RATIONALE = ("Observed: the loss falls steadily.\nChanged: LR_SCALE 1.0 -> 0.5 in updater.py, for smaller steps.\n"
             "Prediction: the loss keeps falling, more smoothly; wrong if it stalls.\nRules: LR_SCALE is a schedule.")
ESCAPE = f"/tmp/opalctl-escape-{uuid.uuid4().hex}.py"
KEPT = "Observed: nothing of note.\nKept: the programs.\nPrediction: no change.\nRules: none."


def agent_arm(**agent):
    settings = {"backend": "anthropic", "model": "claude-opus-5-5", "decisions": 1, "schedule": [0.5], "every": 10,
                "trial_steps": 5, **agent}
    return {**ADAMW, "agent": settings}


@pytest.fixture
def key(monkeypatch):
    # not shaped like a key (no sk- prefix): only the run's own list of secrets can keep it out of the files
    secret = f"opalctl-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    return secret


class Project:
    def __init__(self, folder: Path, runs: Path, monkeypatch):
        self.folder, self.runs, self.monkeypatch = folder, runs, monkeypatch
        self.lock = None

    def freeze(self, arms: dict) -> Path:
        path = self.folder / "digits.yaml"
        data = yaml.safe_load(path.read_text())
        data["budget"] = {"clock": "updates", "amount": AMOUNT, "threads": 1}
        data["training"] = {**data["training"], "checkpoint_every": 0.25}
        data["arms"] = arms
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.lock = Path(freeze(path, force=True)["lock"])
        return self.lock

    def run(self, arm: str, server=None) -> dict:
        if server is not None:
            self.monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        return run(self.lock, arm, 1, runs_dir=self.runs)


@pytest.fixture
def project(digits_project, tmp_path, monkeypatch):
    return Project(digits_project, tmp_path / "runs", monkeypatch)


def events(run_dir, *kinds):
    lines = (Path(run_dir) / "training" / "opal" / "events.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    return [e for e in found if e["kind"] in kinds] if kinds else found


def decision_meta(run_dir, number=1):
    return json.loads((Path(run_dir) / "training" / "opal" / "decisions" / f"{number:03d}" / "meta.json").read_text())


def assert_key_in_no_file(key, *folders):
    for folder in folders:
        for path in Path(folder).rglob("*"):
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if path.suffix == ".gz":
                    data = gzip.decompress(data)
                assert key.encode() not in data, f"the API key reached {path}"


def tool_results(body):
    return ms.last_tool_results(body)


# -- the whole decision --------------------------------------------------------------------------------------------

def test_a_decision_reads_writes_checks_and_is_applied_at_its_update(project, key):
    project.freeze({"adamw": ADAMW, "claude": agent_arm()})

    def write_halved(body):
        (read,) = tool_results(body)
        assert "LR_SCALE = 1.0" in read["content"] and not read.get("is_error")
        return ms.reply(ms.text("I will halve the scale."),
                        ms.tool_use("write_file", {"path": "updater.py",
                                                   "content": read["content"].replace("LR_SCALE = 1.0",
                                                                                      "LR_SCALE = 0.5", 1)}))

    script = [ms.reply(ms.tool_use("read_file", {"path": "updater.py"})), write_halved,
              ms.reply(ms.tool_use("check_programs", {})),
              ms.reply(ms.text(RATIONALE + f"\n(I was called with {key}.)"))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    plain = project.run("adamw")
    run_dir = Path(report["run_dir"])

    # what the agent was sent: the prompt as a cached system prompt, the decision as the user turn, the tools
    assert len(server.requests) == 4
    first = server.bodies[0]
    assert first["model"] == "claude-opus-5-5" and first["max_tokens"] == 8192
    (system,) = first["system"]
    assert system["cache_control"] == {"type": "ephemeral"}
    assert system["text"].startswith(prompt_text("neutral").rstrip()) and "check_programs" in system["text"]
    assert first["messages"][0]["content"][0]["text"].startswith("# Decision 1 (scheduled)")
    assert {t["name"] for t in first["tools"]} == {"list_files", "read_file", "write_file", "replace_text",
                                                   "check_programs"}
    assert "tool_choice" not in first
    assert all(key in r["headers"].get("authorization", "") + r["headers"].get("x-api-key", "")
               for r in server.requests), "the key is sent to the API"
    (checked,) = tool_results(server.bodies[3])
    assert checked["content"].startswith("ok") and not checked["is_error"]

    # applied at the update it was asked, and nowhere else
    (asked,) = events(run_dir, "requested")
    (applied,) = events(run_dir, "applied")
    assert asked["update"] == applied["update"] == AMOUNT // 2 and applied["version"] == 1
    assert applied["files"] == ["updater.py"] and applied["diff"] == {"updater.py": {"added": 1, "removed": 1}}
    assert "LR_SCALE = 0.5" in (run_dir / "training" / "opal" / "programs" / "v001" / "updater.py").read_text()
    losses = {s["update"]: s["loss"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")}
    plain_losses = {s["update"]: s["loss"] for s in read_steps(Path(plain["run_dir"]) / "training" / "steps.jsonl.gz")}
    first_new = AMOUNT // 2 + 1  # the first update the new program steps; its loss comes before that step
    assert all(losses[u] == plain_losses[u] for u in range(1, first_new + 1))
    assert losses[first_new + 1] != plain_losses[first_new + 1]

    # usage, cost, transcript
    meta = decision_meta(run_dir)
    usage = meta["usage"]
    assert usage["requests"] == 4 and usage["input_tokens"] == 4 * ms.USAGE["input_tokens"]
    assert usage["output_tokens"] == 4 * ms.USAGE["output_tokens"]
    assert meta["cost_usd"] == pytest.approx(cost_of(usage, default_prices("claude-opus-5-5"))) and meta["cost_usd"] > 0
    assert applied["cost_usd"] == meta["cost_usd"] and report["agent"]["cost_usd"] == meta["cost_usd"]
    transcript = json.loads((run_dir / "agent" / "decisions" / "001" / "transcript.json").read_text())
    assert [t["name"] for t in transcript if t["event"] == "tool"] == ["read_file", "write_file", "check_programs"]
    response = (run_dir / "agent" / "decisions" / "001" / "response.md").read_text()
    assert response.startswith("Observed: the loss falls steadily.") and "[redacted]" in response

    # opalctl show: seconds, cost, the changed files with their diff, the rationale
    shown = call_cli("show", run_dir, "--json")
    assert shown.code == 0, shown.stderr
    (decision,) = shown.json()["decisions"]
    assert decision["outcome"] == "applied" and decision["cost_usd"] == meta["cost_usd"]
    assert decision["seconds"] > 0 and decision["diff"] == applied["diff"]
    table = call_cli("show", run_dir)
    lines = table.stdout.splitlines()
    row = lines[lines.index("agent decisions") + 2]
    assert "updater.py +1 -1" in row and "Changed: LR_SCALE 1.0 -> 0.5" in row

    assert_key_in_no_file(key, project.runs, project.folder)
    start = events(run_dir, "start")[0]
    assert start["backend"]["model"] == "claude-opus-5-5" and start["backend"]["prices"]["input"] > 0


# -- unavailable and failed ----------------------------------------------------------------------------------------

def halving_reply(body):
    source = (Path(__file__).resolve().parents[2] / "opalctl" / "opal" / "defaults" / "updater.py").read_text()
    return ms.reply(ms.tool_use("write_file", {"path": "updater.py",
                                               "content": source.replace("LR_SCALE = 1.0", "LR_SCALE = 0.5", 1)}))


def test_a_rate_limit_is_waited_out_and_the_decision_is_kept(project, key):
    project.freeze({"claude": agent_arm()})
    script = [ms.error(429, "rate_limit_error", "slow down", headers={"retry-after": "0"}),
              ms.error(529, "overloaded_error", "overloaded", headers={"retry-after": "0"}),
              halving_reply, ms.reply(ms.text(RATIONALE))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    run_dir = Path(report["run_dir"])
    assert len(server.requests) == 4 and server.bodies[0] == server.bodies[1] == server.bodies[2]
    (applied,) = events(run_dir, "applied")
    assert applied["update"] == AMOUNT // 2 and not events(run_dir, "decision_failed")
    transcript = json.loads((run_dir / "agent" / "decisions" / "001" / "transcript.json").read_text())
    assert [t["status"] for t in transcript if t["event"] == "error"] == [429, 529]
    assert [t["wait_seconds"] for t in transcript if t["event"] == "retry"] == [0.0, 0.0]
    assert_key_in_no_file(key, project.runs)


def test_an_api_that_stays_unavailable_fails_the_decision_after_its_retries(project, key):
    project.freeze({"claude": agent_arm(retries=2)})
    script = [ms.error(503, "api_error", "down", headers={"retry-after": "0"})] * 5
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    assert len(server.requests) == 3, "one attempt and two retries"
    (failed,) = events(Path(report["run_dir"]), "decision_failed")
    assert failed["message"].startswith("unavailable:") and "HTTP 503" in failed["message"]


def test_an_authentication_error_fails_the_decision_and_the_run_finishes(project, key):
    project.freeze({"claude": agent_arm(decisions=2, schedule=[0.25, 0.5])})
    script = [ms.error(401, "authentication_error", "invalid x-api-key"), ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    run_dir = Path(report["run_dir"])
    assert len(server.requests) == 2, "a 401 is not retried"
    failed, = events(run_dir, "decision_failed")
    assert failed["decision"] == 1 and "401" in failed["message"] and "ANTHROPIC_API_KEY" in failed["message"]
    assert [e["decision"] for e in events(run_dir, "kept")] == [2]
    assert (run_dir / "report.json").exists() and report["agent"]["decisions_failed"] == 1
    assert decision_meta(run_dir)["outcome"] == "failed"
    assert_key_in_no_file(key, project.runs)


# -- the workspace's walls ---------------------------------------------------------------------------------------

def test_paths_out_of_the_workspace_are_refused_and_the_agent_sees_it(project, key):
    project.freeze({"claude": agent_arm()})
    script = [ms.reply(ms.tool_use("read_file", {"path": "../start.json"}),
                       ms.tool_use("write_file", {"path": ESCAPE, "content": "x = 1\n"}),
                       ms.tool_use("replace_text", {"path": "sub/../../events.jsonl", "old": "a", "new": "b"}),
                       ms.tool_use("write_file", {"path": ".opal/facts.json", "content": "{}"})),
              ms.reply(ms.text(KEPT))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    run_dir = Path(report["run_dir"])
    results = tool_results(server.bodies[1])
    assert len(results) == 4 and all(r["is_error"] and r["content"].startswith("refused:") for r in results)
    assert "'..'" in results[0]["content"] and "absolute" in results[1]["content"] and ".opal" in results[3]["content"]
    assert not Path(ESCAPE).exists()
    assert events(run_dir, "kept") and not events(run_dir, "applied")


def test_a_symlink_out_of_the_workspace_is_refused_for_reading_and_replaced_for_writing(tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (tmp_path / "secret.txt").write_text("outside")
    (workspace / "updater.py").write_text("x = 1\n")
    os.symlink(tmp_path / "secret.txt", workspace / "link.txt")
    os.symlink(tmp_path, workspace / "up")
    space = Workspace(workspace)
    assert space.read("updater.py") == "x = 1\n"
    assert "link.txt (a link)" in space.list_files() and "up (a link)" in space.list_files()
    for path in ("link.txt", "up/secret.txt"):
        with pytest.raises(Exception, match="outside the workspace"):
            space.read(path)
    with pytest.raises(Exception, match="outside the workspace"):
        space.write("up/secret.txt", "changed")  # a link on the way: refused
    space.write("link.txt", "changed")  # the link itself is replaced by a file, never followed
    assert not (workspace / "link.txt").is_symlink() and (workspace / "link.txt").read_text() == "changed"
    assert (tmp_path / "secret.txt").read_text() == "outside"


BROKEN_STEP = "        self.optimizer.step()\n"


def test_a_program_that_fails_its_check_is_fixed_in_the_next_turn(project, key):
    project.freeze({"claude": agent_arm()})
    source = (Path(__file__).resolve().parents[2] / "opalctl" / "opal" / "defaults" / "updater.py").read_text()
    broken = source.replace("LR_SCALE = 1.0", "LR_SCALE = 0.5", 1).replace(
        "    def step(self, grads, update, ctx):\n", "    def step(self, grads, update, ctx):\n"
                                                  "        scale = undefined_scale * 2\n", 1)
    assert broken != source

    def fix(body):
        (checked,) = tool_results(body)
        assert checked["is_error"] and "NameError" in checked["content"] and "undefined_scale" in checked["content"]
        return ms.reply(ms.tool_use("replace_text", {"path": "updater.py", "old": "        scale = undefined_scale * 2\n",
                                                     "new": ""}))

    script = [ms.reply(ms.tool_use("write_file", {"path": "updater.py", "content": broken})),
              ms.reply(ms.tool_use("check_programs", {})), fix, ms.reply(ms.tool_use("check_programs", {})),
              ms.reply(ms.text(RATIONALE))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    run_dir = Path(report["run_dir"])
    assert len(server.requests) == 5
    (checked,) = tool_results(server.bodies[4])
    assert not checked["is_error"] and checked["content"].startswith("ok")
    (applied,) = events(run_dir, "applied")
    program = (run_dir / "training" / "opal" / "programs" / "v001" / "updater.py").read_text()
    assert "undefined_scale" not in program and "LR_SCALE = 0.5" in program
    assert not events(run_dir, "reverted")


def test_the_dry_run_uses_the_real_shapes_and_dtypes(tmp_path, opal):
    sources = opal.default_sources()
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    facts = {"shapes": {"embed.weight": [[5, 3], "bfloat16"], "head.bias": [[5], "float32"]}, "lrs": [0.01]}
    assert dry_run(tmp_path, facts, sources) is None
    (tmp_path / "updater.py").write_text(opal.broken_updater(
        "        for name, p in self.params.items():\n            p.data = p.data.float()"))
    problem = dry_run(tmp_path, facts, sources)
    assert "embed.weight" in problem and "bfloat16" in problem
    (tmp_path / "updater.py").write_text("import os\n" + sources["updater.py"])
    assert "import of 'os' is not allowed" in dry_run(tmp_path, facts, sources)


# -- cost, turns, settings -----------------------------------------------------------------------------------------

def test_no_request_is_sent_once_the_cost_cap_would_be_passed(project, key):
    # 200,000 input tokens at $5 per million: each reply costs $1.00; the cap is $1.50, above the $1.08 a first
    # decision is expected to cost at these prices (the measured model's input price)
    prices = {"input": 5.0, "output": 0.0, "cache_read": 0.0, "cache_write": 0.0}
    usage = {"input_tokens": 200_000, "output_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    project.freeze({"claude": agent_arm(decisions=3, schedule=[0.25, 0.5, 0.75], prices=prices, max_cost_usd=1.5)})
    script = [ms.reply(ms.text(KEPT), usage=usage)] * 3
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    run_dir = Path(report["run_dir"])
    assert len(server.requests) == 1, "the first decision ($1.00) leaves $0.50, below the next one's expected $1.00"
    skipped = events(run_dir, "skipped")
    assert [e["reason"] for e in skipped] == ["cost cap", "cost cap"]
    assert skipped[0]["expected_usd"] == pytest.approx(1.0) and skipped[0]["spent_usd"] == pytest.approx(1.0)
    assert report["agent"]["cost_usd"] == pytest.approx(1.0) and report["agent"]["decisions_asked"] == 1


def test_the_last_turn_has_no_tools_and_an_unfinished_agent_fails(project, key):
    project.freeze({"claude": agent_arm(turns=2)})
    script = [halving_reply, ms.reply(ms.tool_use("check_programs", {}))]
    with ms.MessagesServer(script) as server:
        report = project.run("claude", server)
    assert server.bodies[1]["tool_choice"] == {"type": "none"} and "tool_choice" not in server.bodies[0]
    assert "last turn" in server.bodies[1]["messages"][-1]["content"][-1]["text"]
    (failed,) = events(Path(report["run_dir"]), "decision_failed")
    assert "all 2 turns" in failed["message"] and not events(Path(report["run_dir"]), "applied")


def test_freeze_refuses_a_model_without_prices(digits_project):
    path = digits_project / "digits.yaml"
    data = yaml.safe_load(path.read_text())
    data["arms"] = {"claude": agent_arm(model="claude-unknown-9")}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = call_cli("freeze", path)
    assert result.code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "arms.claude.agent.prices" in lines[0] and "claude-unknown-9" in lines[0]
    data["arms"]["claude"]["agent"]["prices"] = {"input": 1.0, "output": 2.0}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert call_cli("freeze", path, "--force").code == 0


def test_a_run_without_an_api_key_is_refused_before_any_work(project, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    project.freeze({"claude": agent_arm()})
    with pytest.raises(BadInput, match="ANTHROPIC_API_KEY"):
        project.run("claude")


def test_default_prices_cover_the_measured_model():
    assert default_prices("claude-opus-5-5") == {"input": 5.0, "output": 25.0, "cache_read": 0.5, "cache_write": 6.25}
    assert default_prices("claude-sonnet-4-5-20250929") == default_prices("claude-sonnet-4-5")
    assert default_prices("gpt-4") is None and "claude-opus-5-5" in DEFAULT_PRICES
