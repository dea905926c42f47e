"""``AgentSettings``: every setting of an agent optimizer, in one frozen object, checked once when it is made.

It is what ``wrap(optimizer, model, settings)`` takes (``wrap``'s keyword arguments build one: a convenience,
the same names), what an agent arm builds from its protocol's ``agent:`` block (``driver/arm.py``), and what
``wrap_distributed`` hands each rank. ``AgentOptimizer`` reads it and never changes it; a changed copy is
``dataclasses.replace(settings, ...)`` (checked again).

This module imports neither torch nor the backends: a settings object can be made, and refused, before either is
loaded.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCKING = (True, False, "auto")


@dataclass(frozen=True)
class AgentSettings:
    """The settings of one agent optimizer (see ``opalctl.opal.wrap`` for what each does to a run).

    - ``goal``: a sentence shown to the agent; ``total_steps`` or ``progress`` (a callable returning the fraction of
      the budget used): decisions are scheduled on progress, which is updates done over ``total_steps`` without it.
    - ``backend``: ``"heuristic"``, ``"keep"``, a backend object, or a callable ``fn(workspace, message)``;
      ``decisions``, ``schedule`` (``"front"``, ``"uniform"`` or the fractions), ``blocking`` (True, False or
      ``"auto"``), ``max_lag`` (updates an ``auto`` answer may land late), ``max_wakes`` (decisions the analysis may
      add; None: half of ``decisions``, at least one), ``prompt`` (``"neutral"`` or ``"aggressive"``),
      ``max_cost_usd`` (the cost cap: no decision is asked once what is left is below its expected cost; None: no
      cap).
    - ``every`` (updates between two analyses), ``trial_steps`` (a new version's trial), ``step_time_limit``
      (seconds a program's call may take), ``manual_boundaries`` (the caller calls ``between_updates()``),
      ``eval_integrity`` (the evaluation-integrity check).
    - ``scheduler`` and ``clip``: what the starting program steps and clips with, as the user's loop would.
    - ``run_dir`` (this process's records), ``agent_dir`` (the agent host's workspace and records), ``notes_dir``
      (notes a person leaves, ``opalctl say``), ``secrets`` (strings kept out of every record), ``sources`` (the
      programs of version 0; None: the released starting programs).
    """

    goal: str | None = None
    total_steps: int | None = None
    progress: Callable[[], float] | None = None
    backend: Any = "heuristic"
    decisions: int = 8
    schedule: str | tuple[float, ...] = "front"
    blocking: bool | str = True
    every: int = 25
    trial_steps: int = 20
    run_dir: Path | None = None
    prompt: str = "neutral"
    scheduler: Any = None
    clip: float | None = None
    max_lag: int = 50
    step_time_limit: float = 10.0
    max_wakes: int | None = None
    manual_boundaries: bool = False
    secrets: tuple[str, ...] = ()
    eval_integrity: bool = True
    agent_dir: Path | None = None
    notes_dir: Path | None = None
    max_cost_usd: float | None = None
    sources: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        # the forms a caller may give, made one (a list of fractions or secrets, a path as a string)
        for name in ("run_dir", "agent_dir", "notes_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if isinstance(self.schedule, list):
            object.__setattr__(self, "schedule", tuple(self.schedule))
        object.__setattr__(self, "secrets", tuple(self.secrets or ()))
        if self.sources is not None:
            object.__setattr__(self, "sources", dict(self.sources))
        _check(self)

    @classmethod
    def of(cls, settings: AgentSettings | None = None, **keywords: Any) -> AgentSettings:
        """``settings`` (the defaults when None) with ``keywords`` in place of its fields, checked; a keyword that
        names no setting is refused with the names there are."""
        unknown = sorted(set(keywords) - FIELDS)
        if unknown:
            raise TypeError(f"{unknown[0]!r} is not a setting of the agent optimizer; the settings are "
                            f"{', '.join(sorted(FIELDS))}")
        return dataclasses.replace(settings, **keywords) if settings is not None else cls(**keywords)

    @property
    def wakes(self) -> int:
        """The most decisions the analysis may add: ``max_wakes``, or half of ``decisions`` (at least one)."""
        return self.max_wakes if self.max_wakes is not None else max(1, self.decisions // 2)


FIELDS = frozenset(field.name for field in dataclasses.fields(AgentSettings))


def _check(settings: AgentSettings) -> None:
    """The one place the settings are checked: a ``ValueError`` of one sentence naming the first that is wrong."""
    if settings.total_steps is None and settings.progress is None:
        raise ValueError("wrap() needs total_steps or progress (a callable returning the budget fraction used)")
    if settings.blocking not in BLOCKING or not isinstance(settings.blocking, (bool, str)):
        raise ValueError("blocking must be True, False or 'auto'")
    cap = settings.max_cost_usd
    if cap is not None and not (isinstance(cap, numbers.Real) and not isinstance(cap, bool) and math.isfinite(cap)
                                and cap > 0):
        raise ValueError(f"max_cost_usd must be a number of US dollars above 0, not {cap!r}; or None for no cap")
