"""When the agent is asked: decision points as fractions of the budget, plus wake-ups within a cap.

``front`` puts a fifth of the decisions (at least one) in the first tenth of the budget, where a bad start is
cheapest to fix, and spreads the rest evenly over the remainder; ``uniform`` spreads all of them evenly;
a list gives the fractions explicitly. No decision is placed at 0 (nothing has been observed yet) or at 1
(nothing would be left to change). Wake-ups (the analysis asks, or a loss is not finite) add decisions, at most
``max_wakes`` of them.

``SchedulerOwnership`` holds the other schedule a run has, the learning rate's, to one owner.
"""

from __future__ import annotations

import math

from opalctl.errors import OpalctlError

EARLY_SPAN = 0.1


def decision_fractions(decisions: int, schedule: str | list[float]) -> list[float]:
    if isinstance(schedule, (list, tuple)):
        fractions = sorted(float(f) for f in schedule)
        if any(not 0.0 < f < 1.0 for f in fractions):
            raise ValueError("explicit decision fractions must lie strictly between 0 and 1")
        return fractions
    if decisions < 1:
        return []
    if schedule == "uniform":
        return [i / (decisions + 1) for i in range(1, decisions + 1)]
    if schedule == "front":
        early = max(1, math.ceil(decisions / 5))
        rest = decisions - early
        fractions = [EARLY_SPAN * i / early for i in range(1, early + 1)]
        fractions += [EARLY_SPAN + (1 - EARLY_SPAN) * i / (rest + 1) for i in range(1, rest + 1)]
        return fractions
    raise ValueError(f"unknown decision schedule {schedule!r}; use 'front', 'uniform' or a list of fractions")


class DecisionSchedule:
    """Which decision is due next. State is plain data, saved with the optimizer."""

    def __init__(self, fractions: list[float], max_wakes: int):
        self.fractions = list(fractions)
        self.next_index = 0
        self.max_wakes = max_wakes
        self.wakes = 0

    def due(self, progress: float) -> bool:
        return self.next_index < len(self.fractions) and progress >= self.fractions[self.next_index]

    def take(self, progress: float) -> None:
        """Consume every scheduled point already passed (one decision answers all of them)."""
        while self.due(progress):
            self.next_index += 1

    def can_wake(self) -> bool:
        return self.wakes < self.max_wakes

    def take_wake(self) -> None:
        self.wakes += 1

    @property
    def remaining(self) -> int:
        return len(self.fractions) - self.next_index

    def state_dict(self) -> dict:
        return {"fractions": list(self.fractions), "next_index": self.next_index, "max_wakes": self.max_wakes,
                "wakes": self.wakes}

    def load_state_dict(self, state: dict) -> None:
        self.fractions = list(state["fractions"])
        self.next_index = int(state["next_index"])
        self.max_wakes = int(state["max_wakes"])
        self.wakes = int(state["wakes"])


class SchedulerShared(OpalctlError):
    """The scheduler handed to ``wrap`` was stepped by something else too (it would advance twice per update)."""


class SchedulerOwnership:
    """A scheduler handed to ``wrap`` has one owner, the running program: ``seen`` is its ``last_epoch`` when the
    optimizer last let go of it (the end of a step, a loaded state), and any other value at the next step means
    someone else stepped it in between."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.seen = scheduler.last_epoch

    @classmethod
    def of(cls, scheduler) -> SchedulerOwnership | None:
        """The ownership of ``scheduler``; None without one or for a scheduler that keeps no ``last_epoch``."""
        return cls(scheduler) if isinstance(getattr(scheduler, "last_epoch", None), int) else None

    def refuse(self, update: int) -> None:
        raise SchedulerShared(
            f"the scheduler handed to wrap(scheduler=...) was stepped outside the agent optimizer before update "
            f"{update} (last_epoch {self.seen} became {self.scheduler.last_epoch}); give it to wrap and step it "
            f"nowhere else, or keep stepping it yourself and do not hand it to wrap")

    def settle(self) -> None:
        self.seen = self.scheduler.last_epoch
