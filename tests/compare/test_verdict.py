"""The verdict's wording, from the paired figures alone: a clear win, a tie, too few seeds; never more than the
exact test supports."""

from __future__ import annotations

from opalctl.compare.statistics import paired
from opalctl.compare.verdict import verdict


def _verdict(baseline, arm, higher=True, metric="selection.correct"):
    return verdict("agent", "adamw", metric, paired(baseline, arm, higher_is_better=higher))


def test_a_clear_win_on_six_seeds_says_better():
    baseline = {s: 250.0 for s in range(1, 7)}
    arm = {s: 250.0 + 5 + s for s in range(1, 7)}
    assert _verdict(baseline, arm) == ("agent vs adamw on selection.correct: +8.5 (6 of 6 seeds better), exact "
                                       "p = 0.031: agent is better than adamw across 6 seeds.")


def test_a_lower_loss_is_a_win_and_a_higher_one_a_loss():
    baseline = {s: 1.0 for s in range(1, 7)}
    lower = {s: 0.5 for s in range(1, 7)}
    assert _verdict(baseline, lower, higher=False, metric="train.loss").endswith(
        "-0.5 (6 of 6 seeds better), exact p = 0.031: agent is better than adamw across 6 seeds.")
    assert _verdict(lower, baseline, higher=False, metric="train.loss").endswith(
        "+0.5 (0 of 6 seeds better, 6 worse), exact p = 0.031: agent is worse than adamw across 6 seeds.")


def test_a_tie_says_identical():
    assert _verdict({1: 3.0, 2: 4.0, 3: 5.0}, {1: 3.0, 2: 4.0, 3: 5.0}) == \
        "agent vs adamw on selection.correct: identical on all 3 seeds: no difference at all."


def test_too_few_seeds_never_claims_a_difference_and_says_how_many_would():
    # the example: +8 on 3 of 3 seeds is the best 3 seeds can show, and still p = 0.25
    assert _verdict({1: 0.0, 2: 0.0, 3: 0.0}, {1: 1.0, 2: 8.0, 3: 15.0}) == (
        "agent vs adamw on selection.correct: +8 (3 of 3 seeds better), exact p = 0.25: not distinguishable "
        "with 3 seeds (no result of 3 seeds can reach p < 0.05); about 7 seeds would tell a difference this size.")
    assert _verdict({1: 0.0}, {1: 8.0}) == (
        "agent vs adamw on selection.correct: +8 on the one common seed; one seed cannot tell a difference from "
        "noise (the exact test needs at least 6 seeds to reach p < 0.05).")
    assert _verdict({1: 0.0}, {2: 8.0}) == \
        "agent vs adamw on selection.correct: no seed was finished by both arms, so there is nothing to compare."


def test_enough_seeds_with_a_wide_spread_is_not_distinguishable():
    baseline = {s: 0.0 for s in range(1, 9)}
    arm = dict(zip(range(1, 9), [5.0, -4.0, 6.0, -5.0, 3.0, -2.0, 4.0, -1.0]))
    text = _verdict(baseline, arm)
    assert "(4 of 8 seeds better, 4 worse)" in text and "not distinguishable with 8 seeds" in text
    assert "is better" not in text and "about" in text and "seeds would tell a difference this size" in text
