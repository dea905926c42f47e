"""One arm against the baseline on one metric, in plain words, built only from the paired figures.

The verdict claims a difference only when the exact test's p is below ``ALPHA``; otherwise it says the seeds
cannot tell, and why (too few seeds for any p to reach the level, or a spread too wide for the difference), with
the planning figure of how many seeds would. It never names a winner on fewer seeds than the test needs.
"""

from __future__ import annotations

from typing import Any

from opalctl.compare.significance import ALPHA, TEST_MIN_SEEDS


def signed(value: float) -> str:
    """A difference with its sign and at most four significant digits: +8, -0.0123, +261.3."""
    return f"{value:+.4g}"


def p_text(figure: dict[str, Any]) -> str:
    """``exact p = 0.25`` (or ``p ≈ 0.031`` when drawn at random)."""
    return ("exact p = " if figure["p_exact"] else "p ≈ ") + f"{figure['p_value']:.2g}"


def verdict(arm: str, baseline: str, metric: str, figure: dict[str, Any], flags: list[str] | None = None,
            decisions=None) -> str:
    """The sentence for ``figure``, a result of ``statistics.paired``, followed by what the arm's runs flag
    (compare/flags.py): no verdict is read without it. An agent arm that acted on no seed gets, in its place, the
    sentence saying so; one that did not act on every seed, the verdict and which seeds (``decisions``, an
    ``ArmDecisions`` of compare/decisions.py)."""
    if decisions is not None and decisions.instead_of_verdict:
        said = decisions.instead_of_verdict
    else:
        said = _verdict(arm, baseline, metric, figure) + (decisions.note if decisions is not None else "")
    if flags:
        said += f" Flagged: {'; '.join(flags)}."
    return said


def _verdict(arm: str, baseline: str, metric: str, figure: dict[str, Any]) -> str:
    head = f"{arm} vs {baseline} on {metric}: "
    n = figure["n"]
    if n == 0:
        return head + "no seed was finished by both arms, so there is nothing to compare."
    if all(d == 0 for d in figure["differences"]):
        return head + f"identical on {_seeds_word(n)}: no difference at all."
    mean = figure["mean_difference"]
    if n == 1:
        return head + (f"{signed(mean)} on the one common seed; one seed cannot tell a difference from noise "
                       f"(the exact test needs at least {TEST_MIN_SEEDS} seeds to reach p < {ALPHA:g}).")
    counted = f"{signed(mean)} ({figure['wins']} of {n} seeds better"
    counted += f", {figure['losses']} worse)" if figure["losses"] else ")"
    tested = f"{counted}, {p_text(figure)}"
    if figure["p_value"] < ALPHA:
        better = (mean > 0) == figure["higher_is_better"]
        return head + f"{tested}: {arm} is {'better' if better else 'worse'} than {baseline} across {n} seeds."
    reason = (f"not distinguishable with {n} seeds (no result of {n} seeds can reach p < {ALPHA:g})"
              if n < TEST_MIN_SEEDS else f"not distinguishable with {n} seeds")
    needed = figure["seeds_needed"]
    if needed is not None and needed > n:
        reason += f"; about {needed} seeds would tell a difference this size"
    return head + f"{tested}: {reason}."


def _seeds_word(n: int) -> str:
    return {1: "the one seed", 2: "both seeds"}.get(n, f"all {n} seeds")
