"""The exact sign-flip test against hand-enumerated cases and a brute-force enumeration, the paired t-test against
scipy.stats.ttest_rel, and the seeds needed against the power of the noncentral t computed by scipy.stats.nct."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from opalctl.compare import significance
from opalctl.compare.significance import (
    ALPHA,
    POWER,
    TEST_MIN_SEEDS,
    detectable_effect,
    exact_seeds_needed,
    sign_flip_p,
    smallest_sign_flip_p,
    t_seeds_needed,
)
from opalctl.compare.statistics import paired

RELATIVE = 1e-9


@pytest.mark.parametrize("differences, p, why", [
    ([3.0], 1.0, "+3 and -3 are both as extreme as 3"),
    ([2.0, 6.0], 0.5, "sums 8, 4, -4, -8: two of four reach |8|"),
    ([2.0, -2.0], 1.0, "the observed sum is 0, which every assignment reaches"),
    ([1.0, 2.0, 3.0], 0.25, "sums ±1±2±3: only 6 and -6 reach |6|, 2 of 8"),
    ([3.0, -1.0, 1.0], 0.75, "|sums| 5 3 3 1 1 3 3 5: six of eight reach 3"),
    ([1.0, 2.0, 3.0, 4.0, 5.0], 0.0625, "only all-plus and all-minus reach |15|, 2 of 32"),
    ([5.0, 4.0, 3.0, 2.0, -1.0], 0.125, "|sum| >= 13 flips nothing or only the 1, and their mirrors: 4 of 32"),
])
def test_the_sign_flip_p_value_equals_the_hand_enumerated_one(differences, p, why):
    assert sign_flip_p(differences) == (p, True), why


def test_the_enumeration_agrees_with_a_plain_loop_over_every_sign_assignment():
    differences = [0.3, -1.2, 2.5, 0.0, 4.1, -0.7, 1.9, 0.4]
    observed = abs(sum(differences))
    plain = sum(1 for signs in itertools.product((1, -1), repeat=len(differences))
                if abs(sum(s * d for s, d in zip(signs, differences))) >= observed - 1e-9) / 2 ** len(differences)
    assert sign_flip_p(differences) == (plain, True)


def test_beyond_the_exact_limit_the_p_value_is_drawn_from_a_seeded_generator_and_never_zero():
    differences = [1.0] * (significance.EXACT_UP_TO + 1)
    p, exact = sign_flip_p(differences, seed=4)
    assert not exact and p == 1 / (significance.RANDOM_FLIPS + 1)
    assert sign_flip_p(differences, seed=4) == (p, False)
    assert sign_flip_p([]) == (None, True)


def test_no_p_value_below_the_level_is_possible_under_six_seeds():
    assert TEST_MIN_SEEDS == 6
    assert sign_flip_p([1.0] * 5)[0] == 2 / 32 > significance.ALPHA
    assert sign_flip_p([1.0] * 6)[0] == 2 / 64 < significance.ALPHA


def _random_differences(rng, n):
    """Differences of n seeds: a random effect and spread, on a random scale; a third of them whole numbers (the
    metrics are mostly counts), so ties among the sign sums happen."""
    scale = 10.0 ** rng.uniform(-3, 3)
    effect = rng.choice([0.0, 0.2, 0.5, 1.0, 3.0, -1.0]) * scale
    values = rng.normal(effect, scale, size=n)
    return [float(v) for v in (np.round(values / scale * 3) if rng.random() < 1 / 3 else values)]


def test_the_sign_flip_p_equals_a_brute_force_enumeration_on_random_cases():
    rng = np.random.default_rng(26)
    for _ in range(150):
        n = int(rng.integers(1, 13))
        differences = _random_differences(rng, n)
        observed = abs(sum(differences))
        slack = 1e-9 * max(1.0, sum(abs(d) for d in differences))  # sums equal but for float rounding tie
        extreme = sum(1 for signs in itertools.product((1.0, -1.0), repeat=n)
                      if abs(sum(s * d for s, d in zip(signs, differences))) >= observed - slack)
        assert sign_flip_p(differences) == (extreme / 2 ** n, True), differences
        assert sign_flip_p(differences)[0] >= smallest_sign_flip_p(n)


def _ttest_cases():
    rng = np.random.default_rng(2026)
    for _ in range(200):
        n = int(rng.integers(2, 21))
        baseline = rng.normal(0.0, 10.0 ** rng.uniform(-2, 3), size=n)
        differences = _random_differences(rng, n)
        arm = baseline + np.asarray(differences)
        if np.std(arm - baseline) == 0:  # a case with no spread is tested on its own
            continue
        yield baseline, arm, float(rng.choice([0.9, 0.95, 0.99]))


def test_the_t_test_p_and_interval_equal_scipys_ttest_rel():
    from scipy import stats  # here: the one reference of two tests, a second of import for every worker otherwise

    checked = 0
    for baseline, arm, confidence in _ttest_cases():
        seeds = range(len(arm))
        figure = paired(dict(zip(seeds, baseline)), dict(zip(seeds, arm)), confidence=confidence, resamples=10)
        result = stats.ttest_rel(arm, baseline)
        interval = result.confidence_interval(confidence)
        assert figure["t_p_value"] == pytest.approx(result.pvalue, rel=RELATIVE)
        assert figure["t_statistic"] == pytest.approx(result.statistic, rel=RELATIVE)
        assert figure["t_df"] == result.df == len(arm) - 1
        # an end of the interval near 0 is a difference of two nearly equal numbers, so it is held to the rounding
        # of the numbers it came from
        rounding = 1e-12 * (abs(figure["mean_difference"]) + interval.high - interval.low)
        assert figure["t_ci_low"] == pytest.approx(interval.low, rel=RELATIVE, abs=rounding)
        assert figure["t_ci_high"] == pytest.approx(interval.high, rel=RELATIVE, abs=rounding)
        differences = arm - baseline
        assert figure["d_z"] == pytest.approx(differences.mean() / differences.std(ddof=1), rel=RELATIVE)
        checked += 1
    assert checked > 150


def _power(n, d_z):
    """The paired t-test's power at ALPHA by scipy's noncentral t; where scipy gives nan (deep in a tail), the
    same chance integrated over the chi-square of the spread: P(|Z + nc| > c * sqrt(V / df))."""
    from scipy import integrate, stats

    df, noncentrality = n - 1, abs(d_z) * math.sqrt(n)
    critical = stats.t.ppf(1 - ALPHA / 2, df)
    power = stats.nct.sf(critical, df, noncentrality) + stats.nct.cdf(-critical, df, noncentrality)
    if math.isfinite(power):
        return power
    def integrand(v):
        s = critical * math.sqrt(v / df)
        return (stats.norm.cdf(noncentrality - s) + stats.norm.cdf(-noncentrality - s)) * stats.chi2.pdf(v, df)
    return integrate.quad(integrand, 0, np.inf, epsabs=1e-13, limit=200)[0]


def test_the_seeds_the_t_test_needs_are_the_fewest_whose_noncentral_t_power_reaches_the_target():
    rng = np.random.default_rng(80)
    effects = [*(10.0 ** rng.uniform(-1.3, 1.3, size=40)), 8.714285714, 0.5, 1.0, 2.0, 25.0]
    for d_z in effects:
        for sign in (1.0, -1.0):
            n = t_seeds_needed(sign * d_z)
            assert n >= 2 and _power(n, d_z) >= POWER, (d_z, n)
            if n > 2:
                assert _power(n - 1, d_z) < POWER, (d_z, n)
    assert t_seeds_needed(0.5) == 34 and t_seeds_needed(1.0) == 10, "the textbook figures for d = 0.5 and 1"


def test_the_seeds_needed_are_undefined_only_without_an_effect():
    assert t_seeds_needed(None) is None and t_seeds_needed(0.0) is None
    assert t_seeds_needed(0.001) is None, "more than a million seeds"
    assert t_seeds_needed(1e9) == 2


def test_the_exact_test_needs_its_floor_and_at_least_the_t_tests_seeds():
    assert exact_seeds_needed(3) == TEST_MIN_SEEDS == 6
    assert exact_seeds_needed(34) == 34
    assert exact_seeds_needed(None) is None
    assert exact_seeds_needed(None, no_spread=True) == TEST_MIN_SEEDS


def test_the_detectable_effect_is_the_one_the_t_test_finds_with_the_target_power():
    for n in (2, 3, 6, 20):
        found = detectable_effect(n, 1.0)
        assert _power(n, found) == pytest.approx(POWER, abs=1e-9), n
        assert detectable_effect(n, 0.007) == pytest.approx(0.007 * found, rel=1e-9)
    assert detectable_effect(1, 1.0) is None and detectable_effect(3, 0.0) is None
    assert detectable_effect(3, None) is None


def test_paired_carries_both_tests_and_both_seeds_figures():
    few = paired({s: 0.0 for s in (1, 2, 3)}, {1: 1.0, 2: 8.0, 3: 15.0})
    assert (few["p_value"], few["p_exact"], few["interval_reliable"]) == (0.25, True, False)
    assert few["d_z"] == pytest.approx(8 / 7) and few["t_seeds_needed"] == t_seeds_needed(8 / 7) == 9
    assert few["seeds_needed"] == 9 and few["detectable_effect"] == pytest.approx(detectable_effect(3, 7.0))
    assert few["note"] == "n=3: below 6 seeds no exact p can reach 0.05 (and the bootstrap interval is too narrow)"
    enough = paired({s: 0.0 for s in range(6)}, {s: 1.0 + s for s in range(6)})
    assert enough["interval_reliable"] and enough["p_value"] == 2 / 64 and enough["note"] is None
    none = paired({1: 0.0}, {2: 1.0})
    assert none["p_value"] is None and not none["interval_reliable"] and none["note"].startswith("n=0")
    assert none["t_p_value"] is None and none["seeds_needed"] is None and none["t_seeds_needed"] is None
