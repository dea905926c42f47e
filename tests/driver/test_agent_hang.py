"""A formal run whose agent program hangs and swallows the time-limit interrupt: the watchdog ends ``opalctl run``
with exit code 4, a sentence naming the version and how to continue, ``opal/hung.jsonl`` and a ``reverted``
event; ``opalctl run ... --resume`` then finishes the run with that version marked failed, having lost at most
one resume-checkpoint interval.

The hostile program reaches the run through the ``replay`` backend (a recorded "original" run whose decision 1
applied it). The protocol's ``agent.step_time_limit`` shortens the limit (``LIMIT``), so that the hang is found in
about a second and a half instead of twenty (the limit and the grace past it), and the test checks the hang record
names it.
"""

from __future__ import annotations

import json

import pytest

from opalctl import checkpoints
from opalctl.errors import EXIT_PROGRAM_HUNG
from tests import support

AMOUNT = 300  # updates; a resume checkpoint every 15
EVERY = AMOUNT // 20
LIMIT = 0.5  # seconds: the agent's step time limit in these runs (agent.step_time_limit)
HANGING_UPDATER = '''"""SGD that hangs at its HANG_AT-th step, swallowing every interrupt."""

import torch

HANG_AT = {hang_at}


def build(params, previous, spec):
    return Updater(params)


class Updater:
    def __init__(self, params):
        self.params = params
        self.count = 0

    def step(self, grads, update, ctx):
        self.count += 1
        while self.count >= HANG_AT:
            try:
                while True:
                    pass
            except BaseException:
                pass
        for name, p in self.params.items():
            if grads[name] is not None:
                p.sub_(grads[name] * 0.01)

    def state_dict(self):
        return {{"count": self.count}}

    def load_state_dict(self, state):
        self.count = int(state["count"])
'''


def recorded_original(folder, updater: str):
    """An agent run's records whose decision 1 applied ``updater`` (what ``replay:`` reads)."""
    from opalctl.opal.optimizer import default_sources

    records = folder / "training" / "opal"
    (records / "programs" / "v001").mkdir(parents=True)
    (records / "programs" / "v001" / "updater.py").write_text(updater)
    (records / "programs" / "v001" / "analysis.py").write_text(default_sources()["analysis.py"])
    (records / "events.jsonl").write_text(json.dumps({"kind": "applied", "decision": 1, "version": 1}) + "\n")
    return folder


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("hang_at", [1, 40], ids=["at_its_first_step", "after_its_trial"])
def test_a_hang_ends_the_run_with_exit_4_and_resume_continues_without_that_version(project, tmp_path,
                                                                                  hang_at):
    original = recorded_original(tmp_path / "original", HANGING_UPDATER.format(hang_at=hang_at))
    agent = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01},
             "agent": {"backend": f"replay:{original}", "decisions": 8, "step_time_limit": LIMIT}}
    project.freeze(budget={"clock": "updates", "amount": AMOUNT}, training={"checkpoint_every": 0.05},
                   arms={"agent": agent},
                   selection={"denominators": ["selection.total", "retention.total"],
                              "floors": {"retention.correct": 10}, "improve_any": ["selection.correct"]})
    run_dir = project.run_dir("agent", 1)

    hung = project.process(project.run_args("agent", 1))
    assert hung.returncode == EXIT_PROGRAM_HUNG, hung.stderr[-3000:]
    assert "v001 hung in step()" in hung.stderr and "--resume`" in hung.stderr
    [entry] = [json.loads(line) for line in (run_dir / "training" / "opal" / "hung.jsonl").read_text().splitlines()]
    assert entry["version"] == 1 and entry["call"] == "step()" and entry["limit"] == LIMIT
    assert events(run_dir)[-1]["kind"] == "reverted" and events(run_dir)[-1]["reason"] == "hung"
    assert not (run_dir / "report.json").exists()
    resumed_from = checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)["meta"]["update"]
    assert entry["update"] - resumed_from <= EVERY, "at most one checkpoint interval is lost"

    finished = project.process(project.run_args("agent", 1, "--resume"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = support.read(run_dir / "report.json")
    assert report["updates"] == AMOUNT and report["agent"]["version"] == 0
    after = events(run_dir)
    after = after[max(i for i, e in enumerate(after) if e["kind"] == "resumed"):]
    # the checkpoint holds the version running (it was applied before it): it hands over to its fallback at once;
    # had the checkpoint come before the decision, the same programs proposed again would be refused
    assert after[1]["kind"] == "reverted" and after[1]["reason"] == "hung" and after[1]["version"] == 1
    assert "never loaded again" in after[1]["message"]
    assert not any(e["kind"] in ("applied", "trial_passed") and e.get("version") == 1 for e in after)
