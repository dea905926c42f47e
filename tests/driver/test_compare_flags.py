"""A formal run whose agent program moves the weights for the stage checkpoints only (it knows from the update count
when a stage is saved) is flagged by the evaluation-integrity check, and ``compare`` says so on its own line and at
the end of the arm's verdict. Before, report.json and ``show`` flagged it and compare said nothing.

The program reaches the run through the ``replay`` backend (a recorded "original" whose decision 1 applied it).
"""

from __future__ import annotations

import json

from tests import support
from tests.support.cli import call_cli

AMOUNT = 100  # updates; stages at 25, 50, 75, 100
SWAPPING_UPDATER = '''
import torch

STAGES = (25, 50, 75, 100)


def build(params, previous, spec):
    return Updater(params)


class Updater:
    def __init__(self, params):
        self.params = params
        self.moved = False

    def step(self, grads, update, ctx):
        with torch.no_grad():
            for name, p in self.params.items():
                if grads[name] is not None:
                    p.sub_(grads[name] * 0.01)
            if self.moved:
                for p in self.params.values():
                    p.sub_(0.5)
                self.moved = False
            elif update + 1 in STAGES[:-1]:
                for p in self.params.values():
                    p.add_(0.5)
                self.moved = True

    def state_dict(self):
        return {"moved": self.moved}

    def load_state_dict(self, state):
        self.moved = bool(state["moved"])
'''


def test_weights_moved_for_the_stage_checkpoints_only_are_flagged_in_compare_and_its_verdict(project, tmp_path):
    from opalctl.opal.optimizer import default_sources

    original = tmp_path / "original"
    (original / "programs" / "v001").mkdir(parents=True)
    (original / "programs" / "v001" / "updater.py").write_text(SWAPPING_UPDATER)
    (original / "programs" / "v001" / "analysis.py").write_text(default_sources()["analysis.py"])
    (original / "events.jsonl").write_text(json.dumps({"kind": "applied", "decision": 1, "version": 1}) + "\n")
    swapper = {**support.ADAMW, "agent": {"backend": f"replay:{original}", "decisions": 1, "schedule": [0.05]}}
    project.freeze(budget={"clock": "updates", "amount": AMOUNT}, arms={"adamw": support.ADAMW, "swapper": swapper})
    project.run("adamw", 1)
    report = project.run("swapper", 1)
    assert report["agent"]["eval_integrity"]["flagged"] >= 1, report["agent"]["eval_integrity"]
    result = call_cli("compare", project.lock, "--runs-dir", project.runs, "--json")
    [row] = [row for row in json.loads(result.stdout)["arms"] if row["arm"] == "swapper"]
    assert any(flag.startswith("evaluation integrity") for flag in row["flags"]), row["flags"]
    assert all("Flagged: evaluation integrity" in figure["verdict"] for figure in row["paired"].values())
    shown = call_cli("compare", project.lock, "--runs-dir", project.runs)
    assert "flagged: swapper: evaluation integrity: a program moved the parameters" in shown.stdout, shown.output
