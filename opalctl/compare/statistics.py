"""Paired statistics across seeds.

Seeds are the unit of replication: each seed gives every arm the same parent, the same data order and the same
evaluation rows, so the honest comparison of an arm with the baseline is the difference seed by seed, not the
difference of two means that each carry the seed-to-seed spread. Two tests read the differences
(``significance``): the exact sign-flip test, which assumes nothing and is the only one a verdict claims on, and
the paired t-test, which assumes the differences are roughly normal and says what they show under that model
(its Student t interval of the mean difference, d_z, its p), each with the seeds it would need for the observed
effect. The interval the tables and the verdict give is the t-interval: with 3 seeds a percentile bootstrap draws
from at most 10 distinct means and comes out far too narrow. The bootstrap interval (``ci_low``, ``ci_high``,
from a seeded numpy Generator so the same records always give the same figures) is still computed, for the
forest plot of the report and the readers of ``--json`` and ``--csv``, and marked unreliable below
``TEST_MIN_SEEDS`` seeds. Wins, ties and losses are counted with the metric's direction, and a tie is an exact tie
(the metrics are mostly counts). Every figure comes back as plain JSON-able values (None where it is undefined,
never an infinity).

A value that is not a finite number (a report holds ``null`` for a metric that was not finite) cannot be compared:
``NotComparable`` names it. Wrong arguments of a caller (``resamples``, ``confidence``, a curve out of order) are
``ValueError``s: they are bugs of the caller, not something a user can fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from opalctl.compare.significance import (
    ALPHA,
    CONFIDENCE,
    TEST_MIN_SEEDS,
    detectable_effect,
    exact_seeds_needed,
    paired_t,
    sign_flip_p,
    t_seeds_needed,
)
from opalctl.errors import OpalctlError

_CHUNK = 1000  # bootstrap resamples drawn at a time (fixed, so the draws never depend on memory)


class NotComparable(OpalctlError):
    """A figure to compare is not a finite number (exit 1); the sentence names the figure."""


def _check(values: Iterable[float], what: str) -> list[float]:
    out = []
    for value in values:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise NotComparable(f"{what} holds {value!r}, which is not a finite number; a run whose metric is not "
                                f"finite cannot be compared, so move that run's folder aside or run it again")
        out.append(number)
    return out


def summary(values: Iterable[float], what: str = "the values to summarise") -> dict:
    """Mean, sample standard deviation (ddof=1; 0.0 for one value), min, max and n; all None but n when empty.
    ``what`` names the values in the refusal of one that is not a finite number."""
    data = _check(values, what)
    n = len(data)
    if n == 0:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    array = np.asarray(data, dtype=np.float64)
    return {"mean": float(array.mean()), "std": float(array.std(ddof=1)) if n > 1 else 0.0,
            "min": float(array.min()), "max": float(array.max()), "n": n}


def bootstrap_interval(differences: list[float], *, resamples: int, confidence: float,
                       seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``differences`` (resampling seeds with replacement)."""
    n = len(differences)
    data = np.asarray(differences, dtype=np.float64)
    if n == 1:
        return float(data[0]), float(data[0])
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, _CHUNK):
        count = min(_CHUNK, resamples - start)
        means[start:start + count] = data[rng.integers(0, n, size=(count, n))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def paired(baseline: Mapping[int, float], arm: Mapping[int, float], *, higher_is_better: bool = True,
           resamples: int = 10000, confidence: float = CONFIDENCE, seed: int = 0, what: str = "metric") -> dict:
    """The arm against the baseline on the seeds both have: differences (arm - baseline), their mean with its
    t-interval and its bootstrap interval, d_z, both tests' p and seeds needed, and wins/ties/losses in the
    metric's direction.

    Seeds only one side has are listed under ``unpaired`` and left out of every figure. With no seed in common,
    every figure is None; with one, the interval is that single difference and ``note`` says ``n=1``.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, not {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, not {confidence}")
    seeds = sorted(set(baseline) & set(arm))
    base = _check((baseline[s] for s in seeds), f"the baseline's {what}")
    mine = _check((arm[s] for s in seeds), f"the arm's {what}")
    differences = [a - b for a, b in zip(mine, base, strict=True)]
    n = len(seeds)
    result = {
        "seeds": seeds,
        "unpaired": {"baseline": sorted(set(baseline) - set(arm)), "arm": sorted(set(arm) - set(baseline))},
        "n": n,
        "baseline": base,
        "arm": mine,
        "differences": differences,
        "mean_difference": None,
        "ci_low": None,
        "ci_high": None,
        "confidence": confidence,
        "resamples": resamples,
        "bootstrap_seed": seed,
        "higher_is_better": higher_is_better,
        "wins": 0,
        "ties": 0,
        "losses": 0,
        "p_value": None,
        "p_exact": True,
        "interval_reliable": False,
        "detectable_effect": None,
        "seeds_needed": None,  # the exact test's
        "note": None,
        "sd_difference": None,
        "d_z": None,
        "t_statistic": None,
        "t_df": None,
        "t_p_value": None,
        "t_ci_low": None,
        "t_ci_high": None,
        "t_seeds_needed": None,
        "t_note": None,
    }
    if n == 0:
        result["note"] = "n=0: no seed completed by both arms, so there is nothing to compare"
        return result
    result["mean_difference"] = float(np.mean(differences))
    result["ci_low"], result["ci_high"] = bootstrap_interval(differences, resamples=resamples,
                                                             confidence=confidence, seed=seed)
    sign = 1.0 if higher_is_better else -1.0
    result["wins"] = sum(1 for d in differences if sign * d > 0)
    result["ties"] = sum(1 for d in differences if d == 0)
    result["losses"] = sum(1 for d in differences if sign * d < 0)
    scale = max(abs(v) for v in (*base, *mine))
    result.update(_exact_test(differences, seed))
    result.update(paired_t(differences, confidence=confidence, scale=scale))
    result["t_seeds_needed"] = t_seeds_needed(result["d_z"])
    no_spread = result["sd_difference"] == 0.0 and result["mean_difference"] != 0.0
    result["seeds_needed"] = exact_seeds_needed(result["t_seeds_needed"], no_spread=no_spread)
    result["detectable_effect"] = detectable_effect(n, result["sd_difference"])
    return result


def _exact_test(differences: list[float], seed: int) -> dict:
    """The sign-flip test of ``differences`` (at least one), with the small-n note."""
    n = len(differences)
    p_value, exact = sign_flip_p(differences, seed=seed)
    note = None
    if n == 1:
        note = "n=1: one seed says nothing about spread, so neither test can say anything"
    elif n < TEST_MIN_SEEDS:
        note = (f"n={n}: below {TEST_MIN_SEEDS} seeds no exact p can reach {ALPHA:g} (and the bootstrap interval "
                f"is too narrow)")
    return {"p_value": p_value, "p_exact": exact, "interval_reliable": n >= TEST_MIN_SEEDS, "note": note}


def time_to_reach(curve: list[tuple[float, float]], target: float, higher_is_better: bool = True) -> float | None:
    """The first x (training seconds, updates) at which y reaches ``target`` (>=, or <= when lower is better).

    Points are taken in the order given, which must not go back in x; no interpolation between points, so the
    answer is a point the run actually recorded. A non-finite y never reaches anything. None when never reached.
    """
    previous = -math.inf
    for x, y in curve:
        x, y = float(x), float(y)
        if x < previous:
            raise ValueError(f"the curve goes back from x={previous!r} to x={x!r}; give its points in order of x")
        previous = x
        if math.isfinite(y) and (y >= target if higher_is_better else y <= target):
            return x
    return None
