"""Performance profiles (compare/profiles.py) on a hand-made case checked against a hand computation."""

from __future__ import annotations

import math

import pytest

from opalctl.compare.profiles import TAU_MAX, profiles, ratios, rho, score

INF = math.inf

# Four tasks, three arms; times-to-target by hand:
#   t1: A=10  B=20  C=inf  -> best 10:  rA=1, rB=2, rC=inf (C never reached)
#   t2: A=30  B=15  C=15   -> best 15:  rA=2, rB=1, rC=1   (B and C tie: both 1)
#   t3: A=inf B=inf C=inf  -> nobody reached: every r is inf
#   t4: A=100 B=50  C=250  -> best 50:  rA=2, rB=1, rC=5   (5 > 4: counts as not reached)
# Each task adds (4 - r) / 3 when r <= 4, else 0; the score is the mean over the 4 tasks:
#   A: 1 + 2/3 + 0 + 2/3 = 7/3  -> 7/12
#   B: 2/3 + 1 + 0 + 1   = 8/3  -> 8/12 = 2/3
#   C: 0 + 1 + 0 + 0     = 1    -> 3/12 = 1/4
# Profiles: rho_A(1) = 1/4 (t1), rho_A(2) = rho_A(4) = 3/4 (t1, t2, t4); rho_B(1) = 2/4 (t2, t4), rho_B(2) = 3/4;
#   rho_C(tau) = 1/4 for every tau in [1, 4] (t2 only).
TIMES = {
    "t1": {"A": 10.0, "B": 20.0, "C": INF},
    "t2": {"A": 30.0, "B": 15.0, "C": 15.0},
    "t3": {"A": INF, "B": INF, "C": INF},
    "t4": {"A": 100.0, "B": 50.0, "C": 250.0},
}


def test_ratios_by_hand():
    table = ratios(TIMES)
    assert table["t1"] == {"A": 1.0, "B": 2.0, "C": INF}
    assert table["t2"] == {"A": 2.0, "B": 1.0, "C": 1.0}
    assert all(math.isinf(r) for r in table["t3"].values())
    assert table["t4"] == {"A": 2.0, "B": 1.0, "C": 5.0}


def test_profiles_and_scores_by_hand():
    result = profiles(TIMES)
    arms = result["arms"]
    assert result["tau_max"] == TAU_MAX == 4.0
    assert arms["A"]["score"] == pytest.approx(7 / 12)
    assert arms["B"]["score"] == pytest.approx(2 / 3)
    assert arms["C"]["score"] == pytest.approx(1 / 4)
    assert arms["A"]["steps"] == [[1.0, 0.25], [2.0, 0.75], [4.0, 0.75]]
    assert arms["B"]["steps"] == [[1.0, 0.5], [2.0, 0.75], [4.0, 0.75]]
    assert arms["C"]["steps"] == [[1.0, 0.25], [4.0, 0.25]]
    assert arms["C"]["ratios"] == {"t1": None, "t2": 1.0, "t3": None, "t4": 5.0}  # JSON holds no infinity


def test_score_is_the_area_under_the_profile():
    """The exact score equals a fine Riemann sum of rho over [1, 4], divided by 3."""
    table = ratios(TIMES)
    for arm in ("A", "B", "C"):
        mine = [table[task][arm] for task in table]
        points = 30_000
        area = sum(rho(mine, 1 + 3 * (i + 0.5) / points) for i in range(points)) * 3 / points
        assert score(mine) == pytest.approx(area / 3, abs=1e-4)


def test_every_task_needs_every_arm_and_a_positive_time():
    with pytest.raises(ValueError, match="every task needs every arm"):
        ratios({"t1": {"A": 1.0, "B": 2.0}, "t2": {"A": 1.0}})
    with pytest.raises(ValueError, match="not positive"):
        ratios({"t1": {"A": 0.0, "B": 2.0}})
