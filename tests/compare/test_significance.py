"""The exact sign-flip test against hand-enumerated cases, and the planning figures against their formula."""

from __future__ import annotations

import itertools
import math

import pytest

from opalctl.compare import significance
from opalctl.compare.significance import TEST_MIN_SEEDS, detectable_effect, seeds_needed, sign_flip_p
from opalctl.compare.statistics import paired

Z_TOTAL = 1.959963984540054 + 0.8416212335729143  # z of 0.975 plus z of 0.8


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


def test_the_detectable_effect_needs_enough_seeds_and_follows_the_spread():
    assert detectable_effect([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    six = [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]  # sd sqrt(14)
    assert detectable_effect(six) == pytest.approx(Z_TOTAL * math.sqrt(14) / math.sqrt(6))


def test_the_seeds_needed_for_the_observed_difference():
    # the example: +8 with a spread of 7 needs about (2.80 * 7 / 8)^2 = 6.01, so 7 seeds
    assert seeds_needed([1.0, 8.0, 15.0]) == 7
    assert seeds_needed([0.0, 8.0, 16.0]) == math.ceil((Z_TOTAL * 8 / 8) ** 2) == 8
    assert seeds_needed([8.0, 8.0, 8.0]) == TEST_MIN_SEEDS, "no spread: the test's own floor"
    assert seeds_needed([2.0, -2.0]) is None, "a mean of 0 is nothing to detect"
    assert seeds_needed([3.0]) is None, "one seed has no spread to plan with"


def test_paired_carries_the_test_and_marks_intervals_unreliable_below_six_seeds():
    few = paired({s: 0.0 for s in (1, 2, 3)}, {1: 1.0, 2: 8.0, 3: 15.0})
    assert (few["p_value"], few["p_exact"], few["interval_reliable"]) == (0.25, True, False)
    assert few["seeds_needed"] == 7 and few["detectable_effect"] is None
    assert few["note"] == "n=3: below 6 seeds the interval is unreliable and no exact p can reach 0.05"
    enough = paired({s: 0.0 for s in range(6)}, {s: 1.0 + s for s in range(6)})
    assert enough["interval_reliable"] and enough["p_value"] == 2 / 64 and enough["note"] is None
    none = paired({1: 0.0}, {2: 1.0})
    assert none["p_value"] is None and not none["interval_reliable"] and none["note"].startswith("n=0")
