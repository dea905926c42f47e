"""Backends: who answers a decision. Each edits the programs in the workspace and returns a rationale.

``keep`` never changes anything; a Python callable ``fn(workspace, message) -> rationale`` is called as is;
``heuristic`` is a deterministic offline agent (the embedded default); ``anthropic`` (the Messages API),
``claude-code`` (the Claude Code CLI) and ``replay:<run folder>`` (a recorded run's programs, no agent) take their
settings as keyword options.
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
    if backend == "anthropic":
        from opalctl.opal.agents.anthropic import AnthropicBackend

        return AnthropicBackend(**options)
    if backend == "claude-code":
        from opalctl.opal.agents.claude_code import ClaudeCodeBackend

        return ClaudeCodeBackend(**options)
    if isinstance(backend, str) and backend.startswith("replay:") and len(backend) > len("replay:"):
        from opalctl.opal.agents.replay import ReplayBackend

        return ReplayBackend(backend[len("replay:"):])
    raise ValueError(f"unknown agent backend {backend!r}; use 'keep', 'heuristic', 'anthropic', 'claude-code', "
                     f"'replay:<run folder>' or a callable")


__all__ = ["Answer", "Backend", "make_backend"]
