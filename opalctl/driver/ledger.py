"""Every running total of a formal run, and the one way work done outside the budget is accounted for.

The budget clock charges whole updates and nothing else; what happens between them (stages, checkpoints, the
agent's decisions) is timed on the wall clock, each under its own total, by ``Ledger.outside``. Under a clock
whose charges are not CPU seconds, training's CPU time is not measured per update (reading the process CPU clock
is a system call, too dear to make per update for nothing): it is the loop's CPU time less that of the work
outside the budget, so ``outside`` folds the CPU time spent since the last such work into ``train_cpu`` when it
begins, and marks the CPU clock when it ends. Spans nest: only the outermost one folds and marks, so a stage is
wholly outside training however many timed parts it has.

The per-update figures (training seconds, examples, non-finite losses) are not added per update: the steps
writer sums them at its flushes, and ``take`` adds those sums (``StepsWriter.take_sums``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SECONDS = ("train_cpu", "train_wall", "eval_wall", "checkpoint_wall", "loop_wall", "agent_wait_wall")
COUNTS = ("examples", "nonfinite_losses", "resumes")


class Ledger:
    """The run's totals: seconds charged and not charged, examples, non-finite losses and resumes.

    ``state_dict`` is the ``totals`` of a resume checkpoint; ``loop_wall`` is this session's loop only.
    """

    def __init__(self, cpu_charges: bool):
        self.cpu_charges = cpu_charges  # the clock charges CPU seconds: training's CPU time is the charges' sum
        self.train_cpu = 0.0
        self.train_wall = 0.0
        self.eval_wall = 0.0
        self.checkpoint_wall = 0.0
        self.loop_wall = 0.0
        self.agent_wait_wall = 0.0
        self.examples = 0
        self.nonfinite_losses = 0
        self.resumes = 0
        self._cpu_mark: float | None = None  # the CPU clock when training last resumed; None before the loop
        self._depth = 0  # how many ``outside`` spans are open
        self._loop_started = 0.0

    def take(self, sums: dict[str, Any]) -> None:
        """Add the per-update sums the steps writer kept since they were last taken."""
        self.train_wall += sums["train_wall"]
        self.train_cpu += sums["train_cpu"]
        self.examples += sums["examples"]
        self.nonfinite_losses += sums["nonfinite_losses"]

    @contextmanager
    def outside(self, total: str | None = None) -> Iterator[None]:
        """Work outside the budget: its wall seconds go to ``total`` (one of ``SECONDS``; None: not timed on its
        own), and its CPU time never to training."""
        if total is not None and total not in SECONDS:
            raise ValueError(f"{total!r} is not one of the ledger's seconds {SECONDS}")
        if self._depth == 0 and self._cpu_mark is not None and not self.cpu_charges:
            self.train_cpu += time.process_time() - self._cpu_mark
        self._depth += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            if total is not None:
                setattr(self, total, getattr(self, total) + time.perf_counter() - started)
            self._depth -= 1
            if self._depth == 0:
                self._cpu_mark = time.process_time()

    def loop_begins(self) -> None:
        """Training starts (or restarts, after a resume): from here, CPU time outside spans is training's."""
        self._loop_started = time.perf_counter()
        self._cpu_mark = time.process_time()

    def loop_ends(self) -> None:
        self.loop_wall = time.perf_counter() - self._loop_started

    def figures(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in SECONDS + COUNTS}

    def state_dict(self) -> dict[str, Any]:
        return self.figures()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The totals of the sessions before this one; this session is one more resume."""
        for key in SECONDS + COUNTS:
            if key in state:
                setattr(self, key, state[key])
        self.resumes += 1
