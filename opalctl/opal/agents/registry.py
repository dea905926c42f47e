"""Every backend a protocol may name, and what the rest of opalctl asks of them, answered in one place.

Each backend module declares itself as ``KIND`` (an ``opalctl.opal.agents.base.BackendKind``): its name, whether
it waits, the protocol keys it reads, what it adds to the lock and what it refuses. ``NAMES`` lists the backends
in the order messages name them; a backend's module is its name with ``_`` for ``-``, and it is imported only
when that backend is asked for (a decision's worker process loads the one it runs, not pydantic and the rest).
Adding a backend is one module declaring ``KIND``, its name here, and its tests.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from opalctl.errors import BadInput
from opalctl.opal.agents.base import Backend, BackendKind
from opalctl.opal.agents.default_model import DEFAULT_MODEL
from opalctl.opal.messages import prompt_text

NAMES = ("keep", "heuristic", "anthropic", "claude-code", "mailbox", "replay")


@cache
def _kind(name: str) -> BackendKind:
    module = importlib.import_module(f"opalctl.opal.agents.{name.replace('-', '_')}")
    kind = module.KIND
    if kind.name != name:  # pragma: no cover - a module that declares another name is a bug of opalctl
        raise TypeError(f"{module.__name__} declares backend {kind.name!r}, not {name!r}")
    return kind


def kinds() -> tuple[BackendKind, ...]:
    """Every backend, in the order of ``NAMES`` (this imports every backend module)."""
    return tuple(_kind(name) for name in NAMES)


def find(value: str) -> tuple[BackendKind, str] | None:
    """The backend a protocol's ``backend`` value names, and its argument ("" for none); None for no backend."""
    name = value.partition(":")[0]
    if name not in NAMES:
        return None
    kind = _kind(name)
    argument = kind.argument_of(value)
    return None if argument is None else (kind, argument)


def spellings() -> str:
    """How a protocol writes each backend, for messages: ``keep, heuristic, ... or replay:<run folder>``."""
    written = [kind.spelling for kind in kinds()]
    return ", ".join(written[:-1]) + " or " + written[-1]


def option_models() -> list[type]:
    """The options models of every backend, each once, the most derived first (the protocol's agent keys)."""
    models = [kind.options for kind in kinds() if kind.options is not None]
    unique = [model for index, model in enumerate(models) if model not in models[:index]]
    return [model for model in unique if not any(other is not model and issubclass(other, model) for other in unique)]


def create(value: str, **options: Any) -> Backend:
    """The backend ``value`` names, built with ``options``; ValueError for a name that is no backend."""
    found = find(value) if isinstance(value, str) else None
    if found is None:
        raise ValueError(f"unknown agent backend {value!r}; use {spellings()} or a callable")
    kind, argument = found
    if kind.options is None and not kind.prompted:
        options = {}  # a backend without settings ignores any it is given, as it always has
    return kind.factory(argument, **options) if kind.argument else kind.factory(**options)


def from_protocol(agent) -> Backend:
    """The backend of a protocol's agent section (``opalctl.protocol.schema.AgentSpec``), with the keys it reads."""
    found = find(agent.backend)
    if found is None:  # the schema refuses such a protocol; a lock written by another opalctl may still hold one
        raise BadInput(f"agent backend {agent.backend!r} is not available in this version of opalctl; use "
                       f"{spellings()}")
    kind, argument = found
    options: dict[str, Any] = {}
    if kind.options is not None:
        options = {key: getattr(agent, key) for key in kind.options.model_fields}
    if kind.prompted:
        options["prompt_text"] = prompt_text(agent.prompt)
    return kind.factory(argument, **options) if kind.argument else kind.factory(**options)


def lock_defaults(agent: dict[str, Any]) -> dict[str, Any]:
    """The resolved agent section (JSON) with what its backend records in the lock in place of its defaults."""
    kind, _ = find(agent["backend"])
    others = {key for other in kinds() if other is not kind for key in other.own_keys}
    agent = {key: value for key, value in agent.items() if key not in others}
    return {**agent, **kind.lock_defaults(agent)} if kind.lock_defaults else agent


def problems(agent, where: str) -> list[tuple[str, str]]:
    """``(key, what to do)`` for each setting of ``agent`` its backend refuses beyond the schema."""
    kind, _ = find(agent.backend)
    return kind.problems(agent, where) if kind.problems else []


def unready(agent) -> str | None:
    """What this machine lacks for ``agent``'s backend to answer (its key, its binary), or None."""
    kind, _ = find(agent.backend)
    return kind.unready(agent) if kind.unready else None


def unready_arms(protocol) -> list[str]:
    """``arm NAME: what it lacks`` for each agent arm of ``protocol`` whose backend cannot answer here."""
    return [f"arm {name}: {missing}" for name, arm in protocol.arms.items()
            if arm.agent is not None and (missing := unready(arm.agent))]


def waits(agent) -> bool:
    """Whether training waits seconds to minutes, and pays, for each of this agent's answers."""
    return find(agent.backend)[0].waits


def forecast_model(agent) -> tuple[str, str]:
    """The model and effort whose figures forecast a waiting agent (``opalctl.opal.estimate``)."""
    return agent.model or DEFAULT_MODEL, agent.effort
