"""An agent arm that never acted is no result (issue 26, item 2).

One digits lock, ``updates`` clock, tiny budget, two seeds, four arms: ``adamw`` (the baseline), ``api`` (the
``anthropic`` backend against the loopback Messages server of tests/opal/messages_server.py, which answers every
request ``401 authentication_error``: a bad key), ``cli`` (the ``claude-code`` backend with a real ``claude``
script on PATH that exits 1) and ``heur`` (the offline heuristic, asked once at 10 % of the budget, where no rule
of it fires: it answers and keeps), and ``mixed`` (``claude-code`` again, whose ``claude`` acts on seed 1, halving
the learning rate, and exits 1 on seed 2: the mixed case). The grid runs them once for the module (``opalctl grid --json``, each run a
child process of it); then one more ``opalctl run --json`` of ``api`` into a second runs folder, for a run's own
exit and output. Every test reads what these made: the runs' warnings and exit codes, compare's sentence in place
of a verdict (terminal, ``--json``, ``--csv``), the decision columns, the report page, and the grid's end. Every
``opalctl`` command is called in this process (``call_cli``: the exit code is the one ``main`` exits with), with
the module's environment.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cli import CliResult, call_cli

UPDATES = 60
SEEDS = (1, 2)
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}
AGENT = {"decisions": 2, "schedule": [0.3, 0.6], "every": 10, "trial_steps": 5}
ARMS = {"adamw": ADAMW,
        "api": {**ADAMW, "agent": {"backend": "anthropic", "model": "claude-opus-5-5", **AGENT}},
        "cli": {**ADAMW, "agent": {"backend": "claude-code", **AGENT}},
        "heur": {**ADAMW, "agent": {"backend": "heuristic", "decisions": 1, "schedule": [0.1], "every": 10,
                                    "trial_steps": 5}},
        "mixed": {**ADAMW, "agent": {"backend": "claude-code", **AGENT}}}
REFUSED = "invalid x-api-key"
# a real `claude` on PATH: in the workspace of arm mixed, seed 1, it halves the learning rate (then keeps: the
# second time there is nothing left to halve); everywhere else it fails as a logged-out Claude Code does
CLAUDE = """#!{python}
import json, os, pathlib, sys
sys.stdin.read()
if "/mixed/seed-1/" not in os.getcwd():
    sys.stderr.write("claude: Invalid API key. Please run /login\\n")
    sys.exit(1)
updater = pathlib.Path("updater.py")
updater.write_text(updater.read_text().replace("LR_SCALE = 1.0", "LR_SCALE = 0.5", 1))
print(json.dumps({{"type": "result", "subtype": "success", "is_error": False, "session_id": "s", "num_turns": 1,
                  "total_cost_usd": 0.0, "result": "Observed: the loss falls.\\nChanged: LR_SCALE 1.0 -> 0.5."}}))
"""


class Made:
    """What the module's runs left: the lock, the runs folders, the grid's output, the single run's."""

    def __init__(self, root: Path):
        self.root = root
        self.project = root / "project"
        self.runs = root / "runs"
        self.lock: Path | None = None
        self.grid: CliResult | None = None
        self.single: CliResult | None = None
        self.env: dict[str, str] = {}  # set in this process's environment, less its OPALCTL_ variables, for a command

    def called(self, *args) -> CliResult:
        """``opalctl ARGS`` in this process (``call_cli``), with the module's environment and no ``OPALCTL_``
        variable (a user's shell: no test setting reaches the runs a grid starts)."""
        with pytest.MonkeyPatch.context() as monkeypatch:
            for name in [name for name in os.environ if name.startswith("OPALCTL_")]:
                monkeypatch.delenv(name)
            for name, value in self.env.items():
                monkeypatch.setenv(name, value)
            return call_cli(*args)

    def run_dir(self, arm: str, seed: int, runs: Path | None = None) -> Path:
        return next((runs or self.runs).glob("digits-*")) / arm / f"seed-{seed}"

    def grid_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.grid.stdout.splitlines() if line.strip()]


def _messages_server():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "messages_server", Path(__file__).resolve().parents[1] / "opal" / "messages_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def made(digits_init_folder, tmp_path_factory) -> Made:
    from opalctl.protocol.freeze import freeze

    made = Made(tmp_path_factory.mktemp("never-acted"))
    shutil.copytree(digits_init_folder, made.project, ignore=shutil.ignore_patterns(".complete"))
    protocol = made.project / "digits.yaml"
    data = yaml.safe_load(protocol.read_text())
    data["budget"] = {"clock": "updates", "amount": UPDATES, "threads": 1}
    data["arms"] = ARMS
    protocol.write_text(yaml.safe_dump(data, sort_keys=False))
    made.lock = Path(freeze(protocol, force=True)["lock"])
    tools = made.root / "bin"
    tools.mkdir()
    (tools / "claude").write_text(CLAUDE.format(python=sys.executable))
    (tools / "claude").chmod(0o755)
    ms = _messages_server()
    with ms.MessagesServer([ms.error(401, "authentication_error", REFUSED)] * 40) as server:
        made.env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
                    "ANTHROPIC_API_KEY": "sk-ant-api03-" + "x" * 40, "ANTHROPIC_BASE_URL": server.url}
        made.grid = made.called("grid", made.lock, "--jobs", "2", "--json", "--runs-dir", made.runs)
        made.single = made.called("run", made.lock, "--arm", "api", "--seed", "1", "--json", "--runs-dir",
                                   made.root / "single")
    return made


# -- the runs ---------------------------------------------------------------------------------------------------

def test_a_run_whose_agent_never_answered_warns_and_exits_5_with_its_folder_complete(made):
    single = made.single
    assert single.code == 5, single.stderr[-3000:]
    report = json.loads(single.stdout)
    acted = report["agent_acted"]
    assert acted["exit_code"] == 5
    assert acted["decisions"] == {"asked": 2, "applied": 0, "rolled_back": 0, "kept": 0, "failed": 2,
                                  "timed_out": 0, "failure": acted["decisions"]["failure"], "failures": 2}
    assert "the API refused the key" in acted["decisions"]["failure"] and REFUSED in acted["decisions"]["failure"]
    warning = [line for line in single.stderr.splitlines() if line.startswith("warning: ")]
    assert warning == ["warning: " + acted["warning"]]
    assert "the agent of arm api never answered on seed 1: 0 of 2 decisions applied, 2 failed" in acted["warning"]
    assert "this run is AdamW alone" in acted["warning"] and "exit 5" in acted["warning"]
    # the folder is complete: it verifies
    verified = made.called("verify", made.run_dir("api", 1, made.root / "single"))
    assert verified.code == 0, verified.stderr


def test_each_run_of_the_grid_exits_by_what_its_agent_did(made):
    ends = {(e["arm"], e["seed"]): e for e in made.grid_lines() if e.get("event") == "run"
            and e["state"] in ("finished", "failed")}
    assert {key: e["state"] for key, e in ends.items()} == {(a, s): "finished" for a in ARMS for s in SEEDS}
    codes = {key: e["exit_code"] for key, e in ends.items()}
    assert codes == {**{("adamw", s): 0 for s in SEEDS}, **{("api", s): 5 for s in SEEDS},
                     **{("cli", s): 5 for s in SEEDS}, **{("heur", s): 0 for s in SEEDS}, ("mixed", 1): 0,
                     ("mixed", 2): 5}
    assert "warning:" not in (made.run_dir("mixed", 1) / "grid.log").read_text()
    claude = (made.run_dir("cli", 1) / "grid.log").read_text()
    assert "warning: the agent of arm cli never answered on seed 1: 0 of 2 decisions applied, 2 failed (" in claude
    assert "the claude command failed (exit 1): claude: Invalid API key" in claude
    heuristic = (made.run_dir("heur", 2) / "grid.log").read_text()
    assert "warning: the agent of arm heur never acted on seed 2: 0 of 1 decision applied, 1 kept;" in heuristic
    assert "warning:" not in (made.run_dir("adamw", 1) / "grid.log").read_text()


def test_the_grid_ends_saying_which_agents_never_acted_and_exits_5(made):
    assert made.grid.code == 5, made.grid.stderr[-3000:]
    (end,) = [e for e in made.grid_lines() if e.get("event") == "grid"]
    warnings = end["agent_warnings"]
    assert [w.split(" never acted")[0] for w in warnings[:3]] == ["agent arm api", "agent arm cli", "agent arm heur"]
    assert warnings[3].startswith("agent arm mixed: Seed 2 left out: the agent of mixed never answered there")
    for warning in warnings:
        assert f"warning: {warning}" in made.grid.stderr


# -- compare ----------------------------------------------------------------------------------------------------

def test_compare_gives_no_verdict_to_an_agent_arm_that_never_acted_but_says_why(made):
    shown = made.called("compare", made.lock, "--runs-dir", made.runs, "--json")
    assert shown.code == 0, shown.stderr
    arms = {row["arm"]: row for row in json.loads(shown.stdout)["arms"]}
    primary = json.loads(shown.stdout)["primary"]
    api = arms["api"]["paired"][primary]["verdict"]
    assert api.startswith("agent arm api never acted: 0 of 4 decisions applied, 4 failed (the API refused the key "
                          "(HTTP 401 authentication_error: invalid x-api-key)")
    assert api.endswith("on 2 seeds; its runs are the base optimizer's (AdamW), so a verdict would be about "
                        "AdamW, not the agent.")
    assert arms["cli"]["paired"][primary]["verdict"].startswith(
        "agent arm cli never acted: 0 of 4 decisions applied, 4 failed (the claude command failed (exit 1)")
    assert arms["heur"]["paired"][primary]["verdict"].startswith(
        "agent arm heur never acted: 0 of 2 decisions applied, 2 kept on 2 seeds; its runs are the base optimizer's")
    for arm in ("api", "cli", "heur"):
        assert "identical" not in json.dumps(arms[arm]["paired"]) and "no difference" not in json.dumps(arms[arm])
        assert arms[arm]["decisions"]["no_verdict"] == arms[arm]["paired"][primary]["verdict"].split(" Flagged")[0]
        assert arms[arm]["decisions"]["acted_seeds"] == []
    # an arm that acted on no seed keeps its figures (its base optimizer's: no difference here), with no verdict
    assert arms["api"]["paired"][primary]["n"] == 2 and arms["heur"]["paired"][primary]["n"] == 2
    assert arms["api"]["decisions"]["never_answered_seeds"] == [1, 2] and arms["api"]["decisions"]["left_out_seeds"] == []
    assert arms["heur"]["decisions"]["declined_seeds"] == [1, 2]
    assert arms["api"]["decisions"]["total"] == {"asked": 4, "applied": 0, "rolled_back": 0, "kept": 0, "failed": 4,
                                                 "timed_out": 0, "failure": arms["api"]["decisions"]["total"]["failure"],
                                                 "failures": 4}
    assert arms["adamw"]["decisions"] is None


def test_compare_prints_the_decision_columns_for_agent_arms_only_and_the_sentence(made):
    shown = made.called("compare", made.lock, "--runs-dir", made.runs)
    assert shown.code == 0, shown.stderr
    out = " ".join(shown.stdout.split())
    assert "agent decisions, summed over seeds" in out
    assert "asked applied rolled back kept failed timed out acted on" in out
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()
            if line.split() and line.split()[0] in ARMS and len(line.split()) >= 8 and line.split()[1] == "4"}
    assert rows["api"][1:8] == ["4", "0", "0", "0", "4", "0", "0/2"]
    assert rows["cli"][1:8] == ["4", "0", "0", "0", "4", "0", "0/2"]
    assert "adamw" not in rows  # a fixed arm has no row of decisions, not a row of zeros
    assert "verdict: agent arm api never acted: 0 of 4 decisions applied, 4 failed" in out
    assert "verdict: agent arm heur never acted: 0 of 2 decisions applied, 2 kept" in out
    assert "timed out: no answer in time" in out and "acted on: the seeds where at least one decision was applied" in out
    assert "identical on" not in out


def test_compare_csv_has_the_decision_columns_empty_on_fixed_arms(made):
    shown = made.called("compare", made.lock, "--runs-dir", made.runs, "--csv")
    assert shown.code == 0, shown.stderr
    rows = list(csv.DictReader(io.StringIO(shown.stdout)))
    api = next(r for r in rows if r["arm"] == "api")
    assert (api["decisions_asked"], api["decisions_applied"], api["decisions_failed"], api["acted_seeds"]) == \
        ("4", "0", "4", "none")
    assert api["verdict"].startswith("agent arm api never acted")
    adamw = next(r for r in rows if r["arm"] == "adamw")
    assert all(adamw[key] == "" for key in ("decisions_asked", "decisions_applied", "decisions_failed", "acted_seeds"))


def test_the_report_page_shows_the_counts_and_the_sentence(made):
    written = made.called("report", made.lock, "--runs-dir", made.runs, "--out", made.root / "page")
    assert written.code == 0, written.stderr
    page = (made.root / "page" / "report.html").read_text()
    assert "Did the agent act?" in page and "seeds acted on" in page
    assert 'data-arm="api" data-field="decisions_failed" data-value="4"' in page
    verdicts = page.split('id="verdicts"')[1].split("</section>")[0]
    assert verdicts.count("agent arm api never acted: 0 of 4 decisions applied, 4 failed") == 1, "said once"
    assert "agent arm heur never acted" in page and "identical on" not in page
    assert "<b>timed out</b>: no answer in time" in page


def test_an_agent_arm_that_acted_on_some_seeds_is_compared_on_those_and_names_the_others(made):
    shown = made.called("compare", made.lock, "--runs-dir", made.runs, "--json")
    assert shown.code == 0, shown.stderr
    result = json.loads(shown.stdout)
    mixed = next(row for row in result["arms"] if row["arm"] == "mixed")
    decisions = mixed["decisions"]
    assert decisions["acted_seeds"] == [1] and decisions["left_out_seeds"] == [2] and decisions["no_verdict"] is None
    assert decisions["seeds"]["1"]["applied"] == 1 and decisions["seeds"]["2"]["failed"] == 2
    figure = mixed["paired"][result["primary"]]
    assert figure["n"] == 1  # seed 2, AdamW alone, is not counted as the agent's result
    assert "Seed 2 left out: the agent of mixed never answered there (0 of 2 decisions applied, 2 failed (the " \
           "claude command failed (exit 1)" in figure["verdict"]
    assert "so that run is AdamW alone." in figure["verdict"]


def test_grid_status_says_what_each_runs_agent_did(made):
    shown = made.called("grid", made.lock, "--status", "--json", "--runs-dir", made.runs)
    assert shown.code == 0, shown.stderr
    agents = {(run["arm"], run["seed"]): run["agent"] for run in json.loads(shown.stdout)["runs"]}
    assert agents == {**{("adamw", s): None for s in SEEDS}, **{("api", s): "never answered" for s in SEEDS},
                      **{("cli", s): "never answered" for s in SEEDS}, **{("heur", s): "only kept" for s in SEEDS},
                      ("mixed", 1): "acted", ("mixed", 2): "never answered"}
    table = made.called("grid", made.lock, "--status", "--runs-dir", made.runs)
    assert "finished (agent never answered)" in table.stdout and "finished (agent acted)" in table.stdout
