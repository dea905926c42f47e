import json
import math

import pytest

from opalctl.compare.statistics import NotComparable, paired, summary, time_to_reach


def test_summary_by_hand():
    assert summary([1, 2, 3, 4]) == {"mean": 2.5, "std": pytest.approx(math.sqrt(5 / 3)), "min": 1.0, "max": 4.0,
                                     "n": 4}
    assert summary([7]) == {"mean": 7.0, "std": 0.0, "min": 7.0, "max": 7.0, "n": 1}
    assert summary([]) == {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    with pytest.raises(NotComparable, match="not a finite number"):
        summary([1.0, float("nan")])


def test_paired_on_common_seeds():
    baseline = {1: 200, 2: 210, 3: 190, 5: 100}
    arm = {3: 187, 1: 205, 2: 210, 4: 300}
    result = paired(baseline, arm, resamples=2000)
    assert result["seeds"] == [1, 2, 3] and result["n"] == 3
    assert result["unpaired"] == {"baseline": [5], "arm": [4]}
    assert result["differences"] == [5.0, 0.0, -3.0]
    assert result["mean_difference"] == pytest.approx(2 / 3)
    assert (result["wins"], result["ties"], result["losses"]) == (1, 1, 1)
    assert result["ci_low"] <= result["mean_difference"] <= result["ci_high"]
    assert -3.0 <= result["ci_low"] and result["ci_high"] <= 5.0
    assert result["note"].startswith("n=3: below 6 seeds no exact p can reach 0.05")
    assert json.loads(json.dumps(result)) == {**result, "seeds": [1, 2, 3]}


def test_direction_decides_wins_and_losses():
    result = paired({1: 2.0, 2: 2.0, 3: 2.0}, {1: 1.5, 2: 2.5, 3: 1.0}, higher_is_better=False, resamples=100)
    assert (result["wins"], result["ties"], result["losses"]) == (2, 0, 1)
    assert result["differences"] == [-0.5, 0.5, -1.0]  # always arm - baseline, whatever the direction


def test_bootstrap_interval_of_two_seeds():
    # resampled means of [2, 6] are 2 (p 1/4), 4 (p 1/2) or 6 (p 1/4): the 95 % interval is [2, 6], the 40 % one [4, 4]
    result = paired({1: 0.0, 2: 0.0}, {1: 2.0, 2: 6.0})
    assert (result["ci_low"], result["ci_high"]) == (2.0, 6.0)
    result = paired({1: 0.0, 2: 0.0}, {1: 2.0, 2: 6.0}, confidence=0.4)
    assert (result["ci_low"], result["ci_high"]) == (4.0, 4.0)


def test_bootstrap_interval_of_three_seeds():
    # means of [0, 0, 3]: 0 (p 8/27), 1 (12/27), 2 (6/27), 3 (1/27); 2.5 % lies in the first, 97.5 % in the last
    result = paired({1: 10, 2: 10, 3: 10}, {1: 10, 2: 10, 3: 13})
    assert (result["ci_low"], result["ci_high"]) == (0.0, 3.0)
    assert result["mean_difference"] == 1.0


def test_bootstrap_is_deterministic_for_a_seed():
    baseline = {s: float(s) for s in range(8)}
    arm = {s: float(s) + (s % 3) - 0.7 for s in range(8)}
    first = paired(baseline, arm, seed=3)
    assert paired(baseline, arm, seed=3) == first
    assert paired(baseline, arm, seed=4)["ci_low"] != first["ci_low"]


def test_equal_differences_give_a_point_interval():
    result = paired({1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.5, 2: 2.5, 3: 3.5}, resamples=500)
    assert result["ci_low"] == result["ci_high"] == result["mean_difference"] == 0.5
    assert result["wins"] == 3


def test_one_seed_interval_is_the_single_difference():
    result = paired({7: 0.5}, {7: 0.75})
    assert (result["mean_difference"], result["ci_low"], result["ci_high"]) == (0.25, 0.25, 0.25)
    assert "n=1" in result["note"]


def test_one_seed_leaves_every_t_figure_undefined_and_says_why():
    result = paired({7: 0.5}, {7: 0.75})
    assert [result[k] for k in ("sd_difference", "d_z", "t_statistic", "t_df", "t_p_value", "t_ci_low",
                                "t_ci_high", "t_seeds_needed", "seeds_needed", "detectable_effect")] == [None] * 10
    assert result["t_note"] == "one seed has no spread, so the t-test is undefined"


def test_equal_non_zero_differences_have_no_spread_an_infinite_d_z_and_no_t_test():
    # 1.3 - 1.2 and 2.3 - 2.2 differ in their last bits: float rounding of the subtraction is not a spread
    result = paired({1: 1.3, 2: 2.3, 3: 5.3}, {1: 1.2, 2: 2.2, 3: 5.2}, higher_is_better=False)
    assert len(set(result["differences"])) == 2 and result["sd_difference"] == 0.0
    assert result["d_z"] is None and result["t_p_value"] is None and result["t_statistic"] is None
    assert result["t_note"] == ("every seed's difference is the same, so there is no spread: d_z is infinite and "
                                "the t-test undefined")
    assert result["t_ci_low"] == result["t_ci_high"] == result["mean_difference"]
    assert result["t_seeds_needed"] is None and result["seeds_needed"] == 6, "6 agreeing seeds reach p = 0.031"
    assert result["detectable_effect"] is None and result["wins"] == 3
    assert json.dumps(result, allow_nan=False), "no infinity in the JSON"


def test_all_zero_differences_have_nothing_to_test():
    result = paired({1: 3.0, 2: 4.0}, {1: 3.0, 2: 4.0})
    assert result["sd_difference"] == 0.0 and result["d_z"] is None and result["t_p_value"] is None
    assert result["t_note"] == "every difference is zero: nothing to test"
    assert result["seeds_needed"] is None and result["t_seeds_needed"] is None and result["p_value"] == 1.0


def test_a_mean_of_zero_with_a_spread_has_a_t_test_but_no_seeds_figure():
    result = paired({1: 0.0, 2: 0.0}, {1: 2.0, 2: -2.0})
    assert result["d_z"] == 0.0 and result["t_p_value"] == pytest.approx(1.0)
    assert result["t_seeds_needed"] is None and result["seeds_needed"] is None
    assert result["detectable_effect"] is not None


def test_every_paired_figure_and_csv_column_is_defined_once_in_the_legend():
    from opalctl.compare.columns import FIELDS, REPORT, TABLE
    from opalctl.compare.csv_table import PAIRED_COLUMNS

    figure = paired({1: 1.0, 2: 2.0, 3: 4.0}, {1: 1.5, 2: 2.0, 3: 5.0})
    assert set(FIELDS) == set(figure) | {"verdict"}
    assert set(PAIRED_COLUMNS) <= set(FIELDS) and {k for c in TABLE for k in c.keys} <= set(FIELDS)
    assert {key for _, key in REPORT} <= set(FIELDS)
    numbers = {k for k, v in figure.items() if isinstance(v, float | int) and not isinstance(v, bool)}
    assert numbers - {"confidence", "resamples", "bootstrap_seed", "n"} <= set(PAIRED_COLUMNS), "--csv has them"


def test_no_common_seed():
    result = paired({1: 1.0}, {2: 1.0})
    assert result["n"] == 0 and result["mean_difference"] is None and result["ci_low"] is None
    assert "n=0" in result["note"]


def test_paired_refuses_bad_arguments():
    with pytest.raises(NotComparable, match="not a finite number"):
        paired({1: 1.0}, {1: float("inf")})
    with pytest.raises(ValueError, match="confidence"):
        paired({1: 1.0}, {1: 1.0}, confidence=1.0)


def test_time_to_reach():
    curve = [(0, 0.1), (10, 0.5), (20.5, 0.7), (30, 0.6)]
    assert time_to_reach(curve, 0.6) == 20.5
    assert time_to_reach(curve, 0.5) == 10.0  # reaching includes equality
    assert time_to_reach(curve, 0.8) is None
    assert time_to_reach([], 0.1) is None
    losses = [(0, 3.0), (5, float("nan")), (6, 2.5), (9, 2.0)]
    assert time_to_reach(losses, 2.5, higher_is_better=False) == 6.0
    assert time_to_reach(losses, 1.0, higher_is_better=False) is None
    with pytest.raises(ValueError, match="goes back"):
        time_to_reach([(2, 0.0), (1, 1.0)], 0.5)


def test_mean_counts_of_agent_decisions_keep_their_fraction():
    from opalctl.compare.render import _count

    # 2, 1 and 1 decisions applied over three seeds: 1.3, not the 1 that rounding to a whole number printed
    assert [_count(x) for x in (8.0, 4 / 3, 0.0, 10 / 3)] == ["8", "1.3", "0", "3.3"]


def test_a_value_that_is_not_a_number_is_refused_naming_it():
    # a report holds null for a metric that was not finite: it is refused in a sentence, not a TypeError
    with pytest.raises(NotComparable, match="^the selected x holds None, which is not a finite number"):
        summary([1.0, None], what="the selected x")
    with pytest.raises(NotComparable, match="the arm's loss holds 'x'"):
        paired({1: 1.0}, {1: "x"}, what="loss")
