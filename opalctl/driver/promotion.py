"""The promotion policy: whether a stage's checkpoint replaces the incumbent.

The policy is written in the protocol before anything trains, and applied here as a pure function of three
evaluations, so a decision can be recomputed from the stage records by anyone, and no result seen during the run
can bend it. The candidate (this stage) is compared with the incumbent (the last promoted stage, the anchor at
first) and with the anchor (the original parent, fixed for the whole run):

- ``denominators``: counts that must be equal across all three (rows evaluated, say). A difference means the
  evaluations did not measure the same thing, and no decision taken on them would mean anything, so the run
  fails loudly (``DenominatorMismatch``) instead of deciding;
- ``floors`` (metric -> tolerance): candidate >= anchor - tolerance. The floor is set by the anchor and never
  moves with the incumbent, so a chain of small losses cannot add up to a large one;
- ``nondecreasing``: candidate >= incumbent; ``nonincreasing``: candidate <= incumbent;
- ``improve_any``: at least one listed metric strictly better than the incumbent (higher is better, unless the
  metric is also listed in ``nonincreasing``). When the list is empty, the ``nondecreasing`` metrics (higher is
  better) and the ``nonincreasing`` ones (lower is better) serve instead; when those are empty too, nothing can
  ever be promoted, and every decision says so.

Every rule is checked and every failure is given as a reason, not just the first. Only evaluation metrics named
by the policy are looked at: a falling training loss alone never promotes a checkpoint. An exact tie on every
improvement metric keeps the earlier checkpoint. A non-finite candidate value fails every rule it touches; a
metric a rule names that an evaluation lacks is an error, never a silent pass.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opalctl.errors import OpalctlError

RULES = ("denominators", "floors", "nondecreasing", "nonincreasing", "improve_any")


class DenominatorMismatch(OpalctlError):
    """The candidate, incumbent and anchor were not evaluated on the same rows: no decision is possible."""


class MissingMetric(OpalctlError):
    """A metric the selection policy names is missing from an evaluation."""


@dataclass
class Decision:
    promoted: bool
    reasons: list[str] = field(default_factory=list)  # every reason for a rejection (empty when promoted)
    checks: list[dict] = field(default_factory=list)  # per rule and metric: rule, metric, candidate, reference, passed

    def to_json(self) -> dict:
        """A plain dict for ``json.dumps``; non-finite numbers become the strings "nan", "inf" and "-inf"."""
        return {"promoted": self.promoted, "reasons": list(self.reasons),
                "checks": [{key: _plain(value) for key, value in check.items()} for check in self.checks]}


def _plain(value: Any) -> Any:
    """Python numbers only (a task may report numpy scalars), with non-finite floats as strings."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _rules(selection: Any) -> dict[str, Any]:
    """The five rules from a ``Selection`` model or a plain dict, with the same defaults (empty)."""
    if isinstance(selection, Mapping):
        unknown = sorted(set(selection) - set(RULES))
        if unknown:
            raise OpalctlError(f"the selection policy has unknown key(s) {', '.join(map(repr, unknown))}; "
                               f"use only {', '.join(RULES)}")
        get = selection.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(selection, name, default)
    rules: dict[str, Any] = {name: list(get(name, None) or []) for name in RULES if name != "floors"}
    floors = get("floors", None) or {}
    if not isinstance(floors, Mapping):
        raise OpalctlError("selection.floors must map each metric to its tolerance, e.g. {retention.correct: 2}")
    rules["floors"] = {}
    for metric, tolerance in floors.items():
        if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real) or not tolerance >= 0 \
                or not math.isfinite(tolerance):
            raise OpalctlError(f"selection.floors[{metric!r}] is {tolerance!r}; give a tolerance >= 0 (0 means the "
                               f"candidate may not fall below the anchor at all)")
        rules["floors"][str(metric)] = tolerance
    return rules


def _value(metrics: Mapping, metric: str, role: str) -> float | int:
    if metric not in metrics:
        known = ", ".join(sorted(metrics)) or "none"
        raise MissingMetric(f"the {role}'s evaluation has no metric {metric!r}, which the selection policy names "
                            f"(it has: {known}); fix the policy or the task's evaluation")
    value = metrics[metric]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MissingMetric(f"the {role}'s metric {metric!r} is {value!r}, not a number; the task's evaluation "
                            f"must report numbers")
    return value


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _not_finite(metric: str, value: float, rule: str, reference: float | int) -> str:
    return f"{metric} is {_show(value)}, not a finite number, which fails {rule} (reference {_show(reference)})"


def _show(value: float | int) -> str:
    """Counts read as counts: 126.0 is shown as 126, 0.75 as 0.75, nan as nan."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(float(value)) if isinstance(value, float) else str(value)


def _check_improvement(rules: dict, candidate: Mapping, incumbent: Mapping, checks: list[dict],
                       reasons: list[str]) -> None:
    """The improvement rule: some listed metric strictly better than the incumbent's (an exact tie keeps the
    earlier checkpoint)."""
    lower_is_better = set(rules["nonincreasing"])
    improve = rules["improve_any"] or rules["nondecreasing"] + rules["nonincreasing"]
    if not improve:
        reasons.append("the selection policy lists no improve_any, nondecreasing or nonincreasing metric, so no "
                       "stage can show an improvement and none is ever promoted")
    else:
        better, tied, compared = False, True, []
        for metric in improve:
            value, reference = _value(candidate, metric, "candidate"), _value(incumbent, metric, "incumbent")
            lower = metric in lower_is_better
            strictly = bool(_finite(value) and (value < reference if lower else value > reference))
            better = better or strictly
            tied = tied and _finite(value) and value == reference
            checks.append({"rule": "improve_any", "metric": metric, "candidate": value, "reference": reference,
                           "better": "lower" if lower else "higher", "passed": strictly})
            compared.append(f"{metric} {_show(value)} vs {_show(reference)}")
        if not better:
            if tied:
                reasons.append(f"tie with the incumbent ({'; '.join(compared)}), so the earlier checkpoint is kept")
            else:
                reasons.append(f"no improvement over the incumbent: no metric is strictly better "
                               f"({'; '.join(compared)})")


def decide(candidate: Mapping, incumbent: Mapping, anchor: Mapping, selection: Any) -> Decision:
    """Whether ``candidate`` is promoted over ``incumbent``, with every check and every reason recorded."""
    rules = _rules(selection)
    checks: list[dict] = []
    reasons: list[str] = []

    for metric in rules["denominators"]:
        values = [_value(m, metric, role) for m, role in
                  ((candidate, "candidate"), (incumbent, "incumbent"), (anchor, "anchor"))]
        if not (values[0] == values[1] == values[2]):
            raise DenominatorMismatch(
                f"denominator {metric!r} differs: candidate {_show(values[0])}, incumbent {_show(values[1])}, "
                f"anchor {_show(values[2])}; the evaluations did not cover the same rows, so check the data "
                f"files and the task's evaluation before running again")
        checks.append({"rule": "denominators", "metric": metric, "candidate": values[0], "reference": values[2],
                       "passed": True})

    for metric, tolerance in rules["floors"].items():
        value, base = _value(candidate, metric, "candidate"), _value(anchor, metric, "anchor")
        floor = base - tolerance
        passed = bool(_finite(value) and value >= floor)
        checks.append({"rule": "floors", "metric": metric, "candidate": value, "reference": base,
                       "tolerance": tolerance, "passed": passed})
        if not _finite(value):
            reasons.append(_not_finite(metric, value, "floors", base))
        elif not passed:
            reasons.append(f"{metric} {_show(value)} is below its floor {_show(floor)} (anchor {_show(base)} "
                           f"minus tolerance {_show(tolerance)})")

    for rule, word in (("nondecreasing", "fell below"), ("nonincreasing", "rose above")):
        for metric in rules[rule]:
            value, reference = _value(candidate, metric, "candidate"), _value(incumbent, metric, "incumbent")
            passed = bool(_finite(value) and (value >= reference if rule == "nondecreasing" else value <= reference))
            checks.append({"rule": rule, "metric": metric, "candidate": value, "reference": reference,
                           "passed": passed})
            if not _finite(value):
                reasons.append(_not_finite(metric, value, rule, reference))
            elif not passed:
                reasons.append(f"{metric} {_show(value)} {word} the incumbent's {_show(reference)} ({rule})")

    _check_improvement(rules, candidate, incumbent, checks, reasons)
    return Decision(promoted=not reasons, reasons=reasons, checks=checks)


def select(stages: Sequence[Mapping], anchor: Mapping, selection: Any) -> int | None:
    """Walk the stages in order as the run does; the index of the last promoted stage, or None (the anchor stays)."""
    incumbent, chosen = anchor, None
    for index, stage in enumerate(stages):
        if decide(stage, incumbent, anchor, selection).promoted:
            incumbent, chosen = stage, index
    return chosen
