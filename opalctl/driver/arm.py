"""Building an arm: the torch optimizer the protocol names, its learning-rate schedule, and one update.

``make_update`` builds the unit the budget is charged for: batch, forward, loss, backward, clipping and the optimizer
step. The pilot and the formal run both call this same function, so what the pilot measures is what the run
will spend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from opalctl import opal  # its names load on first use: compare and grid read Schedule without importing torch
from opalctl.driver.budget import clock_spec
from opalctl.driver.groups import assign, build_grouped, group_records
from opalctl.opal.agents import registry
from opalctl.opal.estimate import estimate
from opalctl.opal.settings import AgentSettings
from opalctl.protocol.schema import Arm

DEFAULT_GOAL = ("Reach the best held-out result the promotion policy allows within the budget: learn the new "
                "data without losing what the parent knew.")


def decisions_to_ask(arm: Arm, budget) -> tuple[int, str]:
    """How many decisions an agent arm schedules, and why (docs/architecture.md, the agent's waiting and cost,
    when the protocol leaves it open)."""
    agent = arm.agent
    if agent.decisions is not None:
        return agent.decisions, "set by the protocol"
    if not registry.waits(agent):
        kind, _ = registry.find(agent.backend)
        return 8, f"the default for the {kind.name} backend (its decisions take no waiting)"
    if clock_spec(budget.clock).unit == "updates":
        return 8, "the default (an updates budget gives no training time to weigh waiting against)"

    seconds = budget.amount * arm.budget_multiplier
    model, effort = registry.forecast_model(agent)
    forecast = estimate(1, seconds, decisions=None, blocking=agent.blocking, max_lag=agent.max_lag, model=model,
                        effort=effort)
    return forecast["decisions"], "the most whose typical waiting stays within 4x the training time"


def agent_settings(arm: Arm, *, progress, layout, clip, budget) -> AgentSettings:
    """The agent optimizer's settings (``opalctl.opal.settings.AgentSettings``) for an agent arm: its protocol's
    ``agent:`` block, the budget meter's ``progress``, the run folder's places and the arm's clipping."""
    agent = arm.agent
    decisions, _ = decisions_to_ask(arm, budget)
    # the agent host's workspace and records (layout.agent) lie outside training/, which alone the confined training
    # process may write; the key stays with the host, whose redaction catches it (opalctl.opal.records)
    # the notes a person leaves (opalctl say), where the protocol allows them: the folder is made now, before the
    # training process is confined, which may then read it and not write it (driver/run.py confine_training)
    notes_dir = None
    if agent.notes == "allowed":
        layout.notes.mkdir(exist_ok=True)
        notes_dir = layout.notes
    return AgentSettings(goal=agent.goal or DEFAULT_GOAL, progress=progress, backend=registry.from_protocol(agent),
                         decisions=decisions, schedule=agent.schedule, blocking=agent.blocking, every=agent.every,
                         trial_steps=agent.trial_steps, run_dir=layout.opal, agent_dir=layout.agent,
                         prompt=agent.prompt, clip=clip, max_lag=agent.max_lag, notes_dir=notes_dir,
                         max_cost_usd=agent.max_cost_usd,
                         step_time_limit=(agent.step_time_limit if agent.step_time_limit is not None
                                          else AgentSettings.step_time_limit))


def wrap_agent(arm: Arm, optimizer, model, *, progress, layout, clip, budget, world: int = 1):
    """The agent optimizer for an agent arm, with clipping handed over and decisions between timed updates. Under
    torchrun (``world`` above 1) each rank wraps its own optimizer (``opal.distributed``): rank 0 has the agent and
    its records, the others follow it; ``progress`` is the budget meter's, the same on every rank because every
    rank's meter is charged the same reduced charge (driver/ranks.py)."""
    settings = agent_settings(arm, progress=progress, layout=layout, clip=clip, budget=budget)
    if world > 1:
        from opalctl.opal.distributed import wrap_distributed

        return wrap_distributed(optimizer, model, settings, rank_consistent_progress=True,
                                boundaries_between_updates=True)
    return opal.wrap(optimizer, model, settings, manual_boundaries=True)


def build_optimizer(arm: Arm, model, where: str = "arms") -> tuple[Any, list[dict] | None]:
    """The arm's torch optimizer over ``model``'s parameters: one group, as every arm had before groups, or the
    arm's ``groups`` (driver/groups.py), each with its own weight decay and learning rate; and, for the latter,
    what each group holds (``groups.GroupRecord``, for the run's start record), else None. ``where`` opens a
    refusal of a group (``arms.NAME``)."""
    import torch

    cls = getattr(torch.optim, arm.optimizer.name)
    if arm.groups is None:
        return cls(model.parameters(), **arm.optimizer.arguments()), None
    groups = assign(arm.groups, model, where)
    optimizer = build_grouped(cls, arm.optimizer.arguments(), groups)
    return optimizer, group_records(optimizer, groups)


def schedule_factor(name: str, fraction: float) -> float:
    """The learning-rate multiplier at ``fraction`` of the arm's budget (0 at the start, 1 at the end) of a
    schedule written as a name."""
    return Schedule(name).factor(fraction)


@dataclass(frozen=True)
class Schedule:
    """An arm's learning-rate schedule (``arms.NAME.schedule``: a name, or the mapping of
    ``protocol.schema.ScheduleSpec``) as the multiplier of each group's learning rate at a fraction of the arm's
    budget. With no warm-up and no floor, each named schedule gives exactly the factors it always gave."""

    name: str = "constant"
    warmup: float = 0.0
    min_lr: float = 0.0
    decay: float = 0.2  # wsd: the last part of the budget after the warm-up that decays
    decay_shape: str = "linear"  # wsd: linear, cosine or sqrt

    @classmethod
    def of(cls, value: Any) -> Schedule:
        """The schedule of a protocol's value: a name, a ``ScheduleSpec``, or its resolved JSON (a lock's)."""
        if isinstance(value, str):
            return cls(value)
        return cls(**(value if isinstance(value, dict) else value.model_dump()))

    @property
    def constant(self) -> bool:
        """Whether the factor is 1 throughout (a run then sets the learning rate once, not at every update)."""
        return self.name == "constant" and self.warmup == 0.0

    def factor(self, fraction: float) -> float:
        fraction = min(max(fraction, 0.0), 1.0)
        if fraction < self.warmup:  # linear from 0 at the start to the peak at the end of the warm-up
            return fraction / self.warmup
        if self.warmup:  # the schedule runs over what the warm-up leaves
            fraction = (fraction - self.warmup) / (1.0 - self.warmup)
        shape = self._shape(fraction)
        return shape if self.min_lr == 0.0 else self.min_lr + (1.0 - self.min_lr) * shape

    def _shape(self, fraction: float) -> float:
        if self.name == "constant":
            return 1.0
        if self.name == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * fraction))
        if self.name == "linear":
            return 1.0 - fraction
        if self.name == "anneal-end":  # constant for 80 % of the budget, then linear to zero
            return 1.0 if fraction <= 0.8 else max(0.0, (1.0 - fraction) / 0.2)
        if self.name == "wsd":  # stable, then a decay over the last `decay` of the budget
            into = (fraction - (1.0 - self.decay)) / self.decay
            if into <= 0.0:
                return 1.0
            into = min(into, 1.0)
            return {"linear": 1.0 - into, "cosine": 0.5 * (1.0 + math.cos(math.pi * into)),
                    "sqrt": 1.0 - math.sqrt(into)}[self.decay_shape]
        raise ValueError(f"unknown schedule {self.name!r}")

    def words(self) -> str:
        """``cosine``, or ``cosine (warm-up 0.05, floor 0.1)``: what a table or a sentence calls it."""
        extras = [f"warm-up {self.warmup:g}"] if self.warmup else []
        extras += [f"floor {self.min_lr:g}"] if self.min_lr else []
        if self.name == "wsd":
            extras += [f"decay {self.decay:g} {self.decay_shape}"]
        return self.name + (f" ({', '.join(extras)})" if extras else "")


class BudgetSchedule:
    """Sets each group's learning rate from its initial value and the fraction of the budget used so far.

    Under a CPU budget the number of updates is not known in advance, so the schedule follows the budget
    fraction (measured before each update), not an update count.
    """

    def __init__(self, optimizer, name):
        self.optimizer = optimizer
        self.name = name  # the protocol's value: a name, or a schedule's mapping (what the resume state keeps)
        self.schedule = Schedule.of(name)
        self.initial = [group["lr"] for group in optimizer.param_groups]

    def apply(self, fraction: float) -> float:
        factor = self.schedule.factor(fraction)
        for group, lr in zip(self.optimizer.param_groups, self.initial):
            group["lr"] = lr * factor
        return factor

    def state_dict(self) -> dict:
        return {"name": self.name, "initial": list(self.initial)}

    def load_state_dict(self, state: dict) -> None:
        self.name = state["name"]
        self.schedule = Schedule.of(self.name)
        self.initial = list(state["initial"])


def make_update(task, model, optimizer, gradient_clip: float | None, pass_loss: bool = False):
    """One whole update as a function of the batch: ``update(batch)`` returns the loss tensor (not synchronised:
    the caller decides when to read it).

    ``pass_loss`` hands the loss to ``optimizer.step(loss=...)``, as the agent optimizer wants it; an agent arm
    also gets the clipping handed over (``gradient_clip`` None here), so its starting program does exactly this.
    What does not change from one update to the next (the loss function, the parameter list for clipping) is
    looked up once, here: this function is timed and charged on every update.
    """
    import torch

    loss_of = task.loss
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
    parameters = list(model.parameters()) if gradient_clip is not None else None

    def update(batch):
        loss, _details = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if parameters is not None:
            clip_grad_norm_(parameters, gradient_clip)
        if pass_loss:
            optimizer.step(loss=loss)
        else:
            optimizer.step()
        return loss

    return update
