"""Lightning: the agent optimizer returned by ``configure_optimizers``.

Automatic optimisation hands ``step`` a closure (training step, zero_grad, backward); the agent optimizer runs it
exactly once, keeps the loss it returns, and steps. With ``accumulate_grad_batches`` > 1 Lightning runs the earlier
micro-batches' closures itself, outside any ``step``: ``AgentCallback`` hands their losses (divided by the number
accumulated, as Lightning scales them) to ``observe``, so the agent sees the update's loss, the sum over its
micro-batches, as under the Hugging Face Trainer. ``wrap_for`` refuses an accumulating Trainer without it rather
than let the agent reason on one micro-batch's share. A learning-rate scheduler goes to
``wrap_for(scheduler=...)`` and is not returned to Lightning: the starting program steps it once per update, as
Lightning would, and two owners would step it twice (refused, see ``opalctl.opal.schedule.SchedulerOwnership``).
``AgentCallback`` also closes every agent optimizer when training ends (the ``end`` event, the figures).

    def configure_optimizers(self):
        return wrap_for(self, torch.optim.AdamW(self.parameters(), lr=1e-3), backend="heuristic", run_dir="opal")

    trainer = lightning.pytorch.Trainer(max_steps=1000, accumulate_grad_batches=2, callbacks=[AgentCallback()])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from opalctl.errors import BadInput
from opalctl.opal.optimizer import AgentOptimizer, wrap


def wrap_for(module, optimizer: torch.optim.Optimizer, **settings: Any) -> AgentOptimizer:
    """``optimizer`` wrapped for ``module`` (a LightningModule attached to its Trainer, as it is inside
    ``configure_optimizers``); the number of updates is the Trainer's ``estimated_stepping_batches`` unless
    ``total_steps`` or ``progress`` is given. The other settings are ``opalctl.opal.wrap``'s."""
    trainer = module.trainer
    accumulated = int(getattr(trainer, "accumulate_grad_batches", 1))
    if accumulated > 1 and not any(isinstance(c, AgentCallback) for c in trainer.callbacks):
        raise BadInput(f"this Trainer accumulates {accumulated} micro-batches per update, whose earlier losses "
                       f"reach the agent only through opalctl.integrations.lightning.AgentCallback; add "
                       f"AgentCallback() to the Trainer's callbacks")
    if "total_steps" not in settings and "progress" not in settings:
        settings["total_steps"] = int(trainer.estimated_stepping_batches)
    return wrap(optimizer, module, **settings)


class AgentCallback(Callback):
    """Feeds the agent optimizers the loss of each micro-batch that did not step (gradient accumulation under
    automatic optimisation), and closes them when training ends."""

    def __init__(self):
        self._updates_at_start: list[tuple[AgentOptimizer, int]] = []  # each agent's update count as a batch began

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._updates_at_start = [(agent, agent.t) for agent in _agents(trainer)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # under automatic optimisation ``outputs`` is the closure's result: {"loss": the loss Lightning backpropagated
        # (divided by accumulate_grad_batches), ...}, or {} when training_step returned None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        if loss is None or not pl_module.automatic_optimization:
            return
        for agent, updates in self._updates_at_start:
            if agent.t == updates:  # no step this batch: its closure ran outside the agent, which never saw its loss
                agent.observe(loss)

    def on_train_end(self, trainer, pl_module) -> None:
        for agent in _agents(trainer):
            agent.close()


def _agents(trainer) -> list[AgentOptimizer]:
    return [optimizer for optimizer in trainer.optimizers if isinstance(optimizer, AgentOptimizer)]
