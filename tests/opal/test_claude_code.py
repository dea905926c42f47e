"""The Claude Code CLI agent (``backend: claude-code``) through a real subprocess standing in for ``claude``.

The stand-in is a small Python script (``OPALCTL_CLAUDE_BIN`` points at it): it logs its arguments, working folder
and standard input, halves ``LR_SCALE`` in ``updater.py`` at its first call, and prints the JSON answer the CLI
prints with ``--output-format json``. Told to sleep, it starts a child and sleeps, so the timeout must kill the
whole process group (the child ignores SIGTERM, so only the group's SIGKILL ends it). What is shown:

- a formal run asks it in the workspace, headless, with file tools only; its edit is applied at the decision's
  update; the second decision resumes the first one's session; the cost is the CLI's ``total_cost_usd``;
- past ``seconds_per_decision`` its process group (the stand-in and its child) is killed and the decision fails;
- an error answer fails the decision and the next one starts a fresh session;
- a missing binary is refused when the run starts, naming the binary and how to install it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from opalctl.driver.run import run
from opalctl.errors import BadInput
from opalctl.opal.agents.claude_code import ALLOWED_TOOLS, ClaudeCodeBackend
from opalctl.opal.messages import prompt_text
from opalctl.protocol.freeze import freeze

AMOUNT = 60
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01}}

STANDIN = '''#!{python}
import json, os, pathlib, subprocess, sys, time

log = pathlib.Path(os.environ["STANDIN_LOG"])
calls = len(log.read_text().splitlines()) + 1 if log.exists() else 1
stdin = sys.stdin.read()
with log.open("a") as handle:
    handle.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "stdin": stdin}}) + "\\n")
mode = os.environ.get("STANDIN_MODE", "edit")
if mode == "sleep":
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
    pathlib.Path(os.environ["STANDIN_PIDS"]).write_text(json.dumps([os.getpid(), child.pid]))
    time.sleep(120)
if mode == "error":
    print(json.dumps({{"type": "result", "subtype": "error_during_execution", "is_error": True,
                      "result": "the model is overloaded", "session_id": "session-broken", "total_cost_usd": 0.01}}))
    sys.exit(1)
if calls == 1:
    updater = pathlib.Path("updater.py")
    updater.write_text(updater.read_text().replace("LR_SCALE = 1.0", "LR_SCALE = 0.5", 1))
    result = "Observed: the loss falls.\\nChanged: LR_SCALE 1.0 -> 0.5.\\nPrediction: smoother.\\nRules: a schedule."
else:
    result = "Observed: steady.\\nKept: the programs.\\nPrediction: no change.\\nRules: none."
print(json.dumps({{"type": "result", "subtype": "success", "is_error": False, "result": result,
                  "session_id": "session-" + str(calls), "total_cost_usd": 0.25 / calls, "num_turns": 3,
                  "usage": {{"input_tokens": 100, "output_tokens": 50}}}}))
'''


class Standin:
    def __init__(self, script: Path, log: Path):
        self.script, self.log = script, log


@pytest.fixture
def standin(tmp_path, monkeypatch):
    script = tmp_path / "claude-standin"
    script.write_text(STANDIN.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "standin.log"
    monkeypatch.setenv("OPALCTL_CLAUDE_BIN", str(script))
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.delenv("STANDIN_MODE", raising=False)
    return Standin(script, log)


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def freeze_project(folder: Path, agent: dict) -> Path:
    path = folder / "digits.yaml"
    data = yaml.safe_load(path.read_text())
    data["budget"] = {"clock": "updates", "amount": AMOUNT, "threads": 1}
    data["training"] = {**data["training"], "checkpoint_every": 0.25}
    data["arms"] = {"cli": {**ADAMW, "agent": {"backend": "claude-code", "every": 10, "trial_steps": 5, **agent}}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(freeze(path, force=True)["lock"])


def events(run_dir: Path, *kinds: str) -> list[dict]:
    found = [json.loads(line) for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    return [e for e in found if e["kind"] in kinds]


def test_a_formal_run_asks_the_cli_in_the_workspace_and_resumes_its_session(digits_project, standin, tmp_path):
    lock = freeze_project(digits_project, {"decisions": 2, "schedule": [0.25, 0.5], "model": "claude-opus-5-5"})
    report = run(lock, "cli", 1, runs_dir=tmp_path / "runs")
    run_dir = Path(report["run_dir"])
    first, second = calls(standin.log)
    for call in (first, second):
        argv = call["argv"]
        assert Path(call["cwd"]) == (run_dir / "agent" / "workspace").resolve()
        assert argv[:3] == ["-p", "--output-format", "json"]
        assert argv[argv.index("--allowedTools") + 1] == ALLOWED_TOOLS
        assert "Bash" in argv[argv.index("--disallowedTools") + 1]
        assert argv[argv.index("--model") + 1] == "claude-opus-5-5"
    assert "--resume" not in first["argv"]
    assert second["argv"][second["argv"].index("--resume") + 1] == "session-1"
    assert first["stdin"].startswith(prompt_text("neutral")), "the first decision gets the prompt"
    assert second["stdin"].startswith("# Decision 2"), "a resumed session already holds the prompt"

    (applied,) = events(run_dir, "applied")
    (kept,) = events(run_dir, "kept")
    assert applied["decision"] == 1 and applied["update"] == AMOUNT // 4 and kept["decision"] == 2
    assert applied["cost_usd"] == 0.25 and kept["cost_usd"] == 0.125
    assert report["agent"]["cost_usd"] == pytest.approx(0.375)
    assert "LR_SCALE = 0.5" in (run_dir / "training" / "opal" / "programs" / "v001" / "updater.py").read_text()
    meta = json.loads((run_dir / "training" / "opal" / "decisions" / "001" / "meta.json").read_text())
    assert meta["usage"] == {"input_tokens": 100, "output_tokens": 50, "turns": 3}
    transcript = json.loads((run_dir / "agent" / "decisions" / "001" / "transcript.json").read_text())
    assert transcript[0]["event"] == "command" and transcript[1]["returncode"] == 0


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_decision_past_its_time_kills_the_process_group(standin, tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "updater.py").write_text("LR_SCALE = 1.0\n")
    pids = tmp_path / "pids.json"
    backend = ClaudeCodeBackend(seconds_per_decision=1.5, env={"STANDIN_MODE": "sleep", "STANDIN_PIDS": str(pids)})
    started = time.monotonic()
    answer = backend.decide(workspace, "# Decision 1", {})
    assert time.monotonic() - started < 10
    assert answer.failed and "1.5 s" in answer.failed and "process group was killed" in answer.failed
    leader, child = json.loads(pids.read_text())
    deadline = time.monotonic() + 5
    while not (_gone(leader) and _gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(leader) and _gone(child), "the stand-in and its child are both killed"
    assert backend.session_id is None and answer.transcript[-1]["timed_out"]


def test_an_error_answer_fails_the_decision_and_the_next_one_starts_afresh(standin, tmp_path, monkeypatch):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "updater.py").write_text("LR_SCALE = 1.0\n")
    backend = ClaudeCodeBackend(seconds_per_decision=30)
    assert not backend.decide(workspace, "# Decision 1", {}).failed and backend.session_id == "session-1"
    monkeypatch.setenv("STANDIN_MODE", "error")
    answer = backend.decide(workspace, "# Decision 2", {})
    assert answer.failed and "exit 1" in answer.failed and "overloaded" in answer.failed
    assert answer.cost_usd == 0.01 and backend.session_id is None
    assert "--resume" in calls(standin.log)[1]["argv"]


def test_a_missing_binary_is_refused_before_the_run_starts(digits_project, tmp_path, monkeypatch):
    monkeypatch.setenv("OPALCTL_CLAUDE_BIN", str(tmp_path / "no-such-claude"))
    lock = freeze_project(digits_project, {"decisions": 1})
    with pytest.raises(BadInput) as refused:
        run(lock, "cli", 1, runs_dir=tmp_path / "runs")
    message = str(refused.value)
    assert "no-such-claude" in message and "npm install" in message and "OPALCTL_CLAUDE_BIN" in message
    assert not (tmp_path / "runs").exists()  # refused before any folder is made (tests/driver/test_refused_early.py)
    assert os.environ["OPALCTL_CLAUDE_BIN"].endswith("no-such-claude")


def test_freeze_refuses_a_cost_cap_on_a_model_without_prices(digits_project):
    with pytest.raises(BadInput) as refused:
        freeze_project(digits_project, {"decisions": 1, "model": "sonnet", "max_cost_usd": 2.0})
    message = str(refused.value)
    assert "max_cost_usd" in message and "'sonnet'" in message and "price table" in message
    freeze_project(digits_project, {"decisions": 1, "model": "claude-sonnet-4-5", "max_cost_usd": 2.0})
    freeze_project(digits_project, {"decisions": 1, "model": "sonnet"})
