"""Where researchers already train: the agent optimizer inside other frameworks' loops.

- ``opalctl.integrations.hf``: ``OpalTrainer``, a ``transformers.Trainer`` whose optimizer is wrapped once
  accelerate has prepared it (docs/integrations.md);
- ``opalctl.integrations.lightning``: ``wrap_for`` for ``configure_optimizers`` and ``AgentCallback``, the
  callback that feeds the agent the losses of accumulated micro-batches and closes it when training ends.

Under both, the agent sees each update's loss: its micro-batches' losses as the framework scales them, summed by
``AgentOptimizer.observe`` (the observer's one place for it).

Each module imports its framework on first use; neither is a dependency of opalctl itself (the ``hf`` and
``lightning`` extras).
"""
