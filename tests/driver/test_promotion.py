import json

import numpy as np
import pytest

from opalctl.driver.promotion import DenominatorMismatch, MissingMetric, decide, select
from opalctl.errors import OpalctlError
from opalctl.protocol.schema import Selection

POLICY = {
    "denominators": ["selection.total", "retention.total"],
    "floors": {"retention.correct": 2},
    "nondecreasing": [],
    "nonincreasing": [],
    "improve_any": ["selection.correct"],
}


def metrics(selection_correct, retention_correct, **extra):
    return {"selection.correct": selection_correct, "selection.total": 250, "retention.correct": retention_correct,
            "retention.total": 128, **extra}


ANCHOR = metrics(0, 128)


def failing(decision, rule):
    return [c["metric"] for c in decision.checks if c["rule"] == rule and not c["passed"]]


def test_promoted_when_every_rule_passes():
    decision = decide(metrics(200, 127), ANCHOR, ANCHOR, POLICY)
    assert decision.promoted and decision.reasons == []
    rules = [(c["rule"], c["metric"]) for c in decision.checks]
    assert rules == [("denominators", "selection.total"), ("denominators", "retention.total"),
                     ("floors", "retention.correct"), ("improve_any", "selection.correct")]
    assert all(c["passed"] for c in decision.checks)
    assert json.loads(json.dumps(decision.to_json())) == decision.to_json()


def test_selection_model_and_dict_decide_alike():
    model = Selection(**POLICY)
    for candidate in (metrics(200, 127), metrics(200, 125), metrics(0, 128)):
        assert decide(candidate, ANCHOR, ANCHOR, model) == decide(candidate, ANCHOR, ANCHOR, POLICY)


def test_floor_fails_below_anchor_minus_tolerance():
    decision = decide(metrics(200, 125), ANCHOR, ANCHOR, POLICY)
    assert not decision.promoted
    assert failing(decision, "floors") == ["retention.correct"]
    assert decision.reasons == ["retention.correct 125 is below its floor 126 (anchor 128 minus tolerance 2)"]
    assert decide(metrics(200, 126), ANCHOR, ANCHOR, POLICY).promoted  # exactly on the floor passes


def test_floor_is_measured_against_the_anchor_not_the_incumbent():
    # the incumbent is worse than the anchor: the floor does not sink with it
    weak_incumbent = metrics(100, 120)
    decision = decide(metrics(150, 121), weak_incumbent, ANCHOR, POLICY)
    assert not decision.promoted and failing(decision, "floors") == ["retention.correct"]
    assert decision.checks[2]["reference"] == 128
    # the incumbent is better than the anchor: the floor does not rise with it either
    anchor = metrics(0, 120)
    strong_incumbent = metrics(100, 128)
    decision = decide(metrics(150, 118), strong_incumbent, anchor, POLICY)
    assert decision.promoted and decision.checks[2]["reference"] == 120


def test_nondecreasing_and_nonincreasing():
    policy = {"nondecreasing": ["selection.correct"], "nonincreasing": ["selection.bits"],
              "improve_any": ["selection.correct", "selection.bits"]}
    incumbent = {"selection.correct": 100, "selection.bits": 2.0}
    assert decide({"selection.correct": 100, "selection.bits": 1.5}, incumbent, incumbent, policy).promoted
    decision = decide({"selection.correct": 99, "selection.bits": 2.5}, incumbent, incumbent, policy)
    assert not decision.promoted
    assert failing(decision, "nondecreasing") == ["selection.correct"]
    assert failing(decision, "nonincreasing") == ["selection.bits"]
    assert decision.reasons[:2] == ["selection.correct 99 fell below the incumbent's 100 (nondecreasing)",
                                    "selection.bits 2.5 rose above the incumbent's 2 (nonincreasing)"]


def test_improve_any_respects_direction():
    policy = {"nonincreasing": ["selection.bits"], "improve_any": ["selection.bits", "selection.correct"]}
    incumbent = {"selection.correct": 100, "selection.bits": 2.0}
    decision = decide({"selection.correct": 100, "selection.bits": 1.9}, incumbent, incumbent, policy)
    assert decision.promoted
    assert [c["better"] for c in decision.checks if c["rule"] == "improve_any"] == ["lower", "higher"]
    # higher bits is worse, and correct is tied: not promoted (and the nonincreasing rule fails too)
    decision = decide({"selection.correct": 100, "selection.bits": 2.1}, incumbent, incumbent, policy)
    assert not decision.promoted
    assert decision.reasons[-1].startswith("no improvement over the incumbent")


def test_improvement_set_defaults_to_the_monotone_rules():
    policy = {"nondecreasing": ["selection.correct"], "nonincreasing": ["selection.bits"]}
    incumbent = {"selection.correct": 100, "selection.bits": 2.0}
    assert decide({"selection.correct": 100, "selection.bits": 1.9}, incumbent, incumbent, policy).promoted
    assert decide({"selection.correct": 101, "selection.bits": 2.0}, incumbent, incumbent, policy).promoted
    decision = decide({"selection.correct": 100, "selection.bits": 2.0}, incumbent, incumbent, policy)
    assert not decision.promoted and decision.reasons[0].startswith("tie with the incumbent")


def test_nothing_to_improve_never_promotes():
    policy = {"floors": {"retention.correct": 2}}
    decision = decide(metrics(250, 128), ANCHOR, ANCHOR, policy)
    assert not decision.promoted
    assert "none is ever promoted" in decision.reasons[0]


def test_exact_tie_keeps_the_earlier_checkpoint():
    incumbent = metrics(200, 127)
    decision = decide(metrics(200, 127), incumbent, ANCHOR, POLICY)
    assert not decision.promoted
    assert decision.reasons == ["tie with the incumbent (selection.correct 200 vs 200), so the earlier checkpoint "
                                "is kept"]


def test_every_reason_is_recorded():
    policy = dict(POLICY, nondecreasing=["retention.correct"], nonincreasing=["selection.loss"])
    incumbent = metrics(200, 127, **{"selection.loss": 0.5})
    decision = decide(metrics(190, 120, **{"selection.loss": 0.75}), incumbent, ANCHOR, policy)
    assert not decision.promoted
    assert len(decision.reasons) == 4
    assert "retention.correct 120 is below its floor 126" in decision.reasons[0]
    assert "retention.correct 120 fell below the incumbent's 127" in decision.reasons[1]
    assert "selection.loss 0.75 rose above the incumbent's 0.5" in decision.reasons[2]
    assert "selection.correct 190 vs 200" in decision.reasons[3]


def test_lower_loss_alone_does_not_promote():
    incumbent = metrics(200, 127, **{"train.loss": 0.9})
    decision = decide(metrics(200, 127, **{"train.loss": 0.1}), incumbent, ANCHOR, POLICY)
    assert not decision.promoted


def test_non_finite_candidate_fails_every_rule_it_touches():
    policy = dict(POLICY, nondecreasing=["retention.correct"])
    decision = decide(metrics(float("nan"), float("inf")), metrics(100, 127), ANCHOR, policy)
    assert not decision.promoted
    assert failing(decision, "nondecreasing") == ["retention.correct"]  # inf >= 127, but not finite
    assert failing(decision, "improve_any") == ["selection.correct"]
    assert failing(decision, "floors") == ["retention.correct"]
    assert "not a finite number" in decision.reasons[0]
    assert json.dumps(decision.to_json(), allow_nan=False)


def test_mismatched_denominators_raise():
    expected = "'retention.total' differs: candidate 127, incumbent 128, anchor 128"
    with pytest.raises(DenominatorMismatch, match=expected):
        decide(dict(metrics(200, 127), **{"retention.total": 127}), ANCHOR, ANCHOR, POLICY)
    assert issubclass(DenominatorMismatch, OpalctlError)


def test_missing_metric_raises():
    candidate = metrics(200, 127)
    del candidate["retention.correct"]
    with pytest.raises(MissingMetric, match="candidate's evaluation has no metric 'retention.correct'"):
        decide(candidate, ANCHOR, ANCHOR, POLICY)
    with pytest.raises(OpalctlError, match="unknown key"):
        decide(ANCHOR, ANCHOR, ANCHOR, {"improve": ["selection.correct"]})


def test_select_walks_stages_in_order():
    stages = [metrics(100, 127), metrics(150, 124), metrics(100, 126), metrics(180, 126)]
    # stage 1 breaks the floor, stage 2 ties stage 0, stage 3 improves
    assert select(stages, ANCHOR, POLICY) == 3
    assert select(stages[:3], ANCHOR, POLICY) == 0


def test_no_qualifier_leaves_the_anchor_selected():
    stages = [metrics(100, 120), metrics(150, 110), metrics(0, 128)]
    assert select(stages, ANCHOR, POLICY) is None
    assert select([], ANCHOR, POLICY) is None


def test_to_json_gives_plain_numbers():
    candidate = {k: np.int64(v) for k, v in metrics(200, 127).items()}
    decision = decide(candidate, ANCHOR, ANCHOR, POLICY)
    assert decision.promoted
    text = json.dumps(decision.to_json(), allow_nan=False)
    assert json.loads(text)["checks"][0] == {"rule": "denominators", "metric": "selection.total", "candidate": 250,
                                             "reference": 250, "passed": True}
