"""The task interface: the only way the driver touches a model, its data and its metrics.

The split follows AlgoPerf's: a task (workload) knows its data, model, loss and evaluation; the driver (runner)
knows budgets, clocks, checkpoints and promotion; the optimizer arm (submission) knows only parameters and
gradients. A task never times anything and never decides anything; the driver never looks inside a batch.

A task is a class named in the protocol by ``task.entry`` ("module:Class"). Its ``Config`` (a pydantic model)
validates ``task.config``, so a typo in a task setting is refused at freeze like any other key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict


class TaskConfig(BaseModel):
    """Base of every task's settings: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


@dataclass
class Batch:
    """One training batch: the row ids (for the run's digest of what was seen) and the task's tensors."""

    ids: np.ndarray
    inputs: Any
    targets: Any

    def __len__(self) -> int:
        return int(len(self.ids))


@dataclass
class Built:
    """A freshly built model and an account of where each tensor came from."""

    model: Any
    inherited: list[dict] = field(default_factory=list)  # {name, shape, dtype, sha256} taken from the parent
    initialised: list[dict] = field(default_factory=list)  # {name, shape, dtype, sha256} set up fresh


class Sampler:
    """Deterministic, resumable batches. ``state_dict`` must be plain JSON-able data.

    ``fresh_ids``: set it to True when every batch's ``ids`` is a new array that nothing changes after the batch
    is handed over. The formal run keeps each batch's ids until its records are written (up to 512 updates
    later); with fresh ids it keeps the array itself, otherwise a copy, made between two updates: a cost on every
    update that fresh ids avoid (bench/README.md has the figure). A sampler that refills one array must leave it
    False.
    """

    fresh_ids = False

    def next_batch(self) -> Batch:  # pragma: no cover - interface
        raise NotImplementedError

    def state_dict(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Task:
    """Base class of a task. Subclasses set the class attributes and implement the methods below."""

    #: short name, used in messages and by ``opalctl init``
    name: ClassVar[str] = "task"
    #: validates ``task.config`` from the protocol
    Config: ClassVar[type[TaskConfig]] = TaskConfig
    #: validates each arm's ``model`` settings (handed to ``build``); by default an arm may set none
    ArmConfig: ClassVar[type[TaskConfig]] = TaskConfig
    #: every metric ``evaluate`` returns, with its kind: "count" (an integer that must match across models,
    #: such as ``total``), "higher" (more is better) or "lower" (less is better)
    metrics: ClassVar[dict[str, str]] = {}
    #: the data keys this task reads; ``train`` is always one of them, every other one is an evaluation split
    splits: ClassVar[tuple[str, ...]] = ("train",)

    def __init__(self, config: dict | None = None):
        self.config = self.Config(**(config or {}))

    # -- built-in tasks only -------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        """Write the data files and one parent per seed under ``folder``, deterministically.

        Returns ``{"data": {split: relative path}, "parents": template with {seed}}``; the paths are relative
        to ``folder``, which is where the protocol is written.
        """
        raise NotImplementedError(f"task {self.name!r} has no built-in data; write its files yourself")

    # -- the interface the driver uses ---------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        """Read the splits named in ``data_paths`` (only those: the pilot passes only ``train``)."""
        raise NotImplementedError

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        """The arm's initial model, from the parent checkpoint, on ``device``.

        ``arm_config`` has been validated by ``ArmConfig``. Load the parent with ``opalctl.checkpoints.load`` so
        that a damaged or mismatched parent is refused with a sentence.
        """
        raise NotImplementedError

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        raise NotImplementedError

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        """A scalar loss tensor to call ``backward`` on, and a dict of plain numbers worth logging."""
        raise NotImplementedError

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        """Metrics of ``model`` on one split. Must leave the parameters and every RNG as it found them."""
        raise NotImplementedError
