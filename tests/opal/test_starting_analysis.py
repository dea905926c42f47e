"""The released starting analysis (``defaults/analysis.py``): its per-role figures against direct torch
computations, and when it wakes the agent (a spike, a non-finite loss) and when it does not."""

from __future__ import annotations

import math

import pytest
import torch

from opalctl.opal.optimizer import default_sources
from opalctl.opal.programs import load_program
from opalctl.opal.roles import role_of

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def analysis():
    return load_program("analysis", default_sources()["analysis.py"], label="test/analysis").module


def observation(losses, dtype=torch.float32, momentum=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if momentum else 0.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 6).to(dtype)).square().mean().backward()
        before = {name: p.detach().clone() for name, p in params.items()}
        optimizer.step()
    obs = {"update": 50, "progress": 0.5, "losses": list(losses), "params": params, "before": before,
           "grads": {name: p.grad for name, p in params.items()},
           "state": {name: optimizer.state.get(p, {}) for name, p in params.items()},
           "roles": {name: role_of(name, tuple(p.shape)) for name, p in params.items()}, "lrs": [0.1]}
    return obs


def test_role_figures_match_direct_computations(analysis):
    obs = observation([1.0] * 25)
    with torch.no_grad():
        report = analysis.analyze(obs, {})["report"]
    for role in set(obs["roles"].values()):
        members = [n for n, r in obs["roles"].items() if r == role]
        weight = math.sqrt(sum(float(obs["params"][n].detach().double().norm()) ** 2 for n in members))
        update = math.sqrt(sum(float((obs["params"][n].detach() - obs["before"][n]).double().norm()) ** 2 for n in members))
        grad = math.sqrt(sum(float(obs["grads"][n].double().norm()) ** 2 for n in members))
        cosines = [float(torch.nn.functional.cosine_similarity(
            obs["grads"][n].double().reshape(1, -1),
            obs["state"][n]["momentum_buffer"].double().reshape(1, -1))) for n in members]
        figures = report["roles"][role]
        assert figures["tensors"] == len(members)
        assert figures["weight_norm"] == pytest.approx(weight, rel=1e-5)
        assert figures["update_to_weight"] == pytest.approx(update / weight, rel=1e-4)
        assert figures["grad_norm"] == pytest.approx(grad, rel=1e-5)
        assert figures["grad_momentum_cosine"] == pytest.approx(sum(cosines) / len(cosines), abs=1e-3)


def test_mixed_precision_parameters_and_no_momentum_are_handled(analysis):
    obs = observation([1.0] * 25, dtype=torch.bfloat16, momentum=False)
    with torch.no_grad():
        roles = analysis.analyze(obs, {})["report"]["roles"]
    assert all(figures["grad_momentum_cosine"] is None for figures in roles.values())
    assert all(figures["weight_norm"] > 0 for figures in roles.values())


@pytest.mark.parametrize("last, wakes", [(9.0, True), (1.4, False), (float("nan"), True)])
def test_a_spike_or_a_non_finite_loss_wakes_the_agent_and_a_small_rise_does_not(analysis, last, wakes):
    memory: dict = {}
    ordinary = observation([1.0 + 0.01 * (i % 3) for i in range(25)])
    with torch.no_grad():
        for _ in range(3):  # 75 ordinary losses first: the spike test needs 50 in its window
            assert "wake" not in analysis.analyze(ordinary, memory)
        out = analysis.analyze({**ordinary, "losses": [1.0] * 24 + [last]}, memory)
    assert ("wake" in out) is wakes


def test_role_figures_are_measured_every_fourth_call_and_the_report_says_when(analysis):
    memory: dict = {}
    obs = observation([1.0] * 25)
    updates = []
    with torch.no_grad():
        for call in range(6):
            report = analysis.analyze({**obs, "update": 25 * (call + 1)}, memory)["report"]
            updates.append(report["roles_update"])
            assert set(report["roles"]) == set(obs["roles"].values())
    assert updates == [25, 25, 25, 25, 125, 125]
