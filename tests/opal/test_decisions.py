"""When the agent is asked (schedules, wake-ups within a cap, non-finite losses) and whether training waits
for it (blocking True / False / "auto", one decision in flight at a time, manual boundaries)."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opalctl.formats import Event
from opalctl.opal import wrap
from opalctl.opal.schedule import DecisionSchedule, decision_fractions

# -- schedules ------------------------------------------------------------------------------------------------------


def test_front_schedule_by_hand():
    # 8 decisions: ceil(8 / 5) = 2 in the first tenth (0.05, 0.1), the other 6 spread over 0.1..1 in steps of 0.9 / 7
    assert decision_fractions(8, "front") == pytest.approx(
        [0.05, 0.1, 0.1 + 0.9 / 7, 0.1 + 1.8 / 7, 0.1 + 2.7 / 7, 0.1 + 3.6 / 7, 0.1 + 4.5 / 7, 0.1 + 5.4 / 7])
    # 5 decisions: one early (0.1), then 0.28, 0.46, 0.64, 0.82
    assert decision_fractions(5, "front") == pytest.approx([0.1, 0.28, 0.46, 0.64, 0.82])
    assert decision_fractions(1, "front") == pytest.approx([0.1])
    # 10 decisions: 2 early (0.05, 0.1), 8 over the rest in steps of 0.1
    assert decision_fractions(10, "front") == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    assert decision_fractions(0, "front") == []


def test_uniform_schedule_by_hand():
    assert decision_fractions(3, "uniform") == pytest.approx([0.25, 0.5, 0.75])
    assert decision_fractions(4, "uniform") == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert decision_fractions(1, "uniform") == pytest.approx([0.5])


def test_explicit_schedule():
    assert decision_fractions(8, [0.5, 0.2, 0.9]) == [0.2, 0.5, 0.9]  # sorted; the count comes from the list
    for bad in ([0.0, 0.5], [0.5, 1.0], [-0.1], [1.5]):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            decision_fractions(3, bad)
    with pytest.raises(ValueError, match="unknown decision schedule"):
        decision_fractions(3, "back")


@given(st.integers(min_value=1, max_value=200))
def test_front_schedule_properties(decisions):
    fractions = decision_fractions(decisions, "front")
    assert len(fractions) == decisions
    assert all(0 < f < 1 for f in fractions)
    assert fractions == sorted(fractions) and len(set(fractions)) == decisions
    early = [f for f in fractions if f <= 0.1 + 1e-12]
    assert len(early) == max(1, math.ceil(decisions / 5))


def test_schedule_takes_every_point_already_passed():
    schedule = DecisionSchedule([0.1, 0.2, 0.3], max_wakes=1)
    assert not schedule.due(0.05)
    assert schedule.due(0.25)
    schedule.take(0.25)  # one decision answers both 0.1 and 0.2
    assert schedule.remaining == 1 and not schedule.due(0.29) and schedule.due(0.3)
    assert schedule.can_wake()
    schedule.take_wake()
    assert not schedule.can_wake()


# -- wake-ups -------------------------------------------------------------------------------------------------------

WAKING_ANALYSIS = '''EVERY = 5


def analyze(obs, memory):
    return {"report": {"update": obs["update"]}, "wake": "x"}
'''


@pytest.mark.parametrize("max_wakes,expected", [(0, 0), (2, 2), (None, 1)])  # None: max(1, decisions // 2) = 1
def test_a_wake_from_the_analysis_adds_a_decision_within_the_cap(opal, run_dir, max_wakes, expected):
    model = opal.make_model()
    writer = opal.Writer(analysis=WAKING_ANALYSIS)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=1, schedule=[0.05], total_steps=100,
                     run_dir=run_dir, max_wakes=max_wakes)
    opal.train(model, optimizer, 100)
    figures = optimizer.close()

    requested = opal.of_kind(run_dir, "requested")
    assert [e["reason"] for e in requested] == ["scheduled"] + ["wake: x"] * expected
    assert figures["wakes"] == expected and figures["decisions_asked"] == 1 + expected
    assert len(writer.calls) == 1 + expected
    assert opal.of_kind(run_dir, "applied")[0]["update"] == 5
    # the analysis asked on every call after the change (every 5 updates from update 10); the cap held
    assert len(opal.of_kind(run_dir, "wake")) > expected
    if expected:  # the first wake-up is asked at the boundary after the first analysis of the new version
        assert requested[1]["update"] == 10


def test_a_non_finite_loss_adds_a_decision_and_waits_for_it(opal, run_dir):
    model = opal.make_model()
    writer = opal.Writer(sleep=0.3)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=1, schedule=[0.9], total_steps=100,
                     run_dir=run_dir, blocking=False)
    opal.train(model, optimizer, 100, losses={30: float("nan")})
    figures = optimizer.close()

    requested = opal.of_kind(run_dir, "requested")
    assert [e["reason"] for e in requested] == ["wake: non-finite loss", "scheduled"]
    assert requested[0]["update"] == 50  # the loss is read at the analysis after update 50 (EVERY = 25)
    # non-blocking run, but a non-finite loss makes training wait for the answer
    answered = opal.of_kind(run_dir, "kept")
    assert answered[0]["decision"] == 1 and answered[0]["update"] == 50
    meta = json.loads((run_dir / "decisions" / "001" / "meta.json").read_text())
    assert meta["waited_seconds"] >= 0.3
    assert figures["wakes"] == 1


# -- blocking modes -------------------------------------------------------------------------------------------------


def test_non_blocking_training_goes_on_and_the_change_applies_at_a_boundary(opal, run_dir):
    # the agent takes 1 s, far longer than any update here even on a loaded host (a step of 0.29 s was seen beside a
    # 0.3 s agent), so a step that waited for it stands out; 400 updates of 4 ms outlast it
    steps = 400
    model = opal.make_model()
    writer = opal.Writer(updater=opal.sgd_updater(), sleep=1.0)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=1, schedule=[0.05], total_steps=steps,
                     run_dir=run_dir, blocking=False)
    step_seconds = []
    opal.train(model, optimizer, steps, sleep=0.004, step_seconds=step_seconds)
    figures = optimizer.close()

    requested = opal.of_kind(run_dir, "requested")[0]
    applied = opal.of_kind(run_dir, "applied")[0]
    assert requested["update"] == 20
    assert requested["update"] < applied["update"] < steps, "training was blocked by the agent"
    assert max(step_seconds) < 0.9  # no step waited for the 1 s agent
    meta = json.loads((run_dir / "decisions" / "001" / "meta.json").read_text())
    assert meta["waited_seconds"] == 0.0 and meta["requested_at"] == 20 and meta["answered_at"] == applied["update"]
    assert figures["waiting_seconds"] < 0.2 < 1.0 <= figures["agent_seconds"]

    # the new program took over exactly at that boundary: AdamW for `at` updates, then plain SGD
    at = applied["update"]
    expected = opal.make_model()
    base = opal.adamw(expected)
    opal.train(expected, base, at, plain=True)
    opal.manual_sgd(expected, steps - at, start=at)
    assert opal.mismatches(expected, model) == []


@pytest.mark.parametrize("max_lag,second_waits", [(10**9, False), (50, True)])
def test_auto_waits_at_the_first_decision(opal, run_dir, max_lag, second_waits):
    model = opal.make_model()
    writer = opal.Writer(sleep=0.3)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=2, schedule=[0.05, 0.5], total_steps=100,
                     run_dir=run_dir, blocking="auto", max_lag=max_lag)
    opal.train(model, optimizer, 100, sleep=0.002)
    optimizer.close()

    first = json.loads((run_dir / "decisions" / "001" / "meta.json").read_text())
    second = json.loads((run_dir / "decisions" / "002" / "meta.json").read_text())
    assert first["requested_at"] == first["answered_at"] == 5 and first["waited_seconds"] >= 0.3
    assert second["requested_at"] == 50
    if second_waits:  # the answer would land far more than max_lag updates late: wait
        assert second["answered_at"] == 50 and second["waited_seconds"] >= 0.3
    else:  # training went on; here the answer came after the last update, so it was recorded as late
        assert second["answered_at"] > 50 and second["waited_seconds"] == 0.0
        assert second["outcome"] in ("kept", "late")


def test_one_decision_in_flight_at_a_time(opal, run_dir):
    model = opal.make_model()
    writer = opal.Writer(sleep=0.2)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=4, schedule=[0.05, 0.06, 0.07, 0.08],
                     total_steps=200, run_dir=run_dir, blocking=False)
    opal.train(model, optimizer, 200, sleep=0.003)
    figures = optimizer.close()

    assert writer.most_active == 1
    decisions = opal.of_kind(run_dir, "requested", "kept", "applied", "decision_failed")
    kinds = [e["kind"] for e in decisions]
    assert kinds == ["requested", "kept"] * (len(kinds) // 2), kinds  # never a second request before an answer
    # the points passed while one was in flight were folded into one queued decision
    assert figures["decisions_asked"] == 2
    assert optimizer.decisions.schedule.remaining == 0
    assert decisions[2]["update"] == decisions[1]["update"] > 10


def test_close_leaves_no_decision_in_flight(opal, run_dir):
    model = opal.make_model()
    writer = opal.Writer(sleep=0.3)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=2, schedule=[0.05, 0.06], total_steps=100,
                     run_dir=run_dir, blocking=False)
    opal.train(model, optimizer, 100)  # fast: the first decision is still in flight at the end, the second queued
    optimizer.close()

    log = opal.events(run_dir)
    asked = {e["decision"] for e in opal.of_kind(log, "requested")}
    ended = {e["decision"] for e in opal.of_kind(log, *Event.OUTCOMES, Event.ABANDONED)}
    assert asked == ended
    assert optimizer.decisions.state.inflight is None


def test_manual_boundaries_step_never_asks(opal, tmp_path):
    model = opal.make_model()
    writer = opal.Writer()
    optimizer = wrap(opal.adamw(model), model, backend=writer, total_steps=200, run_dir=tmp_path / "a",
                     manual_boundaries=True)
    opal.train(model, optimizer, 200)
    optimizer.close()
    assert writer.calls == [] and opal.of_kind(tmp_path / "a", "requested") == []

    model = opal.make_model()
    writer = opal.Writer()
    optimizer = wrap(opal.adamw(model), model, backend=writer, total_steps=200, run_dir=tmp_path / "b",
                     manual_boundaries=True)
    opal.train(model, optimizer, 200, between=True)
    optimizer.close()
    assert len(writer.calls) == 8
    assert [e["update"] for e in opal.of_kind(tmp_path / "b", "requested")][:2] == [10, 20]
