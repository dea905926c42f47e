"""What a program sees: ``build(params, previous, spec)`` gets the run facts (``Spec``), ``step(grads, update,
ctx)`` the gradients (``GradView``) and the step's context (``StepContext``)."""

from __future__ import annotations

from typing import Any

import torch


class Spec:
    """Run facts handed to ``build(params, previous, spec)``."""

    def __init__(self, optimizer, scheduler, clip, total_steps, goal, params: dict[str, torch.Tensor]):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = clip
        self.total_steps = total_steps
        self.goal = goal
        self.param_names = list(params)
        self._params = params

    def optimizer_state_by_name(self) -> dict[str, dict]:
        return {name: self.optimizer.state.get(param, {}) for name, param in self._params.items()}


class GradView(dict):
    """``grads`` as a program sees it: name -> gradient, read from the parameters when asked (building a dict of
    every gradient on each update would cost time on models with many tensors)."""

    __slots__ = ("_named",)

    def __init__(self, named):
        super().__init__()
        self._named = named

    def __getitem__(self, name):
        return self._named[name].grad

    def get(self, name, default=None):
        param = self._named.get(name)
        return default if param is None or param.grad is None else param.grad

    def __iter__(self):
        return iter(self._named)

    def __len__(self):
        return len(self._named)

    def __contains__(self, name):
        return name in self._named

    def keys(self):
        return self._named.keys()

    def items(self):
        return [(name, p.grad) for name, p in self._named.items()]

    def values(self):
        return [p.grad for p in self._named.values()]


class StepContext:
    __slots__ = ("progress", "loss", "update", "logs")

    def __init__(self, progress: float, loss, update: int):
        self.progress, self.loss, self.update, self.logs = progress, loss, update, None

    def log(self, **values: Any) -> None:
        if self.logs is None:
            self.logs = {}
        self.logs.update(values)
