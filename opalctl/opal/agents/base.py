"""The backend interface: ``decide(workspace, message, facts) -> Answer``, and ``BackendKind``, how a backend
module declares itself to the registry (``opalctl.opal.agents.registry``).

A backend may only change files in the workspace (``updater.py``, ``analysis.py``); whoever owns the workspace
reads them back (the agent host, for a backend that runs there), and the optimizer checks and loads them. ``runs_in`` says where a decision's work runs: ``"host"`` for every backend that
runs agent-authored code or talks to the network (a worker process of the agent host,
``opalctl.opal.agents.host``, with a time limit of ``seconds_per_decision`` and then some), ``"here"`` for the
ones that do neither (``keep``, and a user's own callable given to ``wrap()``: the user's code, not an agent's),
which answer in the training process (a non-blocking one in a thread). A hosted backend says how the worker
builds it again (``recipe``: plain JSON), which keys it uses (``secrets``), and what one decision hands to the
next (``carry`` / ``resume``: a session to continue, say).

This module imports nothing heavy: a decision's worker process loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opalctl.opal.agents.options import Options


DEFAULT_DECISION_SECONDS = 120.0  # the time limit of a hosted decision whose backend sets none


@dataclass
class Answer:
    """A decision's answer; it crosses from the agent host's worker to the host, and from the host to the training
    process, as ``to_json()``. A backend fills the first five fields; whoever owns the workspace (the agent host, or
    the training process for a backend that answers there) fills ``programs`` and ``unreadable`` from what the
    agent left in it, and the training process loads exactly those."""

    rationale: str
    usage: dict[str, Any] = field(default_factory=dict)
    cost_usd: float = 0.0
    transcript: list[dict[str, Any]] = field(default_factory=list)
    failed: str | None = None  # set when the backend could not answer (the decision fails, training goes on)
    programs: dict[str, str] | None = None  # updater.py / analysis.py as the agent left them (redacted)
    unreadable: str | None = None  # why those cannot be loaded (a link, a folder, not UTF-8, too large)
    remote: dict[str, Any] | None = None  # where a remote backend's answer was worked (opal/agents/mailbox.py)

    def to_json(self) -> dict[str, Any]:
        return {"rationale": self.rationale, "usage": self.usage, "cost_usd": self.cost_usd,
                "transcript": self.transcript, "failed": self.failed, "programs": self.programs,
                "unreadable": self.unreadable, "remote": self.remote}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Answer:
        programs = data.get("programs")
        if isinstance(programs, dict):
            programs = {str(name): text for name, text in programs.items() if isinstance(text, str)}
        else:
            programs = None
        unreadable, remote = data.get("unreadable"), data.get("remote")
        return cls(rationale=str(data.get("rationale") or ""), usage=dict(data.get("usage") or {}),
                   cost_usd=float(data.get("cost_usd") or 0.0), transcript=list(data.get("transcript") or []),
                   failed=data.get("failed"), programs=programs,
                   unreadable=str(unreadable) if unreadable is not None else None,
                   remote=dict(remote) if isinstance(remote, dict) else None)


class Backend:
    name = "backend"
    runs_in = "here"
    seconds_per_decision = DEFAULT_DECISION_SECONDS

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:  # pragma: no cover
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}

    def recipe(self) -> dict[str, Any]:
        """How a worker builds this backend again: ``{"backend": <a protocol's backend value>, "options": {...}}``
        (plain JSON, given to ``registry.create``). Only a backend that runs in the host needs one."""
        raise TypeError(f"backend {self.name!r} runs in the agent host but says no recipe() to build it there")

    def secrets(self) -> list[str]:
        """The keys this backend uses, for the redaction (never for a file)."""
        return []

    def carry(self) -> dict[str, Any]:
        """What the next decision's backend needs of this one (plain JSON; the host hands it on)."""
        return {}

    def resume(self, carried: dict[str, Any]) -> None:
        """Take what the previous decision's backend carried."""


class FunctionBackend(Backend):
    """A Python callable ``fn(workspace: Path, message: str) -> str`` that edits files and returns its rationale."""

    name = "callable"
    runs_in = "here"  # the user's own code, not an agent's

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
    each setting the schema alone cannot refuse. ``own_keys``: protocol keys only this backend reads, which the
    lock of an arm of another backend leaves out (they came after the lock's form was fixed, and every lock written
    before reads the same). ``unready(agent)`` says what this machine lacks for the backend to
    answer (an API key, a binary), or None: freeze and pilot warn with it (the key may be set later), and a run
    refuses with it before it makes any folder.
    """

    name: str
    waits: bool
    factory: Callable[..., Backend]
    options: type[Options] | None = None
    argument: str | None = None
    prompted: bool = False
    lock_defaults: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    problems: Callable[[Any, str], list[tuple[str, str]]] | None = None
    unready: Callable[[Any], str | None] | None = None
    own_keys: tuple[str, ...] = ()

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
