"""Formal runs whose agent program made what a resume checkpoint cannot hold, with no way past the static check:
a ``state_dict()`` holding a meta tensor, a function left in the user's optimizer, an analysis memory holding a
dict subclass whose ``items()`` never returns. Before, the first ended the run in an internal error at its next
resume checkpoint (every ``--resume`` failing the same way) and the last hung it there, outside every guard. Now
each is the program's failure at that checkpoint: the version is reverted with an event saying why, the
checkpoint is written without what it made, the run finishes, and a run killed after that checkpoint resumes
from it and finishes.

The programs reach the runs through the ``replay`` backend: a recorded "original" run whose decision 1 applied
them. The task kills its own training process at a chosen loss call (``KILL_LOSS_AT``), as a SIGKILL would. Each
case's run is made once for the module (``finished``).
"""

from __future__ import annotations

import json
import signal

import pytest

from opalctl import checkpoints
from tests import support
from tests.support.cli import call_cli

AMOUNT = 300  # updates; decision 1 at update 15, a resume checkpoint every 18 (the new version steps before one)
CHECKPOINT_EVERY = 0.06
SGD = '''
import torch


class Endless(dict):
    def items(self):
        while True:
            pass


def build(params, previous, spec):
{build_body}
    return Updater(params)


class Updater:
    def __init__(self, params):
        self.params = params
        self.count = 0

    def step(self, grads, update, ctx):
        self.count += 1
        for name, p in self.params.items():
            if grads[name] is not None:
                p.sub_(grads[name] * 0.01)

    def state_dict(self):
        return {state}

    def load_state_dict(self, state):
        pass
'''
PROGRAMS = {  # case: (updater.py, analysis.py or None for the default, words of the reverted event's message)
    "meta_tensor_in_state_dict": (
        SGD.format(build_body="    pass", state="{'count': self.count, 'm': torch.empty(2, device='meta')}"), None,
        ["state_dict()", "meta device"]),
    "function_left_in_the_users_optimizer": (
        SGD.format(build_body="    first = spec.optimizer.param_groups[0]['params'][0]\n"
                              "    spec.optimizer.state[first]['f'] = lambda: 1", state="{'count': self.count}"), None,
        ["user's optimizer", "state of parameter 0", "function"]),
    "analysis_memory_with_endless_items": (
        SGD.format(build_body="    pass", state="{'count': self.count}"),
        "EVERY = 5\n\n\nclass Endless(dict):\n    def items(self):\n        while True:\n            pass\n\n\n"
        "def analyze(obs, memory):\n    memory['trap'] = Endless(a=1)\n    return {'report': {'update': obs['update']}}\n",
        ["analysis memory", "Endless", "cleared"]),
}


def opal_records(run_dir):
    """Where a formal run keeps the agent optimizer's records (the one place that knows)."""
    return run_dir / "training" / "opal"


def recorded_original(records, updater: str, analysis: str | None):
    """An agent run's records whose decision 1 applied these programs (what ``replay:`` reads)."""
    from opalctl.opal.optimizer import default_sources

    folder = records / "programs" / "v001"
    folder.mkdir(parents=True)
    (folder / "updater.py").write_text(updater)
    (folder / "analysis.py").write_text(analysis or default_sources()["analysis.py"])
    (records / "events.jsonl").write_text(json.dumps({"kind": "applied", "decision": 1, "version": 1}) + "\n")
    return records


def events(run_dir):
    return [json.loads(line) for line in (opal_records(run_dir) / "events.jsonl").read_text().splitlines()]


def frozen(project, folder, case):
    updater, analysis, _ = PROGRAMS[case]
    original = recorded_original(folder / "original", updater, analysis)
    agent = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01},
             "agent": {"backend": f"replay:{original}", "decisions": 8}}
    project.freeze(entry=project.task_module(support.KILLABLE_TASK, "KillableDigits"),
                   budget={"clock": "updates", "amount": AMOUNT}, training={"checkpoint_every": CHECKPOINT_EVERY},
                   arms={"agent": agent},
                   selection={"denominators": ["selection.total", "retention.total"],
                              "floors": {"retention.correct": 10}, "improve_any": ["selection.correct"]})


# the case whose program, were the check at the checkpoint to call into it, would never return: its run is a child
# process (a hang is then this test's failure, not the test session's); the others run in this process
IN_A_CHILD = {"analysis_memory_with_endless_items"}


@pytest.fixture(scope="module")
def finished(made_project):
    """``finished(case)``: the project frozen on ``case``'s programs and ``opalctl run`` of ``agent`` on seed 1,
    ``(project, exit code, stderr)``, made once for the module (the killed run's test reads the meta-tensor case's
    as its uninterrupted run); read-only."""
    made = {}

    def of(case):
        if case not in made:
            project = made_project(f"unsaveable-{case}")
            frozen(project, project.folder.parent, case)
            if case in IN_A_CHILD:
                result = project.process(project.run_args("agent", 1))
                made[case] = (project, result.returncode, result.stderr)
            else:
                code, _, stderr = call_cli(*project.run_args("agent", 1))
                made[case] = (project, code, stderr)
        return made[case]

    return of


def the_revert(run_dir, words) -> dict:
    """The one ``reverted`` event of a finished run: version 1, after it stepped, saying why."""
    [applied] = [e for e in events(run_dir) if e["kind"] == "applied"]
    [reverted] = [e for e in events(run_dir) if e["kind"] == "reverted"]
    assert reverted["version"] == 1 and reverted["to"] == 0 and reverted["update"] > applied["update"], reverted
    assert all(word in reverted["message"] for word in words), reverted["message"]
    return reverted


def untimed(figures: dict) -> dict:
    return {key: value for key, value in figures.items() if "seconds" not in key}


def assert_finished(run_dir):
    report = support.read(run_dir / "report.json")
    assert report["updates"] == AMOUNT and report["agent"]["version"] == 0
    assert report["agent"]["decisions_reverted"] == 1
    seconds = report["agent"]["agent_code_seconds"]
    assert seconds["inside_updates"]["cpu"] > 0 and seconds["outside_updates"]["wall"] > 0
    assert not (run_dir / "training" / "resume.pt").exists()


@pytest.mark.parametrize("case", sorted(PROGRAMS))
def test_what_a_checkpoint_cannot_hold_reverts_the_program_and_the_run_finishes(finished, case):
    project, code, stderr = finished(case)
    run_dir = project.run_dir("agent", 1)
    assert code == 0, stderr[-3000:]
    assert_finished(run_dir)
    the_revert(run_dir, PROGRAMS[case][2])


def test_a_run_killed_after_the_checkpoint_that_reverted_the_program_resumes_and_finishes(finished, tmp_path):
    case = "meta_tensor_in_state_dict"
    project, code, stderr = finished(case)
    first = project.run_dir("agent", 1)
    assert code == 0, stderr[-3000:]
    reverted_at = the_revert(first, PROGRAMS[case][2])["update"]

    # the same run again, killed two updates after the checkpoint that reverted the program
    runs = tmp_path / "killed"
    run_dir = project.run_dir("agent", 1, runs=runs)
    killed = project.process(project.run_args("agent", 1, runs=runs), env=project.env(KILL_LOSS_AT=str(reverted_at + 3)))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)
    state = saved["extra"]["optimizer"]
    assert saved["meta"]["update"] == reverted_at and state["current"] == 0
    assert [v["status"] for v in state["versions"]] == ["passed", "failed"]

    resumed = project.process(project.run_args("agent", 1, "--resume", runs=runs))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_finished(run_dir)
    the_revert(run_dir, PROGRAMS[case][2])  # reverted once, before the kill; never loaded again after it
    after = events(run_dir)
    after = after[max(i for i, e in enumerate(after) if e["kind"] == "resumed"):]
    assert not any(e["kind"] in ("applied", "reverted", "trial_passed") for e in after)
    assert untimed(support.read(run_dir / "report.json")["agent"]) == untimed(support.read(first / "report.json")["agent"])
