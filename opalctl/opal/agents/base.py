"""The backend interface: ``decide(workspace, message, facts) -> Answer``.

A backend may only change files in the workspace (``updater.py``, ``analysis.py``); the optimizer reads them
back, checks and loads them. ``runs_in`` says how a non-blocking decision is run: ``"process"`` for backends that
compute (their CPU time must not land on the training process's clock), ``"thread"`` for backends that only
wait on I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Answer:
    rationale: str
    usage: dict[str, Any] = field(default_factory=dict)
    cost_usd: float = 0.0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    failed: str | None = None  # set when the backend could not answer (the decision fails, training goes on)


class Backend:
    name = "backend"
    runs_in = "thread"

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}


class KeepBackend(Backend):
    name = "keep"
    runs_in = "thread"

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        return Answer(rationale="Observed: nothing was examined (the keep backend never changes anything).\n"
                                "Kept: the programs as they are.\n"
                                "Prediction: training continues exactly as the plain optimizer would.\n"
                                "Rules: none.")


class FunctionBackend(Backend):
    """A Python callable ``fn(workspace: Path, message: str) -> str`` that edits files and returns its rationale."""

    name = "callable"
    runs_in = "thread"

    def __init__(self, function: Callable[[Path, str], str]):
        self.function = function

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        rationale = self.function(workspace, message)
        return Answer(rationale=str(rationale) if rationale is not None else "")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "function": getattr(self.function, "__qualname__", repr(self.function))}
