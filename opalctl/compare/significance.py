"""How much a handful of seeds can say: two tests of the paired differences, each with its planning figures.

The test a verdict claims on is the sign-flip permutation test: if an arm made no difference, each seed's
difference was as likely to come out with the other sign, so the observed |sum| is compared with the |sum| under
every assignment of signs. With few seeds every assignment is enumerated (``EXACT_UP_TO``), so the p-value is
exact and nothing is assumed about the distribution. Its smallest possible value is 2 / 2^n (the observed signs
and their mirror image), which is why fewer than ``TEST_MIN_SEEDS`` seeds can never reach ``ALPHA``: a fact the
verdict states rather than hides.

Beside it, the paired t-test says what the same differences show under a normal model (its assumption: the
differences are roughly normal). With three seeds the exact test cannot decide anything, while a difference many
times the seeds' spread is plain to the t-test; both are reported, and only the exact test decides. The t-test
gives the interval of the mean difference (Student t, n - 1 degrees of freedom), the standardised effect
d_z = mean / sd of the differences, and the planning figures: the seeds the t-test needs to detect the observed
d_z at ``ALPHA`` with ``POWER`` (exact power from the noncentral t distribution, not a normal approximation), the
seeds the exact test needs (at least ``TEST_MIN_SEEDS``, and at least the t-test's: for normal differences the
t-test is the most powerful unbiased test, so the sign-flip test needs as many seeds or a few more; the figure is
a lower bound), and the smallest mean difference the seeds at hand would detect. The distributions come from
``scipy.special``.
"""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05  # the two-sided level a verdict calls a difference at
CONFIDENCE = 0.95  # the confidence of the intervals of a mean difference
POWER = 0.8  # the chance of detecting the effect that the planning figures aim for
EXACT_UP_TO = 16  # seeds up to which every sign assignment is enumerated (2^16 rows)
RANDOM_FLIPS = 20_000  # sign assignments drawn beyond that, from a seeded generator
# the fewest seeds whose exact test can reach ALPHA at all: the smallest p is 2 / 2^n
TEST_MIN_SEEDS = next(n for n in range(1, 64) if 2.0 ** (1 - n) < ALPHA)
_TOLERANCE = 1e-9  # relative: sums equal up to float rounding count as "as extreme"
# a spread of the differences below this fraction of the compared values is float rounding in "arm - baseline",
# not a spread: 2^-44 is about 250 times the rounding of one subtraction
_ROUNDING = 2.0 ** -44
# the noncentrality beyond which the t-test's power is 1 to double precision for every df >= 1 (its critical value is
# at most 12.71); scipy's noncentral t returns nan far beyond it, so larger values are clamped to it
_CERTAIN_NONCENTRALITY = 1e4
_NEGLIGIBLE = 1e-12  # a tail probability that changes no power figure
_MOST_SEEDS = 2 ** 20  # about a million: the search for seeds needed stops here (a d_z below about 0.003)


def sign_flip_p(differences: list[float], seed: int = 0) -> tuple[float | None, bool]:
    """The two-sided p-value of the sign-flip test and whether it is exact; (None, True) with no difference.

    Exact for up to ``EXACT_UP_TO`` differences; beyond, ``RANDOM_FLIPS`` assignments from a seeded generator
    with the observed one counted in, so p is never 0."""
    n = len(differences)
    if n == 0:
        return None, True
    data = np.asarray(differences, dtype=np.float64)
    observed = abs(float(data.sum()))
    limit = observed - _TOLERANCE * max(1.0, float(np.abs(data).sum()))
    if n <= EXACT_UP_TO:
        bits = (np.arange(2 ** n, dtype=np.int64)[:, None] >> np.arange(n, dtype=np.int64)) & 1
        sums = np.abs((1 - 2 * bits) @ data)
        return float(np.count_nonzero(sums >= limit)) / float(2 ** n), True
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=(RANDOM_FLIPS, n))
    extreme = int(np.count_nonzero(np.abs(signs @ data) >= limit))
    return (extreme + 1) / (RANDOM_FLIPS + 1), False


def smallest_sign_flip_p(n: int) -> float:
    """The smallest p-value the exact test can give with ``n`` seeds: every sign the same, 2 / 2^n."""
    return min(1.0, 2.0 ** (1 - n))


def spread(differences: list[float], scale: float = 0.0) -> float | None:
    """The sample standard deviation of the differences (ddof=1); None for fewer than two, and 0.0 when it is
    within float rounding of ``scale`` (the largest magnitude among the values whose differences these are)."""
    if len(differences) < 2:
        return None
    data = np.asarray(differences, dtype=np.float64)
    sd = float(data.std(ddof=1))
    return 0.0 if sd <= _ROUNDING * max(scale, float(np.abs(data).max())) else sd


def paired_t(differences: list[float], *, confidence: float, scale: float = 0.0) -> dict:
    """The paired t-test of ``differences`` (arm - baseline), two-sided, with the Student t interval of their mean
    at ``confidence`` and the standardised effect d_z; ``scale`` as in ``spread``.

    Every figure is None, and ``t_note`` says why, where the test is undefined: fewer than two seeds (no spread),
    all differences zero (nothing to test), or every difference the same non-zero value (no spread: d_z is
    infinite and t = mean / 0)."""
    from scipy import special

    n = len(differences)
    sd = spread(differences, scale)
    result = {"sd_difference": sd, "d_z": None, "t_statistic": None, "t_df": n - 1 if n > 1 else None,
              "t_p_value": None, "t_ci_low": None, "t_ci_high": None, "t_note": None}
    if sd is None:
        result["t_note"] = "one seed has no spread, so the t-test is undefined"
        return result
    mean = float(np.mean(np.asarray(differences, dtype=np.float64)))
    if sd == 0.0:
        result["t_ci_low"] = result["t_ci_high"] = mean
        result["t_note"] = ("every difference is zero: nothing to test" if mean == 0.0 else
                            "every seed's difference is the same, so there is no spread: d_z is infinite and the "
                            "t-test undefined")
        return result
    error = sd / math.sqrt(n)
    statistic = mean / error
    half = float(special.stdtrit(n - 1, 0.5 + confidence / 2.0)) * error
    result.update({"d_z": mean / sd, "t_statistic": statistic,
                   "t_p_value": float(2.0 * special.stdtr(n - 1, -abs(statistic))),
                   "t_ci_low": mean - half, "t_ci_high": mean + half})
    return result


def t_power(n: int, d_z: float) -> float:
    """The power of the two-sided paired t-test at ``ALPHA`` with ``n`` seeds when the true standardised effect is
    ``d_z``: the chance that |T| exceeds the critical value, T noncentral t with n - 1 df and noncentrality
    d_z * sqrt(n)."""
    from scipy import special

    df = n - 1
    critical = float(special.stdtrit(df, 1.0 - ALPHA / 2.0))
    noncentrality = min(abs(d_z) * math.sqrt(n), _CERTAIN_NONCENTRALITY)
    # scipy's noncentral t gives nan deep in a tail: below -critical it is the chance of the wrong sign, at most
    # P(Z < -noncentrality), dropped where that is under _NEGLIGIBLE; below +critical it is read from the mirror
    # image (T with -noncentrality above -critical) where the direct value is nan
    wrong_sign = (0.0 if special.ndtr(-noncentrality) < _NEGLIGIBLE
                  else float(special.nctdtr(df, noncentrality, -critical)))
    missed = float(special.nctdtr(df, noncentrality, critical))
    if not math.isfinite(missed):
        missed = 1.0 - float(special.nctdtr(df, -noncentrality, -critical))
    if not math.isfinite(missed) or not math.isfinite(wrong_sign):
        raise ArithmeticError(f"the noncentral t of {df} df and noncentrality {noncentrality!r} is not a number")
    return 1.0 - missed + wrong_sign


def t_seeds_needed(d_z: float | None) -> int | None:
    """The fewest seeds (at least two) whose paired t-test reaches ``POWER`` at ``ALPHA`` for a true effect of
    ``d_z``: a search over n of the exact power (``t_power``, monotone in n). None when there is no effect to
    detect (``d_z`` None or 0) or it would take more than ``_MOST_SEEDS``."""
    if d_z is None or d_z == 0.0 or not math.isfinite(d_z):
        return None
    low, high = 1, 2  # power(low) < POWER (n = 1 has no test), power(high) to be found >= POWER
    while t_power(high, d_z) < POWER:
        if high >= _MOST_SEEDS:
            return None
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if t_power(middle, d_z) >= POWER else (middle, high)
    return high


def exact_seeds_needed(t_needed: int | None, *, no_spread: bool = False) -> int | None:
    """The seeds the exact test needs for the observed effect: at least ``TEST_MIN_SEEDS`` (below, no p reaches
    ``ALPHA``) and at least the t-test's figure (for normal differences the t-test is the more powerful; the
    exact test may need a few more, so this is a lower bound). With no spread (every difference the same, not
    zero) the floor is the whole answer: ``TEST_MIN_SEEDS`` seeds that agree as these do reach p = 2 / 2^n <
    ``ALPHA``."""
    if no_spread:
        return TEST_MIN_SEEDS
    return None if t_needed is None else max(TEST_MIN_SEEDS, t_needed)


def detectable_effect(n: int, sd: float | None) -> float | None:
    """The smallest |mean difference| that ``n`` seeds with a spread of ``sd`` detect by the paired t-test at
    ``ALPHA`` with ``POWER``: sd times the d_z at which ``t_power`` reaches ``POWER`` (found by bisection). None
    with fewer than two seeds or no spread."""
    if n < 2 or not sd:
        return None
    low, high = 0.0, 1.0
    while t_power(n, high) < POWER:
        low, high = high, high * 2.0
    while high - low > 1e-12 * high:
        middle = (low + high) / 2.0
        low, high = (low, middle) if t_power(n, middle) >= POWER else (middle, high)
    return sd * high
