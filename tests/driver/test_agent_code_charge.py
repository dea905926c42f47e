"""Agent code that runs outside the timed updates is never off the budget: a program's ``build()`` at a decision
(and its ``state_dict()`` at a checkpoint, its ``load_state_dict()`` at a resume) is charged with the next update
on the clocks that charge time, and on the ``updates`` clock, which charges no time, it is recorded in the report's
agent figures for compare to show beside the updates.

Before, ``build()`` ran under ``Ledger.outside``: a program could train the model there for as long as it liked and
the report said it spent nothing. The program here burns a third of a CPU second or more in ``build()``; it reaches
the run through the ``replay`` backend (a recorded "original" whose decision 1 applied it).
"""

from __future__ import annotations

import json

from opalctl.driver.records import read_steps

BURNING_UPDATER = '''
import math


def build(params, previous, spec):
    total = 0.0
    for i in range(1, 10_000_000):  # 0.3 to 1.3 CPU-s on the hosts the suite has run on: 3x the 0.1 asked below
        total += math.sqrt(i)
    return Updater(params, total)


class Updater:
    def __init__(self, params, total):
        self.params = params
        self.total = total

    def step(self, grads, update, ctx):
        for name, p in self.params.items():
            if grads[name] is not None:
                p.sub_(grads[name] * 0.01)

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = float(state["total"])
'''


def recorded_original(records, updater: str):
    from opalctl.opal.optimizer import default_sources

    folder = records / "programs" / "v001"
    folder.mkdir(parents=True)
    (folder / "updater.py").write_text(updater)
    (folder / "analysis.py").write_text(default_sources()["analysis.py"])
    (records / "events.jsonl").write_text(json.dumps({"kind": "applied", "decision": 1, "version": 1}) + "\n")
    return records


def frozen(project, tmp_path, budget):
    original = recorded_original(tmp_path / "original", BURNING_UPDATER)
    agent = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "agent": {"backend": f"replay:{original}", "decisions": 1,
                                                                     "schedule": [0.2]}}
    project.freeze(budget=budget, arms={"agent": agent})


def applied_at(run_dir) -> int:
    events = [json.loads(line) for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    [applied] = [event for event in events if event["kind"] == "applied"]
    return applied["update"]


def test_a_programs_build_is_charged_with_the_next_update_on_the_cpu_clock(project, tmp_path):
    frozen(project, tmp_path, {"clock": "cpu", "amount": 3.0})
    report = project.run("agent", 1)
    run_dir = project.run_dir("agent", 1)
    outside = report["agent"]["agent_code_seconds"]["outside_updates"]
    assert outside["cpu"] > 0.1, outside
    at = applied_at(run_dir)
    charges = {line["update"]: line["charge"] for line in read_steps(run_dir / "training" / "steps.jsonl.gz")}
    # the update after the decision carries the build's CPU seconds beside its own; no other comes near
    assert charges[at + 1] >= outside["cpu"] * 0.9, (charges[at + 1], outside)
    assert max(charge for update, charge in charges.items() if update != at + 1) < outside["cpu"] / 2
    assert report["budget"]["used"] == sum(charges.values())


def test_on_the_updates_clock_it_is_recorded_and_every_update_still_costs_one(project, tmp_path):
    frozen(project, tmp_path, {"clock": "updates", "amount": 100})
    report = project.run("agent", 1)
    run_dir = project.run_dir("agent", 1)
    assert {line["charge"] for line in read_steps(run_dir / "training" / "steps.jsonl.gz")} == {1.0}
    assert report["updates"] == 100
    assert report["agent"]["agent_code_seconds"]["outside_updates"]["cpu"] > 0.1
