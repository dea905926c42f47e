"""An agent arm whose backend cannot answer on this machine (no API key, no `claude` binary) is named at freeze (a
warning: the key may be set before the runs), at pilot (a note), and refused by `run` before it makes any folder;
a refused run leaves nothing behind. Before, the missing key was found 13 s into the run, after it had made
`ARM/seed-1/training/` and `ARM/.seed-1.lock`, and freeze and pilot said nothing."""

from __future__ import annotations

import json

import pytest

from tests import support
from tests.support.cli import call_cli

ARMS = {
    "claude": "  claude: {optimizer: {name: AdamW, lr: 1.0e-3}, agent: {backend: anthropic, decisions: 2}}\n",
    "coder": "  coder: {optimizer: {name: AdamW, lr: 1.0e-3}, agent: {backend: claude-code, decisions: 2}}\n",
}
SAID = {
    "claude": "arm claude: agent backend 'anthropic' needs an API key: set ANTHROPIC_API_KEY",
    "coder": "arm coder: agent backend 'claude-code' needs the Claude Code CLI '/nowhere/claude'",
}


@pytest.fixture
def project(digits_project, monkeypatch):
    """The digits project with an anthropic arm and a claude-code arm, on a machine with neither key nor CLI."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("OPALCTL_CLAUDE_BIN", "/nowhere/claude")
    path = digits_project / "digits.yaml"
    text = path.read_text(encoding="utf-8").replace("selection:\n", "".join(ARMS.values()) + "selection:\n", 1)
    text = text.replace("clock: cpu, amount: 20", "clock: updates, amount: 40")
    path.write_text(text, encoding="utf-8")
    return digits_project


def test_freeze_warns_of_each_agent_arm_that_cannot_answer_here(project, monkeypatch):
    result = call_cli("freeze", project / "digits.yaml", "--json")
    assert result.code == 0, result.output
    warnings = json.loads(result.stdout)["warnings"]
    assert len(warnings) == 2 and all(w.startswith(SAID[arm]) for w, arm in zip(warnings, ARMS)), warnings
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-key")
    result = call_cli("freeze", project / "digits.yaml", "--force")
    assert result.code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {SAID['coder']}"), result.stderr
    assert "sk-test" not in (project / "digits.lock.json").read_text()


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_a_run_that_cannot_reach_its_agent_is_refused_before_any_folder(project, arm):
    assert call_cli("freeze", project / "digits.yaml").code == 0
    before = support.tree(project)
    result = call_cli("run", project / "digits.lock.json", "--arm", arm, "--seed", "1",
                           "--runs-dir", project / "runs")
    assert result.code == 2, result.output
    assert result.stderr.startswith(f"opalctl: error: {SAID[arm]}") and result.stderr.count("\n") == 1
    assert not (project / "runs").exists()  # no run folder, no arm folder, no lock file
    assert support.tree(project) == before


def test_pilot_notes_the_missing_key(project):
    assert call_cli("freeze", project / "digits.yaml").code == 0
    result = call_cli("pilot", project / "digits.lock.json", "--arm", "claude", "--steps", "4", "--json")
    assert result.code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any(note.startswith(SAID["claude"].removeprefix("arm claude: ")) for note in notes), notes


def test_resuming_a_run_that_never_started_leaves_nothing(project):
    assert call_cli("freeze", project / "digits.yaml").code == 0
    result = call_cli("run", project / "digits.lock.json", "--arm", "adamw", "--seed", "1", "--resume",
                           "--runs-dir", project / "runs")
    assert result.code == 2 and "there is no run to resume" in result.stderr, result.output
    assert not (project / "runs").exists()
