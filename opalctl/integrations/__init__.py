"""Where researchers already train: the agent optimizer inside other frameworks' loops.

- ``opalctl.integrations.hf``: ``OpalTrainer``, a ``transformers.Trainer`` whose optimizer is wrapped once
  accelerate has prepared it (docs/integrations.md);
- ``opalctl.integrations.lightning``: ``wrap_for`` for ``configure_optimizers`` and ``CloseAgent``, the callback
  that closes the agent optimizer when training ends.

Each module imports its framework on first use; neither is a dependency of opalctl itself (the ``hf`` and
``lightning`` extras).
"""
