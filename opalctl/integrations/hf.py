"""``OpalTrainer``: ``transformers.Trainer`` with the agent optimizer.

Why a subclass rather than a callback or an optimizer factory: the two things the agent needs are only reachable
from inside the Trainer. The loss of each micro-batch is returned by ``training_step`` and never handed to a
callback, and the optimizer must be wrapped after accelerate's ``prepare`` (whose state-dict round trip would
otherwise read as a resume) but before a checkpoint's optimizer state is loaded (so that a resumed run restores
the agent's programs, not only the user's optimizer); ``create_scheduler`` is the public method the Trainer calls
between the two. Everything else stays the Trainer's: it builds the optimizer (or takes ``optimizers=(...)``),
clips, steps and owns its learning-rate scheduler, saves checkpoints and resumes from them.

Usage: replace ``Trainer(...)`` by ``OpalTrainer(..., opal={"backend": "heuristic", "run_dir": "opal"})``; the
``opal`` settings are ``opalctl.opal.wrap``'s keyword arguments. ``trainer.agent`` is the ``AgentOptimizer``
once training has started.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from opalctl.errors import BadInput
from opalctl.opal.optimizer import AgentOptimizer, wrap

# wrap()'s arguments that belong to the Trainer here: it steps its own scheduler, clips with max_grad_norm, and
# knows the number of updates
TRAINERS_OWN = ("scheduler", "clip", "total_steps")


class _CheckAndClose(TrainerCallback):
    """Refuses a Trainer whose optimizer could not be wrapped when training begins, and closes the agent when
    training ends."""

    def __init__(self, trainer: OpalTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer.agent is None:
            raise BadInput("OpalTrainer found no torch optimizer inside accelerate's wrapper to wrap (DeepSpeed, FSDP "
                           "and model parallelism keep their own); train with transformers.Trainer there")

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.agent is not None:
            self.trainer.agent.close()


class OpalTrainer(Trainer):
    """See the module docstring."""

    def __init__(self, *args: Any, opal: dict[str, Any] | None = None, **kwargs: Any):
        settings = dict(opal or {})
        taken = [name for name in TRAINERS_OWN if name in settings]
        if taken:
            raise BadInput(f"OpalTrainer(opal=...) must not set {', '.join(taken)}: the Trainer steps its own "
                           f"scheduler, clips with max_grad_norm and counts the updates; remove it from opal")
        super().__init__(*args, **kwargs)
        self.opal_settings = settings
        self.agent: AgentOptimizer | None = None
        self.add_callback(_CheckAndClose(self))

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        self._wrap_prepared(num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_prepared(self, num_training_steps: int) -> None:
        """Put the agent optimizer inside accelerate's wrapper, around the optimizer accelerate prepared."""
        if self.agent is not None:
            raise BadInput("this OpalTrainer has already trained (its agent optimizer is closed); build a new "
                           "OpalTrainer for another train()")
        prepared = self.optimizer
        inner = getattr(prepared, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or isinstance(inner, AgentOptimizer):
            return  # not prepared yet: the Trainer calls create_scheduler again once accelerate has prepared it
        settings = self.opal_settings
        if "progress" not in settings:
            settings = {**settings, "total_steps": num_training_steps}
        self.agent = wrap(inner, self.model, **settings)
        prepared.optimizer = self.agent

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch; its loss (already divided by the accumulation steps) goes to the agent, which sums an
        update's micro-batches (``AgentOptimizer.observe``): the update's loss, as the Trainer logs it."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.agent is not None:
            self.agent.observe(loss)
        return loss
