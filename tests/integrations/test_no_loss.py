"""An agent never reasons on no data, and a scheduler has one owner (the framework-neutral half of issue 18)."""

from __future__ import annotations

import warnings

import pytest
import torch

from opalctl.errors import OpalctlError
from opalctl.opal import wrap
from opalctl.opal.messages import NO_LOSS, render
from opalctl.opal.observer import NoLossWarning
from opalctl.opal.optimizer import SchedulerShared, default_sources


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(optimizer, model, updates: int, *, pass_loss: bool = False, feed: bool = False, scheduler=None):
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(updates):
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if feed:
            optimizer.observe(loss)
        optimizer.step(loss=loss) if pass_loss else optimizer.step()
        if scheduler is not None:
            scheduler.step()


def facts(**overrides):
    base = {"decision": 1, "reason": "scheduled", "update": 30, "progress": 0.3, "total_steps": 100,
            "remaining": 2, "lrs": [0.1], "losses": {"bins": [{"start": 1, "end": 25, "count": 0, "mean": None,
                                                               "min": None, "max": None, "nonfinite": 0}]}}
    return {**base, **overrides}


def test_a_step_without_a_loss_warns_once_and_counts_the_updates_no_loss_was_observed_for(tmp_path):
    model, optimizer = tiny()
    agent = wrap(optimizer, model, backend="keep", total_steps=60, run_dir=tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(agent, model, 60)
    agent.close()
    no_loss = [w for w in caught if issubclass(w.category, NoLossWarning)]
    assert len(no_loss) == 1
    assert "step() ran without a loss" in str(no_loss[0].message)
    assert agent.observer.unobserved.count == 60
    assert agent.observer.observed_since(0, agent.t, 0) == 0  # what a decision's facts say (losses_observed)


def test_losses_passed_or_fed_through_observe_are_counted_and_do_not_warn(tmp_path):
    for how in ("pass_loss", "feed"):
        model, optimizer = tiny()
        agent = wrap(optimizer, model, backend="keep", total_steps=60, run_dir=tmp_path / how)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoLossWarning)
            train(agent, model, 60, **{how: True})
        assert agent.observer.unobserved.count == 0
        assert agent.observer.observed_since(0, agent.t, 0) == 60
        assert agent.observer.observed_since(40, agent.t, 0) == 20  # exact, though the bin of 26-50 began before
        agent.close()


def test_the_message_says_in_words_that_no_loss_was_observed_and_claims_no_trend():
    sources = default_sources()
    silent = render(facts(losses_observed=0), sources)
    assert NO_LOSS in silent
    assert "nothing can be said of the loss or its trend" in silent
    counted = render(facts(losses_observed=25), sources)
    assert NO_LOSS not in counted and "25 loss(es) observed since the last decision." in counted


def test_a_scheduler_handed_to_wrap_and_stepped_elsewhere_is_refused_in_one_sentence(tmp_path):
    model, optimizer = tiny()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 100)
    agent = wrap(optimizer, model, backend="keep", total_steps=100, scheduler=scheduler, run_dir=tmp_path / "run")
    with pytest.raises(SchedulerShared) as raised:
        train(agent, model, 10, pass_loss=True, scheduler=scheduler)
    assert isinstance(raised.value, OpalctlError)
    message = str(raised.value)
    assert "stepped outside the agent optimizer before update 1" in message and message.count(". ") == 0
    assert scheduler.last_epoch == 2  # refused at the first step after the double one: the learning rate kept
    agent.close()


def test_a_scheduler_only_the_agent_optimizer_steps_is_accepted_and_across_a_loaded_state(tmp_path):
    model, optimizer = tiny()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 100)
    agent = wrap(optimizer, model, backend="keep", total_steps=100, scheduler=scheduler, run_dir=tmp_path / "run")
    train(agent, model, 30, pass_loss=True)
    state = agent.state_dict()
    train(agent, model, 10, pass_loss=True)
    agent.load_state_dict(state)  # the scheduler goes back to update 30: still its own, not someone else's step
    train(agent, model, 10, pass_loss=True)
    assert scheduler.last_epoch == 40 and agent.t == 40
    agent.close()


def _run_without_losses_between(agent, model, first: int, last: int, *, with_loss: range) -> None:
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for update in range(first, last):
        loss = model(inputs).pow(2).mean()
        agent.zero_grad()
        loss.backward()
        agent.step(loss=loss) if update in with_loss else agent.step()


def _decisions_seen(run_dir) -> list[list[str]]:
    """Each decision's message and answer, without the one line that states measured durations."""
    return [[line for line in (folder / "message.md").read_text().splitlines() if not line.startswith("updater step")]
            + [(folder / "response.md").read_text()] for folder in sorted((run_dir / "agent" / "decisions").glob("[0-9][0-9][0-9]"))]


def test_a_run_without_a_loss_saved_and_restored_counts_warns_and_decides_as_an_uninterrupted_one(tmp_path):
    def agent_in(run_dir):
        model, optimizer = tiny()
        return model, wrap(optimizer, model, backend="heuristic", total_steps=60, decisions=3, schedule="uniform",
                           run_dir=run_dir)

    with_loss = range(25, 35)  # no loss before update 25 and after update 34
    with warnings.catch_warnings(record=True) as whole_warnings:
        warnings.simplefilter("always")
        model, whole = agent_in(tmp_path / "whole")
        _run_without_losses_between(whole, model, 0, 60, with_loss=with_loss)
        whole.close()
        model, first = agent_in(tmp_path / "split")
        _run_without_losses_between(first, model, 0, 30, with_loss=with_loss)
        state, weights = first.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
        first.records.close()
        model, resumed = agent_in(tmp_path / "split")  # a second process would start here, in the same run folder
        model.load_state_dict(weights)
        resumed.load_state_dict(state)
        _run_without_losses_between(resumed, model, 30, 60, with_loss=with_loss)
        resumed.close()
    no_loss = [w for w in whole_warnings if issubclass(w.category, NoLossWarning)]
    assert len(no_loss) == 2  # once for the uninterrupted run, once in all for the interrupted one
    assert resumed.observer.unobserved.count == whole.observer.unobserved.count == 50
    assert resumed.observer.observed_since(0, 60, 0) == whole.observer.observed_since(0, 60, 0) == 10
    seen = _decisions_seen(tmp_path / "whole")
    assert len(seen) == 3 and _decisions_seen(tmp_path / "split") == seen
    assert NO_LOSS in "\n".join(seen[0]) and NO_LOSS not in "\n".join(seen[1])


def test_a_state_saved_before_the_no_loss_count_was_carried_still_loads(tmp_path):
    model, optimizer = tiny()
    agent = wrap(optimizer, model, backend="keep", total_steps=60, run_dir=tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(agent, model, 10)
    state = agent.state_dict()
    assert state["observer"]["unobserved"] == {"count": 10, "warned": True}
    del state["observer"]["unobserved"], state["observer"]["fed"]  # what an earlier opalctl saved
    agent.load_state_dict(state)
    assert agent.observer.unobserved.count == 0 and agent.observer.fed is None and agent.t == 10
    agent.close()
