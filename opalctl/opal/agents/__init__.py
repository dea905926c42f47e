"""Backends: who answers a decision. Each edits the programs in the workspace and returns a rationale.

``keep`` never changes anything; a Python callable ``fn(workspace, message) -> rationale`` is called as is;
``heuristic`` is a deterministic offline agent (the embedded default); ``anthropic`` (the Messages API),
``claude-code`` (the Claude Code CLI) and ``replay:<run folder>`` (a recorded run's programs, no agent) take their
settings as keyword options. Which names exist, and what each reads, is ``opalctl.opal.agents.registry``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opalctl.opal.agents import registry
from opalctl.opal.agents.base import Answer, Backend, FunctionBackend


def make_backend(backend: str | Callable | Backend, **options: Any) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if callable(backend):
        return FunctionBackend(backend)
    return registry.create(str(backend), **options)


__all__ = ["Answer", "Backend", "make_backend"]
