"""``opalctl demo``: its protocol (what `protocols/demo.yaml` holds, and it freezes), its verdict in words, its
progress lines, and the time it is held to, said the same way by ``demo --help`` and the README. The demo itself
runs a grid of twelve formal runs: `make demo` runs it, the suite does not."""

import shutil
from pathlib import Path

import pytest
import yaml

from opalctl import demo
from opalctl.compare.statistics import paired
from opalctl.compare.verdict import verdict as compare_verdict
from tests.support.cli import call_cli

REPO = Path(__file__).resolve().parents[1]


def test_demo_help_and_the_readme_say_the_same_time():
    shown = call_cli("demo", "--help")
    assert shown.code == 0
    assert demo.DURATION in " ".join(shown.stdout.split())
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count(demo.DURATION) >= 2, "the first lines and the command table"
    assert "about 10 minutes" not in readme


def test_the_shipped_demo_protocol_is_what_the_demo_writes():
    assert (REPO / "protocols" / "demo.yaml").read_text(encoding="utf-8") == demo.DEMO_PROTOCOL


def test_the_demo_protocol_has_a_control_for_the_agents_schedule_and_a_reproducible_clock(digits_init_folder,
                                                                                         tmp_path):
    protocol = yaml.safe_load(demo.DEMO_PROTOCOL)
    assert protocol["name"] != "digits", "its runs must not meet the README's first session (runs/digits-SHA12)"
    assert protocol["budget"]["clock"] == "updates"
    arms = protocol["arms"]
    agent = next(a for a in arms.values() if "agent" in a)
    assert agent["agent"]["backend"] == "heuristic"
    same_start = [a for a in arms.values() if a["optimizer"] == agent["optimizer"] and "agent" not in a]
    # the heuristic's one schedule (ANNEAL_START 0.8) is anneal-end; its other moves react to what it sees
    assert {a.get("schedule", "constant") for a in same_start} == {"constant", "anneal-end"}
    assert demo.BASELINE in arms and "schedule" not in arms[demo.BASELINE]
    folder = tmp_path / "demo"
    shutil.copytree(digits_init_folder, folder)  # the session's project has seeds 1 and 2; the demo also runs 3
    shutil.copy(folder / "parents" / "digits" / "seed-2.pt", folder / "parents" / "digits" / "seed-3.pt")
    frozen = call_cli("freeze", demo.write_protocol(folder), "--json")
    assert frozen.code == 0, frozen.output
    assert frozen.json()["arms"] == list(arms)


def test_the_demo_never_overwrites_a_protocol_with_other_contents(tmp_path):
    from opalctl.errors import BadInput

    assert demo.write_protocol(tmp_path).read_text(encoding="utf-8") == demo.DEMO_PROTOCOL
    assert demo.write_protocol(tmp_path) == tmp_path / "demo.yaml"  # the same text again: left alone
    (tmp_path / "demo.yaml").write_text("name: mine\n")
    with pytest.raises(BadInput, match="demo.yaml already exists"):
        demo.write_protocol(tmp_path)
    assert (tmp_path / "demo.yaml").read_text() == "name: mine\n"


def test_the_demo_says_compares_verdict_on_the_primary_metric():
    """One wording of a verdict: the demo prints compare's, not sentences of its own (which once called an arm
    "better" on 3 seeds from the sign of its mean)."""
    values = {"hot": {1: 50, 2: 52, 3: 49}, "tuned": {1: 290, 2: 293, 3: 291}, "same": {1: 50, 2: 52, 3: 49}}
    arms = [{"arm": "hot", "paired": {}}]
    for arm in ("tuned", "same"):
        figure = paired(values["hot"], values[arm], resamples=200)
        figure["verdict"] = compare_verdict(arm, "hot", "selection.correct", figure)
        arms.append({"arm": arm, "paired": {"selection.correct": figure, "development.loss": {"verdict": "other"}}})
    tuned, same = demo.verdict({"primary": "selection.correct", "baseline": "hot", "arms": arms})
    assert tuned.startswith("tuned vs hot on selection.correct: +241 (3 of 3 seeds better), exact p = 0.25")
    assert "the exact test cannot decide with 3 seeds" in tuned and "paired t p = " in tuned
    assert same == "same vs hot on selection.correct: identical on all 3 seeds: no difference at all."


def test_the_progress_lines_say_each_run_once_it_ends():
    said = []
    lines = demo.StateLines(said.append)
    for arm, seed, state in [("a", 1, "queued"), ("a", 2, "queued"), ("a", 1, "running"), ("a", 1, "running"),
                             ("a", 1, "finished"), ("a", 2, "running"), ("a", 2, "failed")]:
        lines({"arm": arm, "seed": seed, "state": state})
    assert [line.strip() for line in said] == ["a seed 1: finished (1 of 2)", "a seed 2: failed (2 of 2)"]
