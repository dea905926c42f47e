"""One arm against the baseline on one metric, in plain words, built only from the paired figures.

The verdict claims a difference only when the exact test's p is below ``ALPHA``; otherwise it says the exact
test cannot tell, and why (too few seeds for any p to reach the level, or a spread too wide for the difference).
Beside it, always, what the paired t-test sees under a normal model (the difference in sd of the differences'
spread, its p, d_z and t-interval), reported as what it is and never as a claim, and how many seeds each test
would need to detect a difference of the observed size. It never names a winner on fewer seeds than the exact
test needs.
"""

from __future__ import annotations

from typing import Any

from opalctl.compare.significance import ALPHA, POWER, TEST_MIN_SEEDS, smallest_sign_flip_p


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
                       f"(it has no spread for the t-test, and the exact test needs at least {TEST_MIN_SEEDS} seeds "
                       f"to reach p < {ALPHA:g}).")
    counted = f"{signed(mean)} ({figure['wins']} of {n} seeds better"
    counted += f", {figure['losses']} worse)" if figure["losses"] else ")"
    tested = f"{counted}, {p_text(figure)}"
    if figure["p_value"] < ALPHA:
        better = (mean > 0) == figure["higher_is_better"]
        return head + (f"{tested}: {arm} is {'better' if better else 'worse'} than {baseline} across {n} seeds; "
                       f"{_t_words(figure)}.")
    exact = (f"the exact test cannot decide with {n} seeds (its smallest p is {smallest_sign_flip_p(n):.2g})"
             if n < TEST_MIN_SEEDS else f"not distinguishable with {n} seeds by the exact test")
    return head + f"{tested}: {exact}. {_capital(_t_words(figure))}. {_capital(_seeds_words(figure))}."


def _t_words(figure: dict[str, Any]) -> str:
    """What the paired t-test sees, or why it sees nothing (every difference the same)."""
    if figure.get("t_p_value") is None:
        if figure.get("sd_difference") == 0.0:
            return (f"every seed's difference is the same ({signed(figure['mean_difference'])}), so d_z is infinite "
                    f"and the paired t-test undefined")
        return "the paired t-test is undefined here"
    d_z = figure["d_z"]
    return (f"under a normal model the difference is {_size(abs(d_z))} sd of the differences' spread (paired t "
            f"p = {figure['t_p_value']:.2g}, d_z = {_size(d_z, '+')}, {figure['confidence'] * 100:g} % t-interval "
            f"[{signed(figure['t_ci_low'])}, {signed(figure['t_ci_high'])}])")


def _seeds_words(figure: dict[str, Any]) -> str:
    """How many seeds each test would need for a difference of the observed size (``significance``)."""
    exact, t_needed = figure.get("seeds_needed"), figure.get("t_seeds_needed")
    if figure.get("sd_difference") == 0.0 and exact is not None:
        return f"{exact} seeds that agree as these do would let the exact test decide"
    if t_needed is None:
        if figure["mean_difference"] == 0.0:
            return "a mean difference of exactly 0 leaves no effect for more seeds to detect"
        return "more than a million seeds would be needed to detect a difference this small"
    return (f"to detect a difference this size with {POWER * 100:.0f} % power the t-test needs about {t_needed} "
            f"seeds, the exact test at least {exact}")


def _size(value: float, sign: str = "") -> str:
    """A size in sd: two significant digits (8.7, 0.18), whole beyond 100 (1104, not 1.1e+03)."""
    return f"{value:{sign}.2g}" if abs(value) < 100 else f"{value:{sign}.0f}"


def _capital(words: str) -> str:
    return words[:1].upper() + words[1:]


def _seeds_word(n: int) -> str:
    return {1: "the one seed", 2: "both seeds"}.get(n, f"all {n} seeds")
