"""The per-update audit: ``count_step`` counts the outermost operator calls of one update (and host
synchronisations on CUDA), stably, sees a wasteful step as one, and runs the step exactly once, unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch

from opalctl.opal.audit import count_step

torch.set_num_threads(1)


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def backward(model, update: int) -> None:
    generator = torch.Generator().manual_seed(update)
    x, y = torch.randn(8, 10, generator=generator), torch.randn(8, 1, generator=generator)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()


def test_a_plain_adamw_step_has_positive_and_stable_counts():
    model, optimizer = make()
    backward(model, 0)
    optimizer.step()  # the first step also builds the optimizer's state
    counts = []
    for update in (1, 2):
        backward(model, update)
        counts.append(count_step(optimizer.step))
    first, second = counts
    assert first["ops"] > 0 and first["ops"] == second["ops"]
    assert first["top"] == second["top"] and first["top"]
    assert all(name.startswith("aten::") and count > 0 for name, count in first["top"])
    assert first["syncs"] is None  # CPU: no synchronisation to count
    assert sum(count for _, count in first["top"]) <= first["ops"]


def test_a_step_with_an_item_per_parameter_counts_more():
    model, optimizer = make()
    backward(model, 0)
    optimizer.step()
    backward(model, 1)
    plain = count_step(optimizer.step)

    def wasteful():
        optimizer.step()
        for p in model.parameters():
            p.detach().abs().max().item()

    backward(model, 2)
    heavy = count_step(wasteful)
    n = len(list(model.parameters()))
    assert heavy["ops"] >= plain["ops"] + 3 * n
    assert dict(heavy["top"]).get("aten::item", 0) == dict(plain["top"]).get("aten::item", 0) + n


def test_only_outermost_calls_count():
    x = torch.randn(5)
    result = count_step(lambda: x.to(torch.float64))  # aten::to calls _to_copy, empty_strided, copy_ inside
    assert result["ops"] == 1 and result["top"] == [("aten::to", 1)]
    linear = torch.nn.Linear(4, 3)
    with torch.no_grad():
        result = count_step(lambda: linear(torch.ones(2, 4)))
    assert result["ops"] == 2 and dict(result["top"]) == {"aten::ones": 1, "aten::linear": 1}


def test_the_step_runs_exactly_once_and_unchanged():
    model, optimizer = make()
    twin, twin_optimizer = make()
    calls = []

    def step():
        calls.append(1)
        optimizer.step()

    for update in range(3):
        backward(model, update)
        backward(twin, update)
        if update == 1:
            count_step(step)
        else:
            step()
        twin_optimizer.step()
    assert len(calls) == 3
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_an_exception_in_the_step_propagates_after_the_step_ran_once():
    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("the program failed")

    with pytest.raises(RuntimeError, match="the program failed"):
        count_step(failing)
    assert len(calls) == 1
    assert not torch._C._autograd._profiler_enabled()
    assert count_step(lambda: torch.ones(2).add_(1))["ops"] == 2  # the profiler was stopped


def test_under_a_running_profiler_the_step_still_runs_once():
    from torch.profiler import ProfilerActivity, profile

    calls = []
    with profile(activities=[ProfilerActivity.CPU]):
        result = count_step(lambda: calls.append(1))
    assert calls == [1] and result["ops"] is None and "profiler" in result["error"]


def test_other_warnings_of_the_step_are_not_swallowed():
    def noisy():
        warnings.warn("a warning of the program", UserWarning, stacklevel=1)

    with pytest.warns(UserWarning, match="a warning of the program"):
        count_step(noisy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_synchronisations_are_counted():
    x = torch.randn(1000, device="cuda")
    torch.cuda.synchronize()
    plain = count_step(lambda: x.mul_(1.0001))
    synced = count_step(lambda: [x.mul_(1.0001), x.sum().item(), x[:3].cpu()])
    assert plain["syncs"] == 0
    assert synced["syncs"] >= 2
    assert torch.cuda.get_sync_debug_mode() == 0
