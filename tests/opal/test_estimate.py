"""Waiting and cost forecasts, checked against figures computed by hand from the measured table.

Measured per decision (low / typical / high): first 100 / 250 / 430 s and $0.30 / $1.08 / $1.60; later
10 / 27 / 50 s and $0.05 / $0.23 / $0.38.
"""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opalctl.errors import EXIT_BAD_INPUT, BadInput
from opalctl.opal.estimate import (
    DEFAULT_DECISIONS,
    FIGURES,
    MAX_AUTO_DECISIONS,
    decision_usd,
    estimate,
    format_lines,
)

# Cost of 8 decisions whatever the blocking mode: first + 7 x later.
COST_8 = {"low": 0.30 + 7 * 0.05, "typical": 1.08 + 7 * 0.23, "high": 1.60 + 7 * 0.38}
# Waiting for 8 blocking decisions: first + 7 x later.
BLOCKING_8 = {"low": 100 + 7 * 10, "typical": 250 + 7 * 27, "high": 430 + 7 * 50}


def approx(figures):
    return {name: pytest.approx(value, abs=1e-9) for name, value in figures.items()}


def joined(result):
    return "\n".join(result["lines"])


def test_the_table_holds_the_measured_figures():
    table = FIGURES[("claude-opus-5-5", "high")]
    assert table["sample_decisions"] == 567
    assert table["first"]["seconds"] == {"low": 100, "typical": 250, "high": 430}
    assert table["first"]["usd"] == {"low": 0.30, "typical": 1.08, "high": 1.60}
    assert table["later"]["seconds"] == {"low": 10, "typical": 27, "high": 50}
    assert table["later"]["usd"] == {"low": 0.05, "typical": 0.23, "high": 0.38}


def test_blocking_with_decisions_set():
    result = estimate(1000, 0.5, decisions=8)
    assert result["training_seconds"] == 500
    assert result["decisions"] == 8
    assert result["decisions_source"] == "user"
    assert result["waiting_seconds"] == approx({"low": 170, "typical": 439, "high": 780})
    assert result["cost_usd"] == approx({"low": 0.65, "typical": 2.69, "high": 4.26})
    assert result["waiting_ratio"] == pytest.approx(439 / 500)
    assert result["measured"] == {"model": "claude-opus-5-5", "effort": "high", "decisions": 567}
    assert "4x" not in joined(result)  # 439 s is within 4 x 500 s
    assert "measured for" not in joined(result)


def test_cost_is_rounded_to_clean_figures():
    result = estimate(1000, 0.5, decisions=8)
    assert result["cost_usd"] == {"low": 0.65, "typical": 2.69, "high": 4.26}
    assert result["waiting_seconds"] == {"low": 170, "typical": 439, "high": 780}


def test_one_decision_is_the_first_alone():
    result = estimate(1000, 0.5, decisions=1)
    assert result["waiting_seconds"] == approx({"low": 100, "typical": 250, "high": 430})
    assert result["cost_usd"] == approx({"low": 0.30, "typical": 1.08, "high": 1.60})


def test_non_blocking_waits_nothing_but_costs_the_same():
    result = estimate(1000, 0.5, decisions=8, blocking=False)
    assert result["waiting_seconds"] == {"low": 0, "typical": 0, "high": 0}
    assert result["cost_usd"] == approx(COST_8)
    assert result["waiting_ratio"] == 0
    assert "non-finite loss still makes training wait" in joined(result)


def test_auto_with_slow_updates_waits_for_the_first_decision_only():
    # 10 / 27 / 50 s at 2 s per update land 5 / 13.5 / 25 updates late: all within max_lag 50.
    result = estimate(1000, 2.0, decisions=8, blocking="auto")
    assert result["waiting_seconds"] == approx({"low": 100, "typical": 250, "high": 430})
    assert result["cost_usd"] == approx(COST_8)
    assert "within max_lag=50" in joined(result)


def test_auto_counts_an_answer_exactly_max_lag_late_as_within():
    # At 1 s per update the high figure lands 50 / 1 = 50 updates late: later / sec_per_step <= max_lag holds.
    result = estimate(1000, 1.0, decisions=8, blocking="auto")
    assert result["waiting_seconds"] == approx({"low": 100, "typical": 250, "high": 430})


def test_auto_with_fast_updates_waits_like_blocking():
    # At 0.1 s per update the answers land 100 / 270 / 500 updates late: all beyond max_lag 50.
    result = estimate(1000, 0.1, decisions=8, blocking="auto")
    assert result["waiting_seconds"] == approx(BLOCKING_8)
    assert result["cost_usd"] == approx(COST_8)
    assert "beyond max_lag=50, so training waits for every later decision" in joined(result)


def test_auto_decides_per_figure_low_within_high_beyond():
    # At 0.5 s per update: low 10 / 0.5 = 20 <= 50, typical 54 > 50, high 100 > 50.
    result = estimate(1000, 0.5, decisions=8, blocking="auto")
    assert result["waiting_seconds"] == approx({"low": 100, "typical": 250 + 7 * 27, "high": 430 + 7 * 50})
    assert "typical and high figures" in joined(result)
    # At 0.8 s per update: low 12.5 and typical 33.75 within, high 62.5 beyond.
    result = estimate(1000, 0.8, decisions=8, blocking="auto")
    assert result["waiting_seconds"] == approx({"low": 100, "typical": 250, "high": 430 + 7 * 50})
    assert "for the high figure, which waits" in joined(result)
    assert "low and typical figures, which do not" in joined(result)


def test_auto_honours_max_lag():
    # At 0.5 s per update the high figure lands 100 updates late: within max_lag=100, beyond max_lag=99.
    assert estimate(1000, 0.5, decisions=8, blocking="auto", max_lag=100)["waiting_seconds"] == approx(
        {"low": 100, "typical": 250, "high": 430})
    assert estimate(1000, 0.5, decisions=8, blocking="auto", max_lag=99)["waiting_seconds"]["high"] == (
        pytest.approx(780))
    # max_lag=0: every later answer is late.
    assert estimate(1000, 5.0, decisions=8, blocking="auto", max_lag=0)["waiting_seconds"] == approx(BLOCKING_8)


@pytest.mark.parametrize(("total_steps", "sec_per_step", "expected"), [
    (1000, 0.5, 65),   # 500 s -> 4x = 2000 s -> 1 + floor((2000 - 250) / 27) = 1 + 64 = 65 (1978 s)
    (200, 0.5, 6),     # 100 s -> 400 s -> 1 + floor(150 / 27) = 6 (385 s)
    (130, 1.0, 11),    # 130 s -> 520 s = 250 + 10 x 27 exactly: "within" includes the cap
    (100, 0.625, 1),   # 62.5 s -> 250 s: the first decision exactly fills the cap
    (100, 0.5, 1),     # 50 s -> 200 s: even the first decision (250 s) exceeds it
    (1, 0.001, 1),
])
def test_blocking_chooses_the_most_decisions_within_4x(total_steps, sec_per_step, expected):
    result = estimate(total_steps, sec_per_step)
    assert result["decisions"] == expected
    assert result["decisions_source"] == "auto"
    assert result["waiting_seconds"]["typical"] == pytest.approx(250 + (expected - 1) * 27)
    assert result["cost_usd"]["typical"] == pytest.approx(1.08 + (expected - 1) * 0.23)
    assert joined(result).startswith(f"Chose {expected} decision")


def test_blocking_choice_65_in_full():
    result = estimate(1000, 0.5)
    assert result["waiting_seconds"] == approx({"low": 100 + 64 * 10, "typical": 1978, "high": 430 + 64 * 50})
    assert result["cost_usd"] == approx({"low": 0.30 + 64 * 0.05, "typical": 1.08 + 64 * 0.23,
                                         "high": 1.60 + 64 * 0.38})
    assert "the most whose typical waiting" in joined(result)


def test_a_run_too_short_for_one_decision_gets_one_and_says_so():
    result = estimate(100, 0.5)  # 50 s of training, 4x = 200 s < 250 s
    assert result["decisions"] == 1
    assert result["waiting_seconds"]["typical"] == 250
    assert "the fewest there can be" in joined(result)
    assert "more than 4x the training time of 50 s, that is 200 s" in joined(result)


def test_the_automatic_count_is_held_to_what_a_protocol_accepts():
    result = estimate(10**7, 1.0)  # 4 x 10^7 s would allow 1 + floor((4e7 - 250) / 27) = 1,481,473 decisions
    assert result["decisions"] == MAX_AUTO_DECISIONS == 1000
    assert result["waiting_seconds"]["typical"] == pytest.approx(250 + 999 * 27)
    assert "1,481,473" in joined(result)


def test_auto_with_fast_updates_chooses_like_blocking():
    # 0.1 s per update: the typical later answer lands 270 updates late, so later decisions make training wait.
    result = estimate(5000, 0.1, blocking="auto")
    assert result["decisions"] == 65
    assert result["waiting_seconds"]["typical"] == pytest.approx(1978)


@pytest.mark.parametrize("blocking", [False, "auto"])
def test_runs_whose_later_decisions_do_not_wait_get_the_default(blocking):
    result = estimate(1000, 2.0, blocking=blocking)
    assert result["decisions"] == DEFAULT_DECISIONS == 8
    assert result["decisions_source"] == "auto"
    assert result["cost_usd"] == approx(COST_8)
    assert "default of 8 decisions" in joined(result)


def test_auto_default_notes_when_the_first_decision_alone_exceeds_4x():
    result = estimate(20, 1.0, blocking="auto")  # 20 s of training; the first decision waits 250 s > 80 s
    assert result["decisions"] == 8
    assert result["waiting_seconds"]["typical"] == 250
    assert "Even the first decision typically waits 250 s (4.2 min)" in joined(result)
    assert "4x the training time of 20 s, that is 80 s" in joined(result)


def test_a_user_count_is_kept_with_a_line_when_it_exceeds_4x():
    result = estimate(100, 0.5, decisions=8)  # 50 s of training; 439 s of waiting > 200 s
    assert result["decisions"] == 8
    assert result["decisions_source"] == "user"
    assert result["waiting_seconds"]["typical"] == pytest.approx(439)
    assert result["waiting_ratio"] == pytest.approx(439 / 50)
    line = next(line for line in result["lines"] if "more than 4x" in line)
    assert "wait 439 s (7.3 min)" in line
    assert "4x the training time of 50 s, that is 200 s" in line


def test_a_user_count_at_exactly_4x_gets_no_line():
    assert "more than 4x" not in joined(estimate(130, 1.0, decisions=11))  # 520 s = 4 x 130 s
    assert "more than 4x" in joined(estimate(130, 1.0, decisions=12))  # 547 s
    assert "waits" in next(line for line in estimate(10, 1.0, decisions=1)["lines"] if "more than 4x" in line)


def test_a_non_blocking_user_count_never_exceeds():
    assert "more than 4x" not in joined(estimate(10, 0.1, decisions=500, blocking=False))


@pytest.mark.parametrize(("model", "effort"), [("claude-sonnet-5", "high"), ("claude-opus-5-5", "low"),
                                               ("other", "medium")])
def test_another_model_or_effort_uses_the_measured_figures_and_says_so(model, effort):
    result = estimate(1000, 0.5, decisions=8, model=model, effort=effort)
    assert result["waiting_seconds"] == approx(BLOCKING_8)
    assert result["cost_usd"] == approx(COST_8)
    assert result["measured"]["model"] == "claude-opus-5-5"
    assert result["measured"]["effort"] == "high"
    line = next(line for line in result["lines"] if "measured for" in line)
    assert "claude-opus-5-5 at effort high" in line
    assert "may not hold" in line
    assert model in line and effort in line


def test_the_result_is_plain_json():
    result = estimate(np.int64(1000), np.float64(0.5), decisions=np.int32(8), blocking="auto")
    assert json.loads(json.dumps(result)) == result
    assert type(result["total_steps"]) is int and type(result["sec_per_step"]) is float
    assert type(result["decisions"]) is int


def test_format_lines_summarises_then_adds_the_lines():
    result = estimate(1000, 0.5, decisions=8)
    text = format_lines(result)
    assert text[0] == "training: 500 s (8.3 min), 1,000 updates x 0.5 s"
    assert text[1] == "decisions: 8, set by the user, blocking"
    assert text[2] == ("waiting: 439 s (7.3 min) typical, low 170 s (2.8 min), high 780 s (13.0 min); 0.878x the "
                       "training time")
    assert text[3] == "cost: $2.69 typical, low $0.65, high $4.26"
    assert text[4:] == result["lines"]
    assert "non-blocking" in format_lines(estimate(1000, 0.5, blocking=False))[1]
    assert "chosen automatically" in format_lines(estimate(1000, 0.5))[1]
    assert "blocking='auto'" in format_lines(estimate(1000, 0.5, blocking="auto"))[1]


BAD = [
    ("total_steps", 0), ("total_steps", -5), ("total_steps", 10.5), ("total_steps", 1000.0), ("total_steps", True),
    ("total_steps", "1000"), ("total_steps", None), ("total_steps", 10**400),
    ("sec_per_step", 0), ("sec_per_step", -0.5), ("sec_per_step", math.nan), ("sec_per_step", math.inf),
    ("sec_per_step", "0.5"), ("sec_per_step", True), ("sec_per_step", None), ("sec_per_step", 1e306),
    ("decisions", 0), ("decisions", -1), ("decisions", 2.5), ("decisions", True), ("decisions", "8"),
    ("blocking", "yes"), ("blocking", "AUTO"), ("blocking", 1), ("blocking", 0), ("blocking", None),
    ("max_lag", -1), ("max_lag", 2.5), ("max_lag", None),
    ("model", None), ("effort", 3),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_inputs_are_refused_in_one_sentence(name, value):
    kwargs = {"total_steps": 1000, "sec_per_step": 0.5, name: value}
    with pytest.raises(BadInput) as caught:
        estimate(**kwargs)
    message = caught.value.message
    assert caught.value.exit_code == EXIT_BAD_INPUT
    assert "\n" not in message and message.count(";") == 1 and not message.endswith(".")
    assert name in message


@settings(max_examples=300, deadline=None)
@given(total_steps=st.integers(1, 10**6), sec_per_step=st.floats(1e-4, 100.0))
def test_the_automatic_blocking_count_is_the_most_within_4x(total_steps, sec_per_step):
    result = estimate(total_steps, sec_per_step)
    n, cap = result["decisions"], 4 * result["training_seconds"]
    assert 1 <= n <= MAX_AUTO_DECISIONS
    assert n == 1 or 250 + (n - 1) * 27 <= cap
    assert n == MAX_AUTO_DECISIONS or 250 + n * 27 > cap
    assert result["waiting_ratio"] == pytest.approx((250 + (n - 1) * 27) / result["training_seconds"])


def test_a_model_of_the_price_table_is_priced_at_its_prices_and_says_so():
    # claude-sonnet-4-5 lists at 3/5 of the measured model's prices: the same decisions cost 3/5 as much
    result = estimate(1000, 0.5, decisions=8, model="claude-sonnet-4-5", effort="high")
    assert result["waiting_seconds"] == approx(BLOCKING_8)
    assert result["cost_usd"] == approx({name: value * 0.6 for name, value in COST_8.items()})
    assert "priced at claude-sonnet-4-5's prices" in next(line for line in result["lines"] if "measured for" in line)
    assert decision_usd("claude-sonnet-4-5")["first"]["typical"] == pytest.approx(1.08 * 0.6)
    assert decision_usd("claude-unknown-9") is None
    assert decision_usd("claude-unknown-9", {"input": 10.0, "output": 50.0, "cache_read": 0.0,
                                             "cache_write": 0.0})["later"]["typical"] == pytest.approx(0.23 * 2)
