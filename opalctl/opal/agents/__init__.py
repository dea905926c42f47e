"""Backends: who answers a decision. Each edits the programs in the workspace and returns a rationale.

``keep`` never changes anything; a Python callable ``fn(workspace, message) -> rationale`` is called as is;
``heuristic`` is a deterministic offline agent (the embedded default). LLM backends plug in behind the same
interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opalctl.opal.agents.base import Answer, Backend, FunctionBackend, KeepBackend


def make_backend(backend: str | Callable | Backend, **options: Any) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if callable(backend):
        return FunctionBackend(backend)
    if backend == "keep":
        return KeepBackend()
    if backend == "heuristic":
        from opalctl.opal.agents.heuristic import HeuristicBackend

        return HeuristicBackend()
    raise ValueError(f"unknown agent backend {backend!r}; use 'keep', 'heuristic' or a callable")


__all__ = ["Answer", "Backend", "make_backend"]
