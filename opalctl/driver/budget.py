"""Budget clocks and the accounting of the budget loop.

An arm is compared with another at equal compute, so what counts as compute must be measured the same way for
every arm and added up the same way on every run, resumed or not. Two pieces do that, and nothing else:

- a ``Clock`` measures one whole update (``start()`` before the batch is drawn, ``stop(token)`` after the
  optimizer step) and says how much to charge for it. Evaluation, checkpoint writes, log writes and agent waiting
  happen outside these intervals, so they are never charged;
- a ``BudgetMeter`` adds the charges up, says which stage boundaries (fractions of the budget) each update
  reached, and says when the budget is spent. An update is never cut short: the run stops after the first update
  whose charge reaches 100 %, and the excess is kept as ``overshoot``.

A run's loop holds the two together as its ``TrainingBudget``, with the charge of agent code that ran outside the
timed updates (``PendingCharge``), which the next update carries.

Floating point. A boundary is reached when ``used / total >= fraction``: the running sum of the charges, in the
order they were made, divided by the total, compared with the fraction exactly as the protocol wrote it. Both
sides are computed the same way every time (the sum is restored bit for bit on resume, and ``fraction_used`` is
the very quantity compared), so a report never depends on when or how often it is asked. Dividing, rather than
comparing ``used >= fraction * total``, keeps whole-update budgets exact: with 25 updates and a fraction of 0.28,
``0.28 * 25`` is 7.000000000000001 in floating point and the boundary would slip to update 8, whereas ``7 / 25``
rounds to the very double that ``0.28`` denotes, so the boundary falls at update 7 as anyone would expect. The
budget is spent when ``used >= total``, the same test at the fraction 1.0.

The clocks form a registry (``CLOCKS``, ``clock_spec``): each clock class declares, beside how it measures,
everything the rest of opalctl needs to know about it (whether its charges are CPU seconds, whether it needs CUDA,
how the pilot projects updates from measured seconds per update, which stage seconds compare plots it against,
the sentence for a report's limitations). Adding a clock is one new ``Clock`` subclass decorated with
``@register`` and its tests; nothing else switches on a clock's name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opalctl.errors import BadInput, OpalctlError
from opalctl.formats import RecordDamaged

_INFINITY = float("inf")


class UnknownClock(BadInput):
    """A protocol names a budget clock this opalctl does not have (exit 2)."""


class BudgetMismatch(OpalctlError):
    """A resume checkpoint's budget is not the run's (exit 1)."""


def require_cuda(what: str, advice: str) -> None:
    """The one CUDA check: refuse ``what`` (a sentence's start) when torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise BadInput(f"{what} but this machine has no CUDA device; {advice}")


class Clock:
    """Measures one update. ``stop(start())`` is the amount to charge, in the clock's unit (seconds or updates).

    The class attributes and class methods are the clock's declaration in the registry (see the module docstring).
    """

    name = "clock"
    unit = "seconds"
    cpu_charges = False  # its charges are this process's CPU seconds (a steps line's ``cpu`` is the charge)
    needs_cuda = False  # it measures on a CUDA device, so training.device must be cuda
    compare_seconds = "train_wall_seconds"  # the stage record's seconds that compare plots this clock's runs against
    # how one update's charges on the ranks of a torchrun run combine into the one charge every rank's meter takes
    # (driver/ranks.py): the slowest rank for a time or a count every rank spends together, the sum for CPU seconds
    combine = "max"

    @classmethod
    def make(cls, device: Any = None) -> Clock:
        """The clock that measures a run on ``device``."""
        return cls()

    @classmethod
    def projected_updates(cls, amount: float, cpu_per_update: float, wall_per_update: float) -> float:
        """How many updates a budget of ``amount`` buys, from the pilot's measured seconds per update."""
        per_update = cpu_per_update if cls.cpu_charges else wall_per_update
        return amount / per_update if per_update > 0 else _INFINITY

    @classmethod
    def limitation(cls, threads: int) -> str:  # pragma: no cover - interface
        """The sentence a run's report lists among its limitations about this clock."""
        raise NotImplementedError

    @classmethod
    def agent_code_charge(cls, cpu_seconds: float, wall_seconds: float) -> float:
        """What agent code that ran outside the timed updates (a program's ``build()`` at a decision, its
        ``state_dict()`` at a checkpoint) is charged on this clock: nothing by default, where the clock charges no
        time (it is recorded in the agent figures, and compare shows it)."""
        return 0.0

    def start(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def stop(self, token: Any) -> float:  # pragma: no cover - interface
        raise NotImplementedError


CLOCKS: dict[str, type[Clock]] = {}  # the registry, in the order a protocol's error message lists the choices


def register(cls: type[Clock]) -> type[Clock]:
    CLOCKS[cls.name] = cls
    return cls


def clock_spec(name: str) -> type[Clock]:
    """The registered clock class a protocol's ``budget.clock`` names."""
    try:
        return CLOCKS[name]
    except KeyError:
        raise UnknownClock(f"unknown budget clock {name!r}; set budget.clock to one of "
                           f"{', '.join(CLOCKS)}") from None


@register
class CpuClock(Clock):
    """Process CPU time (every thread of the process); meaningful only with the thread count fixed by the run."""

    name = "cpu"
    cpu_charges = True
    combine = "sum"  # the CPU seconds all ranks spent on the update
    compare_seconds = "train_cpu_seconds"

    @classmethod
    def limitation(cls, threads: int) -> str:
        return (f"The cpu clock counts this process's CPU time on {threads} thread(s); it is comparable only "
                f"between runs with the same thread count on the same kind of machine.")

    @classmethod
    def agent_code_charge(cls, cpu_seconds: float, wall_seconds: float) -> float:
        return cpu_seconds

    def start(self) -> float:
        return time.process_time()

    def stop(self, token: float) -> float:
        return max(time.process_time() - token, 0.0)


@register
class GpuClock(Clock):
    """Device time of each update, from CUDA events recorded on the current stream of ``device``.

    ``start`` records an event before the update's work is queued; ``stop`` records one after it, waits for that
    event (so the update's kernels have finished) and charges the time between the two events. Work queued on
    other streams is not counted. torch is imported here, never at module import, so ``opalctl --help`` stays
    instant and CPU-only machines never touch CUDA. The pilot, which may run without CUDA, projects it from wall
    time.
    """

    name = "gpu"
    needs_cuda = True

    def __init__(self, device: Any = None):
        import torch

        require_cuda("the budget clock is `gpu`", "run on a machine with a GPU or choose the cpu, wall or updates "
                                                  "clock in the protocol")
        self._torch = torch
        self.device = torch.device("cuda") if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise OpalctlError(f"the `gpu` budget clock needs a CUDA device, not {str(self.device)!r}; set "
                               f"training.device to cuda or choose another clock")

    @classmethod
    def make(cls, device: Any = None) -> Clock:
        return cls(device)

    @classmethod
    def limitation(cls, threads: int) -> str:
        return "The gpu clock counts device time of each update; host-side work between kernels is not charged."

    @classmethod
    def agent_code_charge(cls, cpu_seconds: float, wall_seconds: float) -> float:
        # agent code outside the updates is not timed with events; its wall seconds bound the device time it can
        # have kept the device busy while it ran, so the charge never falls short of what it used
        return wall_seconds

    def _event(self) -> Any:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def start(self) -> Any:
        return self._event()

    def stop(self, token: Any) -> float:
        end = self._event()
        end.synchronize()
        return max(token.elapsed_time(end) / 1000.0, 0.0)  # elapsed_time is in milliseconds


@register
class WallClock(Clock):
    """Elapsed time on a monotonic clock, whatever else the machine is doing."""

    name = "wall"

    @classmethod
    def limitation(cls, threads: int) -> str:
        return "The wall clock includes whatever else the machine was doing; treat small differences as noise."

    @classmethod
    def agent_code_charge(cls, cpu_seconds: float, wall_seconds: float) -> float:
        return wall_seconds

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, token: float) -> float:
        return max(time.perf_counter() - token, 0.0)


@register
class UpdatesClock(Clock):
    """A count: every update costs exactly one, however long it took."""

    name = "updates"
    unit = "updates"
    compare_seconds = "train_cpu_seconds"

    @classmethod
    def projected_updates(cls, amount: float, cpu_per_update: float, wall_per_update: float) -> float:
        return float(amount)

    @classmethod
    def limitation(cls, threads: int) -> str:
        return ("The updates clock counts updates, not compute: arms whose updates cost differently are not at "
                "equal compute.")

    def start(self) -> None:
        return None

    def stop(self, token: None) -> float:
        return 1.0


class PendingCharge:
    """The charge of agent code that ran outside the timed updates (a program's ``build()`` at a decision, its
    ``state_dict()`` at a checkpoint, ``load_state_dict()`` at a resume), waiting to be added to the next update's:
    the meter charges whole updates only, and under torchrun the ranks combine one charge per update."""

    def __init__(self, amount: float = 0.0):
        self.amount = amount


class ChargingClock:
    """A clock whose charge for an update includes the agent code's ``PendingCharge`` from before it (an agent arm's
    clock; it is the one a torchrun world's ranks then combine)."""

    def __init__(self, clock: Clock, pending: PendingCharge):
        self.clock, self.pending = clock, pending

    def start(self) -> Any:
        return self.clock.start()

    def stop(self, token: Any) -> float:
        charge = self.clock.stop(token)
        if self.pending.amount:
            charge, self.pending.amount = charge + self.pending.amount, 0.0
        return charge


@dataclass
class TrainingBudget:
    """One run's budget as its loop charges it: the ``meter`` the updates fill, the ``clock`` that times each one (an
    agent arm's a ``ChargingClock`` over ``pending``, under torchrun the ranks' combined charge), and ``pending``,
    the agent code's charge the next update carries, priced by the protocol's clock (``Clock.agent_code_charge``)."""

    meter: BudgetMeter
    clock: Any  # a Clock, or a clock that wraps one (ChargingClock, driver/ranks.py's combined clock)
    pending: PendingCharge
    price_agent_code: Callable[[float, float], float]

    def charge_agent_code(self, cpu_seconds: float, wall_seconds: float) -> None:
        """Agent code ran outside the timed updates for these seconds: the next update carries its charge."""
        self.pending.amount += self.price_agent_code(cpu_seconds, wall_seconds)


def make_clock(name: str, device: Any = None) -> Clock:
    """The clock a protocol's ``budget.clock`` names; ``device`` matters only for ``gpu``."""
    return clock_spec(name).make(device)


class BudgetSpent(RuntimeError):
    """An update was charged after the budget was spent: a bug in the loop that calls the meter."""


class BudgetMeter:
    """Adds up whole updates' charges against ``total`` and reports the stage boundaries each update reaches.

    ``fractions`` must increase strictly within (0, 1]; boundary ``k`` lies at ``fractions[k]`` of ``total`` and is
    reported once, by the first update that reaches or crosses it (see the module docstring for the exact test).
    """

    def __init__(self, total: float, fractions: list[float]):
        total = float(total)
        if not (math.isfinite(total) and total > 0):
            raise ValueError(f"a budget total must be a positive finite number, not {total!r}")
        fractions = [float(f) for f in fractions]
        if any(not (0.0 < f <= 1.0) for f in fractions):
            raise ValueError(f"budget fractions must lie in (0, 1], got {fractions}")
        if any(b <= a for a, b in zip(fractions, fractions[1:], strict=False)):
            raise ValueError(f"budget fractions must increase strictly, got {fractions}")
        self.total = total
        self.fractions = fractions
        # read by the loop after every update, so plain attributes rather than properties; only charge() and
        # load_state_dict() change them
        self.used = 0.0  # the sum of the charges so far
        self.updates = 0  # updates charged so far
        self.done = False  # the budget is spent (the last update reached the total)
        self._reported = 0  # boundaries 0 .. _reported-1 have been reported

    @property
    def fraction_used(self) -> float:
        return self.used / self.total

    @property
    def overshoot(self) -> float:
        """How far the last update carried the run past the total (0.0 until the budget is spent)."""
        return self.used - self.total if self.done else 0.0

    @property
    def reported(self) -> int:
        """How many boundaries have been reported so far (they are reported in order)."""
        return self._reported

    def charge(self, amount: float) -> list[int]:
        """Add one whole update's charge; return the indices of the boundaries it reached, in order (empty on
        most updates). This runs once per update, so it is kept to a few operations."""
        if self.done:
            raise BudgetSpent(f"the budget of {self.total!r} was spent after update {self.updates}; stop the "
                              f"loop when `done` is true instead of charging another update")
        if not 0.0 <= amount < _INFINITY:  # also false for NaN (and a TypeError for what is not a number)
            raise ValueError(f"an update's charge must be a finite number >= 0, not {amount!r}")
        used = self.used = self.used + amount
        self.updates += 1
        if used >= self.total:
            self.done = True
        if self._reported == len(self.fractions) or used / self.total < self.fractions[self._reported]:
            return []
        reached = []
        fraction_used = used / self.total
        while self._reported < len(self.fractions) and fraction_used >= self.fractions[self._reported]:
            reached.append(self._reported)
            self._reported += 1
        return reached

    def state_dict(self) -> dict:
        """Plain JSON-able values; a float survives ``json`` bit for bit, so a resumed run continues exactly."""
        return {"total": self.total, "fractions": list(self.fractions), "used": self.used,
                "updates": self.updates, "reported": self._reported, "done": self.done}

    def load_state_dict(self, state: dict) -> None:
        if float(state["total"]) != self.total or [float(f) for f in state["fractions"]] != self.fractions:
            raise BudgetMismatch(f"the saved budget (total {state['total']!r}, fractions {state['fractions']}) is "
                                 f"not this run's (total {self.total!r}, fractions {self.fractions}); resume with the "
                                 f"protocol the run started with")
        used, updates, reported = float(state["used"]), int(state["updates"]), int(state["reported"])
        if not (math.isfinite(used) and used >= 0 and updates >= 0 and 0 <= reported <= len(self.fractions)):
            raise RecordDamaged(f"the saved budget state is damaged (used {used!r}, updates {updates}, reported "
                                f"{reported}); resume from an earlier checkpoint")
        self.used, self.updates, self._reported = used, updates, reported
        self.done = bool(state["done"])
