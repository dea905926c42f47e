"""Lightning: the agent optimizer returned by ``configure_optimizers``.

Automatic optimisation hands ``step`` a closure (training step, zero_grad, backward); the agent optimizer runs it
exactly once, keeps the loss it returns, and steps. A learning-rate scheduler goes to ``wrap_for(scheduler=...)``
and is not returned to Lightning: the starting program steps it once per update, as Lightning would, and two
owners would step it twice (refused, see ``opalctl.opal.schedule.SchedulerOwnership``). ``CloseAgent`` closes
every agent optimizer when training ends (the ``end`` event, the figures).

    def configure_optimizers(self):
        return wrap_for(self, torch.optim.AdamW(self.parameters(), lr=1e-3), backend="heuristic", run_dir="opal")

    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[CloseAgent()])
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from opalctl.opal.optimizer import AgentOptimizer, wrap


def wrap_for(module, optimizer: torch.optim.Optimizer, **settings: Any) -> AgentOptimizer:
    """``optimizer`` wrapped for ``module`` (a LightningModule attached to its Trainer, as it is inside
    ``configure_optimizers``); the number of updates is the Trainer's ``estimated_stepping_batches`` unless
    ``total_steps`` or ``progress`` is given. The other settings are ``opalctl.opal.wrap``'s."""
    if "total_steps" not in settings and "progress" not in settings:
        settings["total_steps"] = int(module.trainer.estimated_stepping_batches)
    return wrap(optimizer, module, **settings)


class CloseAgent(Callback):
    """Closes the agent optimizers when training ends."""

    def on_train_end(self, trainer, pl_module) -> None:
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, AgentOptimizer):
                optimizer.close()
