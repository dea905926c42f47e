"""The agent optimizer: an optimizer whose update rule an agent may rewrite while the model trains.

``from opalctl.opal import wrap``; see ``opalctl.opal.optimizer`` for how it works. Importing this package
imports torch.
"""

from opalctl.opal.optimizer import AgentOptimizer, wrap

__all__ = ["AgentOptimizer", "wrap"]
