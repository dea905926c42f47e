"""The agent optimizer: an optimizer whose update rule an agent may rewrite while the model trains.

``from opalctl.opal import wrap``; see ``opalctl.opal.optimizer`` for how it works. The names are loaded on
first use, so that a decision's worker process (``opalctl.opal.agents.worker``) starts without importing torch.
"""

__all__ = ["AgentOptimizer", "wrap"]


def __getattr__(name: str):
    if name in __all__:
        from opalctl.opal import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module 'opalctl.opal' has no attribute {name!r}")
