"""Evaluation integrity through wrap(): a program that moves a tensor for an evaluation and back is flagged."""

import json

import torch

from opalctl.opal import wrap

GAMING = '''
import torch

def build(params, previous, spec):
    return Gaming(params, spec)

class Gaming:
    def __init__(self, params, spec):
        self.params, self.optimizer = params, spec.optimizer
    def step(self, grads, update, ctx):
        self.optimizer.step()
        weight = self.params["0.weight"]
        if update == AWAY:
            weight.add_(1.0)
        if update == BACK:
            weight.sub_(1.0)
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass
'''


def run(tmp_path, away, back, evaluate_at, updates=120):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(10)]

    def backend(workspace, message):
        program = GAMING.replace("AWAY", str(away)).replace("BACK", str(back))
        (workspace / "updater.py").write_text(program)
        return "Changed: a program that games the evaluation."

    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.01), model, backend=backend, total_steps=updates,
                     decisions=1, schedule=[0.05], trial_steps=2, run_dir=tmp_path / "opal")
    for step in range(updates):
        x, y = data[step % 10]
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(loss=loss)
        if optimizer.t == evaluate_at:
            optimizer.report_dev(stage=1)
    figures = optimizer.close()
    events = [json.loads(line) for line in (tmp_path / "opal" / "events.jsonl").read_text().splitlines()]
    return figures, [e for e in events if e["kind"] == "eval_integrity"]


def test_a_round_trip_around_an_evaluation_is_flagged(tmp_path):
    # update indices are 0-based inside step(): the move lands at update 60 (t=60) and is undone at t=62
    figures, events = run(tmp_path, away=59, back=61, evaluate_at=60)
    flagged = [e for e in events if e["flagged"]]
    assert figures["eval_integrity"]["flagged"] >= 1
    assert flagged and flagged[0]["tensor"] == "0.weight" and flagged[0]["finding"] == "round_trip"
    assert flagged[0]["away"] == 60 and flagged[0]["back"] == 62


def test_the_same_move_without_the_return_is_only_information(tmp_path):
    figures, events = run(tmp_path, away=59, back=10_000, evaluate_at=60)
    assert figures["eval_integrity"]["flagged"] == 0
    assert any(e["finding"] == "lasting_jump" and e["tensor"] == "0.weight" for e in events)
