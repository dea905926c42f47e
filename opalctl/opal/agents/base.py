"""The backend interface: ``decide(workspace, message, facts) -> Answer``, and ``BackendKind``, how a backend
module declares itself to the registry (``opalctl.opal.agents.registry``).

A backend may only change files in the workspace (``updater.py``, ``analysis.py``); the optimizer reads them
back, checks and loads them. ``runs_in`` says how a non-blocking decision is run: ``"process"`` for backends that
compute (their CPU time must not land on the training process's clock), ``"thread"`` for backends that only
wait on I/O.

This module imports nothing heavy: a decision's worker process loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opalctl.opal.agents.options import Options


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


@dataclass(frozen=True)
class BackendKind:
    """A backend as a protocol names it (``arms.NAME.agent.backend``); each backend module declares one as ``KIND``.

    ``waits``: an answer takes seconds to minutes and costs money (a language model), so the number of decisions
    is weighed against the waiting and the pilot forecasts it; False for a backend that answers in milliseconds
    for free. ``argument``: what follows ``NAME:`` when the backend takes one (``replay:<run folder>``).
    ``options``: the protocol keys it reads; the factory takes them as keyword arguments, and ``prompt_text`` too
    when ``prompted``. ``lock_defaults(agent)`` gives the values the lock records in place of "the default"
    (``agent`` is the resolved agent section as JSON). ``problems(agent, where)`` gives ``(key, what to do)`` for
    each setting the schema alone cannot refuse.
    """

    name: str
    waits: bool
    factory: Callable[..., Backend]
    options: type[Options] | None = None
    argument: str | None = None
    prompted: bool = False
    lock_defaults: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    problems: Callable[[Any, str], list[tuple[str, str]]] | None = None

    @property
    def spelling(self) -> str:
        """How a protocol writes it: ``keep``, or ``replay:<run folder>``."""
        return f"{self.name}:<{self.argument}>" if self.argument else self.name

    def argument_of(self, value: str) -> str | None:
        """The argument ``value`` gives this kind (``""`` for a kind that takes none), or None when it is not one."""
        if self.argument is None:
            return "" if value == self.name else None
        prefix = self.name + ":"
        return value[len(prefix):] if value.startswith(prefix) and len(value) > len(prefix) else None
