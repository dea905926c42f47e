"""How long an agent-steered run will wait for its agent, and what the agent will cost, before anyone starts it.

The budget clock never charges the agent's time (docs/architecture.md): a comparison at equal compute is honest
about the optimizer, but silent about the hours a person waits while training stands still for an answer, and about
the bill. This module says both up front, from figures measured for one model at one effort, so that a user picks the
number of decisions and the blocking mode knowingly. ``opalctl estimate`` prints it, and so does the pilot for
agent arms.

The arithmetic, for each of the low / typical / high figures separately:

- waiting for n blocking decisions = first + (n - 1) x later;
- ``blocking=False`` waits 0: answers apply at a later update boundary while training goes on (a non-finite loss
  still stops training until the agent answers; that wait cannot be forecast and is left out);
- ``blocking="auto"`` waits for the first decision, and for a later one only when its answer would land more than
  ``max_lag`` updates late, that is when ``later / sec_per_step > max_lag``. A fast figure may fall within the lag
  while a slow one does not, so the test is made per figure;
- cost = first + (n - 1) x later whatever the blocking mode: not waiting for an answer does not make it cheaper.

When the user does not set the number of decisions, a run whose later decisions keep training waiting gets the
most decisions (at least one) whose typical waiting stays within ``WAITING_CAP_RATIO`` (4) times its own training
time, so that at the typical figures the agent adds at most four times the run's length in waiting (a single
decision may wait longer: there cannot be fewer); that count is also held to ``MAX_AUTO_DECISIONS``, the most a
protocol accepts. A run whose later decisions cost no waiting has
nothing to trade, and gets ``DEFAULT_DECISIONS`` (8), the default of ``wrap`` and of a protocol's agent. A count
the user sets is kept, with a line when its typical waiting exceeds the same 4x.

Figures for another model or effort would be guesses, so none are made up: the measured ones are used, and a line
says so. The cost of a model in the one price table (``opalctl.opal.prices``) is the measured decisions priced at
that model's prices (``decision_usd``); the cost cap (``max_cost_usd``) expects what this gives for the model its
backend calls.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from opalctl.errors import BadInput
from opalctl.opal.agents.default_model import DEFAULT_EFFORT, DEFAULT_MODEL
from opalctl.opal.prices import default_prices, price_ratio

# the model and effort the figures below were measured for (the defaults of an agent arm)
MEASURED_MODEL = DEFAULT_MODEL
MEASURED_EFFORT = DEFAULT_EFFORT

FIGURES: dict[tuple[str, str], dict[str, Any]] = {
    (MEASURED_MODEL, MEASURED_EFFORT): {
        "sample_decisions": 567,
        "first": {"seconds": {"low": 100.0, "typical": 250.0, "high": 430.0},
                  "usd": {"low": 0.30, "typical": 1.08, "high": 1.60}},
        "later": {"seconds": {"low": 10.0, "typical": 27.0, "high": 50.0},
                  "usd": {"low": 0.05, "typical": 0.23, "high": 0.38}},
    },
}
"""Per-decision time and cost, keyed by (model, effort).

Measured for MEASURED_MODEL at MEASURED_EFFORT over 567 decisions of agent-steered training runs. The
first decision reads the code and writes the first program, so it is much longer and dearer than the later ones,
which revise a program the agent already knows. low / typical / high are the spread seen across those decisions;
seconds are the wall time from request to answer, usd the billed cost of the decision.
"""

FIGURE_NAMES = ("low", "typical", "high")
WAITING_CAP_RATIO = 4
DEFAULT_DECISIONS = 8
MAX_AUTO_DECISIONS = 1000  # the most decisions a protocol's agent accepts (protocol schema, agent.decisions)
_ROUND = 6  # decimals kept in the results: removes floating-point noise such as 2.6900000000000004


def estimate(total_steps: int, sec_per_step: float, *, decisions: int | None = None, blocking: bool | str = True,
             max_lag: int = 50, model: str = MEASURED_MODEL, effort: str = MEASURED_EFFORT) -> dict:
    """Forecast the waiting and cost of a run of ``total_steps`` updates at ``sec_per_step`` seconds each.

    Returns plain JSON-able data: the inputs, ``training_seconds``, ``decisions`` and ``decisions_source``
    ("user" or "auto"), ``waiting_seconds`` and ``cost_usd`` (each ``{"low", "typical", "high"}``),
    ``waiting_ratio`` (typical waiting / training seconds), ``lines`` (sentences for the user) and ``measured``
    (the model and effort the figures come from). Raises ``BadInput`` for an input that makes no forecast.
    """
    total_steps, sec_per_step, decisions, max_lag = _checked(total_steps, sec_per_step, decisions, blocking, max_lag,
                                                             model, effort)
    training = _training_seconds(total_steps, sec_per_step)
    cap = WAITING_CAP_RATIO * training
    measured_key = (model, effort) if (model, effort) in FIGURES else (MEASURED_MODEL, MEASURED_EFFORT)
    table = FIGURES[measured_key]
    waits = _Waiting(table, blocking, max_lag, sec_per_step)

    source = "user" if decisions is not None else "auto"
    lines: list[str] = []
    if decisions is None:
        decisions, chosen = _chosen_decisions(waits, blocking, training, cap)
        lines.append(chosen)
    typical = waits.seconds(decisions, "typical")
    if source == "user" and typical > cap:
        lines.append(f"The {decisions} decision{_s(decisions)} asked for typically "
                     f"wait{'s' if decisions == 1 else ''} {_seconds(typical)}, more than {_cap_words(training, cap)}; consider fewer decisions, "
                     f"blocking=\"auto\" or False, or a longer run.")
    elif source == "auto" and not waits.later["typical"] and typical > cap:
        lines.append(f"Even the first decision typically waits {_seconds(typical)}, more than "
                     f"{_cap_words(training, cap)}; consider blocking=False or a longer run.")
    lines.append(_blocking_line(blocking, max_lag, sec_per_step, waits.later_s, waits.lag_updates, waits.later))
    if (model, effort) not in FIGURES:
        priced = (f"; their cost is priced at {model}'s prices" if model != MEASURED_MODEL and decision_usd(model)
                  else "")
        lines.append(f"These figures were measured for {MEASURED_MODEL} at effort {MEASURED_EFFORT}, not for "
                     f"{model} at effort {effort}, and may not hold for it{priced}.")

    usd = decision_usd(model) or decision_usd(MEASURED_MODEL)
    first_usd, later_usd = usd["first"], usd["later"]
    return {
        "total_steps": total_steps,
        "sec_per_step": sec_per_step,
        "training_seconds": training,
        "decisions": decisions,
        "decisions_source": source,
        "blocking": blocking,
        "max_lag": max_lag,
        "model": model,
        "effort": effort,
        "waiting_seconds": {name: round(waits.seconds(decisions, name), _ROUND) for name in FIGURE_NAMES},
        "cost_usd": {name: round(first_usd[name] + (decisions - 1) * later_usd[name], _ROUND) for name in FIGURE_NAMES},
        "waiting_ratio": typical / training,
        "lines": lines,
        "measured": {"model": measured_key[0], "effort": measured_key[1],
                     "decisions": table["sample_decisions"]},
    }


def decision_usd(model: str | None, prices: dict[str, float] | None = None) -> dict[str, dict[str, float]] | None:
    """The cost of a ``first`` and of a ``later`` decision (each ``{"low", "typical", "high"}``, USD) of ``model``:
    the measured decisions (MEASURED_MODEL, MEASURED_EFFORT) priced at ``prices``, or at ``model``'s in the price
    table; None when ``model`` is not in the table and no prices are given."""
    own = prices if prices is not None else default_prices(model)
    if own is None:
        return None
    ratio = price_ratio(own, default_prices(MEASURED_MODEL))
    measured = FIGURES[(MEASURED_MODEL, MEASURED_EFFORT)]
    return {which: {name: measured[which]["usd"][name] * ratio for name in FIGURE_NAMES} for which in ("first", "later")}


class _Waiting:
    """What training waits for, per figure (low / typical / high): the first answer, and each later one."""

    def __init__(self, table: dict[str, Any], blocking: bool | str, max_lag: int, sec_per_step: float):
        self.first_s, self.later_s = table["first"]["seconds"], table["later"]["seconds"]
        self.lag_updates = {name: self.later_s[name] / sec_per_step for name in FIGURE_NAMES}
        if blocking is True or blocking is False:
            self.first = {name: blocking for name in FIGURE_NAMES}
            self.later = {name: blocking for name in FIGURE_NAMES}
        else:  # auto: a fast figure may land within the lag while a slow one does not
            self.first = {name: True for name in FIGURE_NAMES}
            self.later = {name: not (self.lag_updates[name] <= max_lag) for name in FIGURE_NAMES}

    def seconds(self, n: int, name: str) -> float:
        """Seconds training waits for ``n`` decisions at figure ``name``."""
        first = self.first_s[name] if self.first[name] else 0.0
        later = self.later_s[name] if self.later[name] else 0.0
        return first + (n - 1) * later


def _chosen_decisions(waits: _Waiting, blocking: bool | str, training: float, cap: float) -> tuple[int, str]:
    """The number of decisions when the user sets none, and the sentence that says why."""
    if not waits.later["typical"]:
        waited = "the agent's answers" if blocking is False else "the later decisions (typical figure)"
        return DEFAULT_DECISIONS, (f"Chose the default of {DEFAULT_DECISIONS} decisions: training does not wait for "
                                   f"{waited}, so their number does not lengthen the run; pass decisions to choose "
                                   f"another count.")
    most = _most_within(lambda n: waits.seconds(n, "typical"), cap)
    decisions = min(most, MAX_AUTO_DECISIONS)
    within = _cap_words(training, cap)
    typical = waits.seconds(decisions, "typical")
    if most > MAX_AUTO_DECISIONS:
        return decisions, (f"Chose {decisions} decisions, the most a protocol accepts: their typical waiting, "
                           f"{_seconds(typical)}, stays within {within}, which would allow {most:,}.")
    if typical <= cap:
        return decisions, (f"Chose {decisions} decision{_s(decisions)}, the most whose typical waiting, "
                           f"{_seconds(typical)}, stays within {within}; pass decisions to choose another count.")
    return decisions, (f"Chose 1 decision, the fewest there can be: even the first typically waits "
                       f"{_seconds(waits.seconds(1, 'typical'))}, more than {within}; consider a longer run or "
                       f"blocking=False.")


def _checked(total_steps: Any, sec_per_step: Any, decisions: Any, blocking: Any, max_lag: Any, model: Any,
             effort: Any) -> tuple[int, float, int | None, int]:
    """The inputs as numbers, or ``BadInput`` naming the first that makes no forecast."""
    total_steps = _whole("total_steps", "the number of updates the run will make", total_steps, minimum=1)
    sec_per_step = _seconds_per_step(sec_per_step)
    if decisions is not None:
        decisions = _whole("decisions", "the number of agent decisions, or leave it unset to have one chosen",
                           decisions, minimum=1)
    if not (isinstance(blocking, bool) or (isinstance(blocking, str) and blocking == "auto")):
        raise BadInput(f"blocking must be True, False or \"auto\", not {blocking!r}; choose one of those three")
    max_lag = _whole("max_lag", "how many updates late an answer may land without training waiting for it",
                     max_lag, minimum=0)
    if not isinstance(model, str) or not isinstance(effort, str):
        raise BadInput(f"model and effort must be names (strings), not {model!r} and {effort!r}; pass e.g. "
                       f"model=\"{MEASURED_MODEL}\", effort=\"{MEASURED_EFFORT}\"")
    return total_steps, sec_per_step, decisions, max_lag


def _training_seconds(total_steps: int, sec_per_step: float) -> float:
    """The run's training time, refused when it (or the 4x cap on waiting) is not a finite number of seconds."""
    try:
        training = total_steps * sec_per_step
    except OverflowError:  # an int too large for a float
        training = math.inf
    if not math.isfinite(WAITING_CAP_RATIO * training):
        raise BadInput(f"total_steps x sec_per_step ({total_steps} x {sec_per_step!r}) is not a finite number of "
                       f"seconds; pass a realistic run length")
    return training


def format_lines(result: dict) -> list[str]:
    """A short summary of an ``estimate`` result for a person: training, decisions, waiting, cost, then its lines."""
    waiting, cost = result["waiting_seconds"], result["cost_usd"]
    chosen = "set by the user" if result["decisions_source"] == "user" else "chosen automatically"
    mode = {True: "blocking", False: "non-blocking"}.get(result["blocking"], f"blocking={result['blocking']!r}")
    summary = [
        f"training: {_seconds(result['training_seconds'])}, {result['total_steps']:,} updates x "
        f"{result['sec_per_step']:g} s",
        f"decisions: {result['decisions']}, {chosen}, {mode}",
        f"waiting: {_seconds(waiting['typical'])} typical, low {_seconds(waiting['low'])}, high "
        f"{_seconds(waiting['high'])}; {result['waiting_ratio']:.3g}x the training time",
        f"cost: {_usd(cost['typical'])} typical, low {_usd(cost['low'])}, high {_usd(cost['high'])}",
    ]
    return summary + list(result["lines"])


def _blocking_line(blocking: bool | str, max_lag: int, sec_per_step: float, later_s: dict, lag_updates: dict,
                   waits_later: dict) -> str:
    if blocking is True:
        return "Blocking: training waits for every decision's answer."
    if blocking is False:
        return ("Non-blocking: training goes on while the agent works, so no waiting is counted; a non-finite loss "
                "still makes training wait for an answer, which this forecast leaves out.")
    late = [name for name in FIGURE_NAMES if waits_later[name]]
    early = [name for name in FIGURE_NAMES if not waits_later[name]]
    spread = " / ".join(f"{lag_updates[name]:.3g}" for name in FIGURE_NAMES)
    seconds = " / ".join(f"{later_s[name]:g}" for name in FIGURE_NAMES)
    head = (f"Auto: training waits for the first decision; a later answer ({seconds} s, low / typical / high) "
            f"lands {spread} updates late at {sec_per_step:g} s per update")
    if not late:
        return f"{head}, within max_lag={max_lag}, so training does not wait for the later decisions."
    if len(late) == len(FIGURE_NAMES):
        return f"{head}, beyond max_lag={max_lag}, so training waits for every later decision as if blocking."
    return (f"{head}: beyond max_lag={max_lag} for the {' and '.join(late)} figure{_s(len(late))}, which "
            f"{'waits' if len(late) == 1 else 'wait'} for the later decisions as if blocking, and within it for "
            f"the {' and '.join(early)} figure{_s(len(early))}, which {'does' if len(early) == 1 else 'do'} not.")


def _most_within(waiting, cap: float) -> int:
    """The largest n >= 1 with waiting(n) <= cap (1 when even waiting(1) exceeds it); waiting must grow with n."""
    first, step = waiting(1), waiting(2) - waiting(1)
    if first > cap or step <= 0:
        return 1
    n = 1 + math.floor((cap - first) / step)
    # The division may round either way; settle on the count that the very comparison used everywhere accepts.
    while waiting(n + 1) <= cap:
        n += 1
    while n > 1 and waiting(n) > cap:
        n -= 1
    return n


def _whole(name: str, meaning: str, value: Any, *, minimum: int) -> int:
    number = None
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None or number < minimum:
        raise BadInput(f"{name} must be a whole number >= {minimum}, not {value!r}; pass {meaning}")
    return int(number)


def _seconds_per_step(value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    raise BadInput(f"sec_per_step must be a finite number of seconds > 0, not {value!r}; measure it with "
                   f"`opalctl pilot`")


def _cap_words(training: float, cap: float) -> str:
    return f"{WAITING_CAP_RATIO}x the training time of {_seconds(training)}, that is {_seconds(cap)}"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _seconds(seconds: float) -> str:
    """A duration for a person: seconds, as the figures are given, and a larger unit beside them once it helps."""
    text = f"{seconds:.3g} s" if seconds < 100 else f"{seconds:,.0f} s"
    if seconds >= 86400 * 2:
        return f"{text} ({seconds / 86400:,.1f} days)"
    if seconds >= 7200:
        return f"{text} ({seconds / 3600:.1f} h)"
    if seconds >= 120:
        return f"{text} ({seconds / 60:.1f} min)"
    return text


def _usd(amount: float) -> str:
    return f"${amount:,.2f}"
