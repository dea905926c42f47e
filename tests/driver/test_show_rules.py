"""The offline heuristic agent's work, visible: ``opalctl show`` and the report page list, for each of its
decisions, the rule that decided it, on which signal, the value seen and the threshold."""

import pytest

from opalctl.driver.show_render import rule_of
from tests.support.cli import call_cli

AGENT = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "agent": {"backend": "heuristic", "decisions": 4}}
POLICY = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
          "nondecreasing": ["selection.correct"], "improve_any": ["selection.correct"]}


@pytest.fixture
def agent_run(project):
    project.freeze(budget={"clock": "updates", "amount": 100}, arms={"agent": AGENT}, selection=POLICY)
    project.run("agent", 1)
    return project.run_dir("agent", 1)


def test_show_and_the_report_page_list_the_rule_of_each_heuristic_decision(agent_run, tmp_path):
    code, out, err = call_cli("show", str(agent_run))
    assert code == 0, err
    table = out[out.index("heuristic rules"):].splitlines()
    assert table[1].split() == ["decision", "at", "rule", "signal", "value", "threshold"]
    rows = [line for line in table[2:] if line.strip() and line.split()[0].isdigit()]
    decisions = sorted((agent_run / "agent" / "decisions").iterdir())
    assert len(rows) == len(decisions) >= 4, out
    checks = [rule_of(agent_run, int(folder.name)) for folder in decisions]
    assert all(check is not None and check.fired for check in checks)
    # from half the budget on, with no anneal set, the anneal rule decides: on the budget's progress, at 0.5
    anneal = next(check for check in checks if check.rule == "anneal")
    assert anneal.signal == "budget progress" and anneal.threshold == 0.5 and anneal.value >= 0.5
    assert any("anneal" in row and "budget progress" in row and ">= 0.5" in row for row in rows), rows
    page = tmp_path / "run.html"
    code, out, err = call_cli("show", str(agent_run), "--html", str(page))
    assert code == 0, err
    html = page.read_text(encoding="utf-8")
    assert "rule (signal, value, threshold)" in html and anneal.words().replace(">", "&gt;") in html


def test_a_decision_without_a_rule_record_shows_none(tmp_path):
    folder = tmp_path / "run" / "opal" / "decisions" / "001"
    folder.mkdir(parents=True)
    (folder / "transcript.json").write_text('[{"event": "sweep", "done": []}]')  # an LLM's decision, say
    assert rule_of(tmp_path / "run", 1) is None
    assert rule_of(tmp_path / "run", 2) is None  # no folder at all
