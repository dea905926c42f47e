"""Building an arm: the torch optimizer the protocol names, its learning-rate schedule, and one update.

``update`` is the unit the budget is charged for: batch, forward, loss, backward, clipping and the optimizer
step. The pilot and the formal run both call this same function, so what the pilot measures is what the run
will spend.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from opalctl.protocol.schema import Arm


def build_optimizer(arm: Arm, parameters) -> Any:
    import torch

    cls = getattr(torch.optim, arm.optimizer.name)
    return cls(parameters, **arm.optimizer.arguments())


def schedule_factor(name: str, fraction: float) -> float:
    """The learning-rate multiplier at ``fraction`` of the arm's budget (0 at the start, 1 at the end)."""
    fraction = min(max(fraction, 0.0), 1.0)
    if name == "constant":
        return 1.0
    if name == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * fraction))
    if name == "linear":
        return 1.0 - fraction
    if name == "anneal-end":  # constant for 80 % of the budget, then linear to zero
        return 1.0 if fraction <= 0.8 else max(0.0, (1.0 - fraction) / 0.2)
    raise ValueError(f"unknown schedule {name!r}")


class BudgetSchedule:
    """Sets each group's learning rate from its initial value and the fraction of the budget used so far.

    Under a CPU budget the number of updates is not known in advance, so the schedule follows the budget
    fraction (measured before each update), not an update count.
    """

    def __init__(self, optimizer, name: str):
        self.optimizer = optimizer
        self.name = name
        self.initial = [group["lr"] for group in optimizer.param_groups]

    def apply(self, fraction: float) -> float:
        factor = schedule_factor(self.name, fraction)
        for group, lr in zip(self.optimizer.param_groups, self.initial):
            group["lr"] = lr * factor
        return factor

    def state_dict(self) -> dict:
        return {"name": self.name, "initial": list(self.initial)}

    def load_state_dict(self, state: dict) -> None:
        self.name = state["name"]
        self.initial = list(state["initial"])


def update(task, model, optimizer, batch, gradient_clip: float | None,
           before_step: Callable[[], None] | None = None):
    """One whole update; returns the loss tensor (not synchronised: the caller decides when to read it)."""
    import torch

    loss, _details = task.loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if gradient_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip)
    if before_step is not None:
        before_step()
    optimizer.step()
    return loss
