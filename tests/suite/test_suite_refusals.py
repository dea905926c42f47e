"""``opalctl suite``: bad suite files refused in one sentence naming the file, line and key (exit 2) before anything
is written; a frozen suite whose file or task lock changed refused as a changed input (exit 3); a task given as a
protocol file frozen with its paths made relative to the suite's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.cli import call_cli
from tests.support.files import REPO

ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-2}},
        "slow": {"optimizer": {"name": "AdamW", "lr": 1.0e-4}}}


def suite_text(**changes) -> dict:
    suite = {"name": "small", "seeds": [1, 2], "baseline": "adamw", "arms": ARMS,
             "tasks": {"digits": {"protocol": "project/digits.yaml", "budget": {"clock": "updates", "amount": 40},
                                  "target": {"metric": "selection.loss", "value": 1.0}}}}
    suite.update(changes)
    return suite


def write(folder: Path, suite: dict | str) -> Path:
    path = folder / "suite.yaml"
    path.write_text(suite if isinstance(suite, str) else yaml.safe_dump(suite, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.parametrize(("suite", "words"), [
    (suite_text(baseline="sgd"), "baseline 'sgd' is not an arm of the suite"),
    (suite_text(colour="red"), "colour: unknown key"),
    (suite_text(tasks={"digits": {"builtin": "digits", "protocol": "x.yaml",
                                  "target": {"metric": "selection.loss", "value": 1}}}), "not both"),
    (suite_text(tasks={"digits": {"target": {"metric": "selection.loss", "value": 1}}}), "not neither"),
    (suite_text(tasks={"digits": {"builtin": "digits", "overrides": {"name": "x"},
                                  "target": {"metric": "selection.loss", "value": 1}}}),
     "overrides may replace training, selection, limits, not name"),
    (suite_text(tasks={"digits": {"builtin": "nosuch", "target": {"metric": "selection.loss", "value": 1}}}),
     "there is no built-in task 'nosuch'"),
    (suite_text(arms={"adamw": {"optimiser": {"name": "AdamW"}}}), "arms.adamw.optimiser: unknown key"),
    (suite_text(tasks={"digits": {"protocol": "project/digits.yaml", "target": {"metric": "selection.loss", "value": 1},
                                  "arms": {"fast": {"optimizer": {"name": "AdamW", "lr": 1}}}}}),
     "tasks.digits.arms names 'fast', not an arm of the suite (adamw, slow)"),
    (suite_text(tasks={"digits": {"protocol": "project/digits.yaml", "target": {"metric": "selection.loss", "value": 1},
                                  "arms": {"adamw": {"optimizer": {"name": "AdamW", "lr": 1}, "colour": 1}}}}),
     "tasks.digits.arms.adamw.colour: unknown key"),
    (suite_text(tasks={"digits": {"protocol": "project/digits.yaml", "target": {"metric": "selection.total",
                                                                                "value": 1}}}), "is a count"),
    (suite_text(tasks={"digits": {"protocol": "project/digits.yaml"}}), "give a target"),
    (suite_text(tasks={"digits": {"protocol": "missing.yaml", "target": {"metric": "selection.loss", "value": 1}}}),
     "missing.yaml is not a file"),
])
def test_a_bad_suite_is_refused_in_one_sentence_and_nothing_is_frozen(digits_project, suite, words):
    path = write(digits_project.parent, suite)
    result = call_cli("suite", "freeze", path)
    assert result.code == 2, result.output
    assert words in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not list(digits_project.parent.glob("small/**/*.lock.json"))


def test_a_protocol_task_is_frozen_and_a_changed_suite_or_task_lock_is_refused(digits_project):
    folder = digits_project.parent
    path = write(folder, suite_text())
    result = call_cli("suite", "freeze", path, "--json")
    assert result.code == 0, result.output
    frozen = result.json()
    suite_lock = Path(frozen["suite_lock"])
    assert suite_lock == folder / "small" / "small.suite.lock.json"
    protocol = yaml.safe_load((folder / "small" / "digits" / "small-digits.yaml").read_text())
    # the protocol file's paths, relative to the folder the suite writes its protocol in
    assert protocol["data"]["train"] == "../../project/data/digits/train.npz"
    assert protocol["arms"] == ARMS and protocol["seeds"] == [1, 2]
    assert protocol["target"] == {"metric": "selection.loss", "value": 1.0}
    assert call_cli("verify", folder / "small" / "digits" / "small-digits.lock.json").code == 0
    # freezing again writes the same bytes
    again = call_cli("suite", "freeze", path, "--json")
    assert again.code == 0 and again.json()["outcome"] == "unchanged"

    # the suite lock given with --dir, or a summary before any run: refused in one sentence
    refused = call_cli("suite", "status", suite_lock, "--dir", folder)
    assert refused.code == 2 and "leave --dir out" in refused.stderr
    early = call_cli("suite", "summary", suite_lock, "--runs-dir", folder / "runs")
    assert early.code == 2 and "run the suite first" in early.stderr

    # a changed suite file: its task protocol would differ, so freeze refuses without --force, and the commands
    # that read the suite by its file refuse it as changed
    before = (folder / "small" / "digits" / "small-digits.yaml").read_bytes()
    write(folder, suite_text(seeds=[1]))
    changed = call_cli("suite", "freeze", path)
    assert changed.code == 2 and "pass --force" in changed.stderr
    assert (folder / "small" / "digits" / "small-digits.yaml").read_bytes() == before
    stale = call_cli("suite", "status", path)
    assert stale.code == 3 and "changed since it was frozen" in stale.stderr

    # a task lock frozen again behind the suite's back
    task_lock = folder / "small" / "digits" / "small-digits.lock.json"
    data = json.loads(task_lock.read_text())
    data["environment"]["python"] = "0.0"
    task_lock.write_text(json.dumps(data))
    moved = call_cli("suite", "status", suite_lock)
    assert moved.code == 3 and "is not the one suite lock" in moved.stderr


def test_a_task_may_tune_an_arm_and_the_summary_says_so(digits_project):
    # AlgoPerf's external tuning: an arm's settings tuned per task, replacing the suite's settings of it whole there
    tuned = {"optimizer": {"name": "AdamW", "lr": 3.0e-3, "weight_decay": 1.0, "betas": [0.9, 0.98]}}
    suite = suite_text()
    suite["tasks"]["digits"]["arms"] = {"adamw": tuned}
    path = write(digits_project.parent, suite)
    frozen = call_cli("suite", "freeze", path, "--json")
    assert frozen.code == 0, frozen.output
    protocol = yaml.safe_load((digits_project.parent / "small" / "digits" / "small-digits.yaml").read_text())
    assert list(protocol["arms"]) == ["adamw", "slow"]
    assert protocol["arms"] == {"adamw": tuned, "slow": ARMS["slow"]}
    lock = json.loads(Path(frozen.json()["suite_lock"]).read_text())
    assert lock["suite"]["tasks"]["digits"]["arms"] == {"adamw": tuned}

    from opalctl.suite.spec import tuned_per_task
    from opalctl.suite.summary import statement

    assert tuned_per_task(lock["suite"]["tasks"]) == {"adamw": ["digits"]}
    summary = {"tasks": {"digits": {"fractions": [0.5, 1.0], "compare": {"arms": [{"arm": "adamw", "seeds": [1]}]}}},
               "arms": ["adamw", "slow"], "seeds": [1], "seed_scores": {"adamw": {"1": 1.0}, "slow": {"1": 0.0}},
               "baseline": "adamw", "scores": {"adamw": 1.0, "slow": 0.0},
               "tuned_per_task": {"adamw": ["digits"]}}
    assert any(sentence.startswith("Arm adamw runs with its own settings on digits") and "tuned per task" in sentence
               for sentence in statement(summary))


def test_an_agent_arm_without_its_key_is_refused_before_any_run(digits_project, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    arms = {**ARMS, "llm": {"optimizer": {"name": "AdamW", "lr": 1.0e-2},
                            "agent": {"backend": "anthropic", "decisions": 2}}}
    path = write(digits_project.parent, suite_text(arms=arms))
    frozen = call_cli("suite", "freeze", path)
    assert frozen.code == 0, frozen.output
    assert "warning: task digits: arm llm" in frozen.stderr
    refused = call_cli("suite", "run", path, "--runs-dir", digits_project.parent / "runs")
    assert refused.code == 2, refused.output
    assert "suite small: arm llm" in refused.stderr and "comment the arm out" in refused.stderr
    assert not (digits_project.parent / "runs").exists()


def test_the_shipped_suite_is_valid_on_the_updates_clock_with_each_tasks_own_metrics():
    import yaml as yaml_module

    from opalctl.suite.spec import load_suite
    from opalctl.tasks import BUILTIN, make_task
    from opalctl.tasks.builtin import protocol_text

    suite, _ = load_suite(REPO / "protocols" / "suite.yaml")
    assert set(suite.tuned_per_task()) <= {suite.baseline}  # only the baseline is tuned per task
    for name, task in suite.tasks.items():
        assert task.builtin is not None and task.budget["clock"] == "updates", name
        template = yaml_module.safe_load(protocol_text(task.builtin, [1]))["task"]["config"]
        metrics = make_task(BUILTIN[task.builtin], {**template, **task.config}).metrics
        split, metric = task.target.metric.split(".")
        assert split == "selection" and metric in metrics, name
