"""The learning rate each update's step used, in every line of ``steps.jsonl.gz`` (``lrs``, one per parameter
group): the budget schedule's for a fixed arm, the one an agent's program scaled it to for an agent arm (the
starting program scales the groups only around the step, which a reading after the update would miss), and the
``keep`` agent's the fixed arm's, bit for bit, as its weights are, with a schedule and with parameter groups (each
group's own learning rate times the schedule's factor; an agent's program scales every group alike). The agent's analysis sees the same learning
rates (``obs["lrs"]``: one definition, ``opal.observer.StepLearningRates``)."""

from __future__ import annotations

import math

import pytest

from opalctl.driver.arm import schedule_factor
from opalctl.driver.records import read_steps
from tests import support
from tests.support.cli import call_cli

AMOUNT = 100  # the analysis runs every 25 updates: its reports at 25, 50, 75 and 100
LR = 1.0e-3
ADAMW = {"optimizer": {"name": "AdamW", "lr": LR, "weight_decay": 0.01}}
# nanoGPT's recipe: a linear warm-up (here a tenth of the budget), then cosine down to a tenth of the peak
RECIPE = {"name": "cosine", "warmup": 0.1, "min_lr": 0.1}
WSD = {"name": "wsd", "warmup": 0.05, "decay": 0.3, "decay_shape": "sqrt"}
# the digits model is Linear(64, h), ReLU, Linear(h, 10): the last layer at half the learning rate, the first
# layer's bias without weight decay, the first layer's weights (the rest) as the optimizer says
GROUPS = [{"match": ["2.*"], "lr_scale": 0.5}, {"match": ["bias"], "weight_decay": 0.0}]
ARMS = {"adamw": ADAMW, "cosine": {**ADAMW, "schedule": "cosine"},
        "keep": {**ADAMW, "agent": {"backend": "keep", "decisions": 2}},
        "agent": {**ADAMW, "agent": {"backend": "heuristic", "decisions": 4}},
        "recipe": {**ADAMW, "schedule": RECIPE},
        "recipe-keep": {**ADAMW, "schedule": RECIPE, "agent": {"backend": "keep", "decisions": 2}},
        "wsd": {**ADAMW, "schedule": WSD},
        "grouped": {**ADAMW, "schedule": RECIPE, "groups": GROUPS},
        "grouped-keep": {**ADAMW, "schedule": RECIPE, "groups": GROUPS,
                         "agent": {"backend": "keep", "decisions": 2}},
        "grouped-agent": {**ADAMW, "groups": GROUPS, "agent": {"backend": "heuristic", "decisions": 4}}}


@pytest.fixture(scope="module")
def project(digits_template, tmp_path_factory):
    patch = pytest.MonkeyPatch()
    made = support.Project(digits_template, tmp_path_factory.mktemp("lrs") / "project", patch)
    made.freeze(budget={"clock": "updates", "amount": AMOUNT}, arms=ARMS)
    for arm in ARMS:
        made.run(arm, 1)
    yield made
    patch.undo()


def steps(project, arm):
    return list(read_steps(project.run_dir(arm, 1) / "training" / "steps.jsonl.gz"))


def test_a_fixed_arms_lines_hold_the_schedules_learning_rate_of_each_group(project):
    assert [s["lrs"] for s in steps(project, "adamw")] == [[LR]] * AMOUNT
    fractions = [(s["update"] - 1) / AMOUNT for s in steps(project, "cosine")]  # the budget used before the update
    assert [s["lrs"] for s in steps(project, "cosine")] == [[LR * schedule_factor("cosine", f)] for f in fractions]


def assert_same_run(project, arm: str, fixed: str) -> None:
    """``arm``'s steps lines (but their wall times) and final weights are ``fixed``'s, bit for bit."""
    assert [{k: v for k, v in s.items() if k != "wall"} for s in steps(project, arm)] == \
        [{k: v for k, v in s.items() if k != "wall"} for s in steps(project, fixed)]
    assert support.read(project.run_dir(arm, 1) / "report.json")["final_model_sha256"] == \
        support.read(project.run_dir(fixed, 1) / "report.json")["final_model_sha256"]


def test_the_keep_agents_learning_rates_weights_and_lines_are_the_fixed_arms(project):
    assert_same_run(project, "keep", "adamw")


def test_an_agent_arms_lines_hold_the_learning_rate_its_program_scaled_for_the_step(project):
    import json

    events = [json.loads(line) for line in
              (project.run_dir("agent", 1) / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    applied = [e for e in events if e["kind"] == "applied"]
    assert applied, "the heuristic agent changes the program in this protocol"
    lines = steps(project, "agent")
    first = applied[0]["update"]
    assert [s["lrs"] for s in lines[:first]] == [[LR]] * first, "the starting program: the optimizer's own"
    # the optimizer's own learning rate stays LR (the program scales it only around its step), so any other value
    # in a line is the program's scaling, seen only inside the step
    assert any(s["lrs"] != [LR] for s in lines[first:]), [s["lrs"] for s in lines[first:]]


def test_the_agents_analysis_sees_the_learning_rate_the_step_used(project):
    import json

    lines = {s["update"]: s["lrs"] for s in steps(project, "agent")}
    reports = [json.loads(line) for line in
               (project.run_dir("agent", 1) / "training" / "opal" / "reports.jsonl").read_text().splitlines()]
    assert [r["update"] for r in reports] == [25, 50, 75, 100]
    assert [r["report"]["lrs"] for r in reports] == [lines[r["update"]] for r in reports]
    assert reports[-1]["report"]["lrs"][0] < LR, "annealed at the last analysis: the analysis sees the scaling"


def _recipe_by_hand(fraction: float) -> float:
    if fraction < 0.1:
        return fraction / 0.1
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * (fraction - 0.1) / 0.9))


def _wsd_by_hand(fraction: float) -> float:
    if fraction < 0.05:
        return fraction / 0.05
    into = ((fraction - 0.05) / 0.95 - 0.7) / 0.3
    return 1.0 if into <= 0 else 1.0 - math.sqrt(min(into, 1.0))


@pytest.mark.parametrize(("arm", "by_hand"), [("recipe", _recipe_by_hand), ("wsd", _wsd_by_hand)])
def test_a_warm_up_a_floor_and_wsd_give_each_update_the_learning_rate_of_their_formula(project, arm, by_hand):
    lines = steps(project, arm)
    assert len(lines) == AMOUNT
    for line in lines:
        expected = LR * by_hand((line["update"] - 1) / AMOUNT)
        assert line["lrs"] == [pytest.approx(expected, rel=1e-12, abs=1e-18)], line
    assert lines[0]["lrs"] == [0.0] and max(line["lrs"][0] for line in lines) == pytest.approx(LR)


def test_the_keep_agent_keeps_a_recipes_schedule_bit_for_bit(project):
    assert_same_run(project, "recipe-keep", "recipe")


def test_each_group_steps_at_its_own_rate_times_the_schedules_factor(project):
    lines = steps(project, "grouped")
    for line in lines:
        factor = _recipe_by_hand((line["update"] - 1) / AMOUNT)
        assert line["lrs"] == [pytest.approx(LR * 0.5 * factor, rel=1e-12, abs=1e-18),
                               pytest.approx(LR * factor, rel=1e-12, abs=1e-18),
                               pytest.approx(LR * factor, rel=1e-12, abs=1e-18)], line
    start = support.read(project.run_dir("grouped", 1) / "start.json")
    assert [(g["parameters"], g["lr"], g["weight_decay"]) for g in start["groups"]] == [
        (["2.weight", "2.bias"], LR * 0.5, 0.01), (["0.bias"], LR, 0.0), (["0.weight"], LR, 0.01)]
    assert "groups" not in support.read(project.run_dir("recipe", 1) / "start.json")


def test_the_keep_agent_keeps_every_group_bit_for_bit(project):
    assert_same_run(project, "grouped-keep", "grouped")


def test_an_agents_program_scales_every_group_alike(project):
    import json

    events = [json.loads(line) for line in
              (project.run_dir("grouped-agent", 1) / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["kind"] == "applied"], "the heuristic agent changes the program here"
    lines = steps(project, "grouped-agent")
    assert any(s["lrs"][1] != LR for s in lines), "the program scaled the learning rates"
    for line in lines:
        half, first_bias, rest = line["lrs"]
        assert first_bias == rest and half == pytest.approx(0.5 * rest, rel=1e-12), line


def test_a_grouped_run_killed_mid_update_resumes_to_the_uninterrupted_runs_lines_and_weights(
        project, digits_template, tmp_path, monkeypatch):
    """Each group's base learning rate and state come back from the resume checkpoint: killed at update 57 (the
    last resume checkpoint at 50), resumed, the run ends with the lines and weights of the run never killed."""
    import signal

    killable = support.Project(digits_template, tmp_path / "killable", monkeypatch)
    killable.freeze(entry=killable.task_module(support.KILLABLE_TASK, "KillableDigits"),
                    budget={"clock": "updates", "amount": AMOUNT}, arms={"grouped": ARMS["grouped"]})
    killed = killable.process(killable.run_args("grouped", 1), env=killable.env(KILL_LOSS_AT="57"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    code, _, err = call_cli(*killable.run_args("grouped", 1, "--resume"))
    assert code == 0, err[-3000:]
    resumed = list(read_steps(killable.run_dir("grouped", 1) / "training" / "steps.jsonl.gz"))
    assert [{k: v for k, v in s.items() if k != "wall"} for s in resumed] == \
        [{k: v for k, v in s.items() if k != "wall"} for s in steps(project, "grouped")]
    assert support.read(killable.run_dir("grouped", 1) / "report.json")["final_model_sha256"] == \
        support.read(project.run_dir("grouped", 1) / "report.json")["final_model_sha256"]
