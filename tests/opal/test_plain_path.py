"""The plain path of ``AgentOptimizer.step`` (the released starting program with nothing else due) must change
nothing anyone can observe: the same weights, the same records, analyses and decisions at the same updates as a
run whose every step takes the full path. Each test runs both and compares them."""

from __future__ import annotations

import json

import pytest
import torch

from opalctl.opal import wrap
from opalctl.opal.optimizer import AgentOptimizer


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _records(folder) -> dict[str, list]:
    """The run's records without what depends on the clock (durations, costs, timestamps); a traceback is kept as
    its last line (the frames above the program's differ between the two paths)."""
    timed = {"seconds", "waiting_seconds", "agent_seconds", "step_seconds", "analysis_seconds", "wall", "time",
             "started", "finished", "cost_usd", "mean_step_seconds", "agent_code_seconds"}

    def clean(value):
        if isinstance(value, dict):
            return {k: (v.strip().splitlines()[-1] if k == "traceback" and v else clean(v))
                    for k, v in value.items() if k not in timed}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    out = {}
    for stream in ("events", "losses", "reports"):
        lines = (folder / f"{stream}.jsonl").read_text().splitlines()
        out[stream] = [clean(json.loads(line)) for line in lines]
    return out


def _train(tmp_path, name: str, plain: bool, updates: int = 260, *, backend="keep", manual: bool = False,
           dev_at=(), log_at=(), fail_at=None, **options):
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=3e-2)
    if fail_at is not None:  # the user's own optimizer raises once, at that update
        original = base.step
        calls = {"n": 0}

        def step(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise RuntimeError("the user's optimizer failed once")
            return original(*args, **kwargs)

        base.step = step
    optimizer = wrap(base, model, backend=backend, total_steps=updates, run_dir=tmp_path / name,
                     manual_boundaries=manual, **options)
    if not plain:  # every step takes the full path
        optimizer._plain_horizon = lambda: optimizer.t
    generator = torch.Generator().manual_seed(1)
    plain_steps = 0
    for update in range(updates):
        x = torch.randn(16, 6, generator=generator)
        y = torch.randint(0, 3, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        plain_steps += optimizer.t < optimizer._plain_until
        optimizer.step(loss=loss)
        if manual and optimizer.needs_boundary():
            optimizer.between_updates()
        if update + 1 in dev_at:
            optimizer.report_dev(stage=update + 1)
        if update + 1 in log_at:
            optimizer.log(marker=update + 1)
    optimizer.close()
    return model, _records(tmp_path / name), plain_steps


@pytest.mark.parametrize("case", [
    {},
    {"backend": "heuristic"},
    {"manual": True},
    {"schedule": [0.28, 0.5, 0.77], "decisions": 3, "updates": 25 * 7},
    {"dev_at": (100, 180), "log_at": (150,)},
    {"eval_integrity": False, "every": 10},
    {"fail_at": 77},
    {"manual": True, "dev_at": (60, 200), "log_at": (61,)},
    {"schedule": [0.1, 0.33, 0.61], "decisions": 3, "every": 7, "backend": "heuristic"},
], ids=["keep", "heuristic", "manual-boundaries", "explicit-fractions", "dev-and-log", "every-10", "user-raises",
        "manual-dev-and-log", "decisions-between-analyses"])
def test_plain_path_changes_nothing(tmp_path, case):
    plain_model, plain_records, plain_steps = _train(tmp_path, "plain", True, **case)
    full_model, full_records, full_steps = _train(tmp_path, "full", False, **case)
    assert full_steps == 0
    assert plain_steps > 0  # the plain path was taken ...
    for a, b in zip(plain_model.parameters(), full_model.parameters()):
        assert torch.equal(a, b)  # ... and the weights are bit for bit those of the full path
    assert plain_records == full_records


def test_plain_path_is_most_updates_with_the_released_program(tmp_path):
    updates = 400
    _, records, plain_steps = _train(tmp_path, "run", True, updates=updates)
    analyses = len(records["reports"])
    decisions = sum(1 for event in records["events"] if event["kind"] == "requested")
    assert analyses == updates // 25 and decisions == 8
    # full steps: the first two (the audit), each analysis, the step after each decision
    assert plain_steps >= updates - 2 - analyses - decisions


def test_no_plain_path_once_an_agent_program_runs(tmp_path):
    model = _model()

    def backend(workspace, message):  # an agent's program: the starting updater with the learning rate halved
        source = (workspace / "updater.py").read_text()
        (workspace / "updater.py").write_text(source.replace("LR_SCALE = 1.0", "LR_SCALE = 0.5"))
        return "Changed: LR_SCALE 1.0 -> 0.5."

    optimizer = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, backend=backend, total_steps=200,
                     decisions=1, schedule=[0.2], run_dir=tmp_path / "opal")
    assert isinstance(optimizer, AgentOptimizer)
    taken = []
    for _ in range(200):
        loss = model(torch.randn(4, 6)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        taken.append((optimizer.t, optimizer.current.number, optimizer.t < optimizer._plain_until))
        optimizer.step(loss=loss)
    optimizer.close()
    assert any(plain for _, number, plain in taken if number == 0)
    assert {number for _, number, _ in taken} == {0, 1}
    assert not any(plain for _, number, plain in taken if number == 1)  # an agent's program: the full path always
