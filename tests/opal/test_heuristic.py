"""The heuristic agent (``opalctl.opal.agents.heuristic``): each rule on hand-made facts against a workspace holding
the default ``updater.py``, the four-part rationale, and determinism of whole runs."""

import json

import pytest

from opalctl.opal import wrap
from opalctl.opal.agents.heuristic import HeuristicBackend, read_settings
from opalctl.opal.programs import check_source, load_program

DEFAULTS = {"LR_SCALE": 1.0, "CLIP": None, "ANNEAL_START": None}
STEADY_BINS = [{"start": 1, "end": 25, "count": 25, "mean": 1.0, "min": 0.8, "max": 1.2, "nonfinite": 0}] * 3


def facts(*, progress=0.2, reason="scheduled", window=None, slope=None, ratio=None, bins=STEADY_BINS):
    report = {"loss_window": window if window is not None else {"mean": 1.0, "min": 0.8, "max": 1.2, "count": 25,
                                                                "nonfinite": 0},
              "loss_slope_per_100": slope,
              "roles": {"matrix": {"update_to_weight": ratio}, "bias": {"update_to_weight": 1.0}}}
    return {"decision": 2, "reason": reason, "progress": progress, "update": int(progress * 1000),
            "losses": {"bins": list(bins)}, "report": report}


@pytest.fixture
def workspace(opal, tmp_path):
    folder = tmp_path / "workspace"
    folder.mkdir()
    (folder / "updater.py").write_text(opal.default_sources()["updater.py"], encoding="utf-8")
    return folder


def decide(workspace, given, settings=None):
    if settings is not None:
        source = (workspace / "updater.py").read_text()
        for name, value in settings.items():
            source = source.replace(f"{name} = {DEFAULTS[name]!r}", f"{name} = {value!r}", 1)
        (workspace / "updater.py").write_text(source)
        assert read_settings(source) == {**DEFAULTS, **settings}
    before = (workspace / "updater.py").read_text()
    answer = HeuristicBackend().decide(workspace, "", given)
    after = (workspace / "updater.py").read_text()
    return answer, read_settings(after), before != after


def assert_four_parts(rationale, changed):
    lines = rationale.splitlines()
    assert [line.split(":")[0] for line in lines] == ["Observed", "Changed" if changed else "Kept", "Prediction",
                                                      "Rules"], rationale


def test_a_loss_spike_halves_the_scale_and_clips(workspace):
    answer, settings, changed = decide(workspace, facts(window={"mean": 1.5, "min": 0.9, "max": 5.0, "count": 25,
                                                                "nonfinite": 0}))
    assert changed and settings == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}
    assert_four_parts(answer.rationale, changed=True)
    assert "LR_SCALE 1 -> 0.5" in answer.rationale and "CLIP None -> 1" in answer.rationale
    assert "react to a signal" in answer.rationale


@pytest.mark.parametrize("how", ["window", "reason"])
def test_a_non_finite_loss_halves_the_scale_and_clips(workspace, how):
    if how == "window":
        given = facts(window={"mean": 1.0, "min": 0.8, "max": 1.2, "count": 25, "nonfinite": 2})
    else:
        given = facts(reason="wake: non-finite loss")
    answer, settings, changed = decide(workspace, given)
    assert settings == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}


def test_instability_keeps_a_tighter_clip(workspace):
    answer, settings, changed = decide(workspace, facts(reason="wake: loss spike"), settings={"CLIP": 0.25})
    assert settings == {"LR_SCALE": 0.5, "CLIP": 0.25, "ANNEAL_START": None}


def test_a_small_rise_is_not_a_spike(workspace):
    # max above 3x the median but less than 0.5 above it: no spike
    bins = [dict(STEADY_BINS[0], mean=0.1)] * 3
    answer, settings, changed = decide(workspace, facts(bins=bins, window={"mean": 0.2, "min": 0.1, "max": 0.45,
                                                                           "count": 25, "nonfinite": 0}))
    assert not changed and settings == DEFAULTS


def test_a_high_update_to_weight_ratio_halves_the_scale(workspace):
    answer, settings, changed = decide(workspace, facts(ratio=0.05))
    assert settings == {"LR_SCALE": 0.5, "CLIP": None, "ANNEAL_START": None}
    assert_four_parts(answer.rationale, changed=True)


def test_a_low_update_to_weight_ratio_doubles_the_scale(workspace):
    answer, settings, changed = decide(workspace, facts(ratio=5e-5))
    assert settings == {"LR_SCALE": 2.0, "CLIP": None, "ANNEAL_START": None}
    answer, settings, changed = decide(workspace, facts(ratio=5e-5))  # again, from 2.0
    assert settings["LR_SCALE"] == 4.0


@pytest.mark.parametrize("start, doubles", [(2.3, False), (5e-4, True), (None, True)])
def test_a_low_ratio_does_not_double_once_the_data_is_fitted(workspace, start, doubles):
    # the window's mean loss is 1e-6: under a thousandth of a first interval at 2.3, so tiny updates mean there is
    # little left to learn; not against 5e-4 (a loss that started small), nor without a first interval
    given = facts(ratio=5e-5, progress=0.2, window={"mean": 1e-6, "min": 5e-7, "max": 2e-6, "count": 25,
                                                      "nonfinite": 0})
    given["loss_start"] = start
    answer, settings, changed = decide(workspace, given)
    assert (settings["LR_SCALE"] == 2.0) is doubles
    assert changed is doubles  # nothing else fires at 20 % of the budget with a steady loss


def test_a_low_ratio_never_takes_the_scale_above_8(workspace):
    answer, settings, changed = decide(workspace, facts(ratio=5e-5), settings={"LR_SCALE": 6.0})
    assert settings["LR_SCALE"] == 8.0
    answer, settings, changed = decide(workspace, facts(ratio=5e-5))
    assert not changed and settings["LR_SCALE"] == 8.0


@pytest.mark.parametrize("ratio", [1e-3, 1e-2, 0.03, 1e-4])
def test_a_usual_ratio_changes_nothing(workspace, ratio):
    answer, settings, changed = decide(workspace, facts(ratio=ratio))
    assert not changed


def test_a_plateau_after_30_percent_scales_by_0_7(workspace):
    # slope 0.004 per 100 updates on a mean of 1.0: flatter than 0.5 % of the mean
    answer, settings, changed = decide(workspace, facts(progress=0.35, slope=0.004, ratio=5e-3))
    assert settings == {"LR_SCALE": 0.7, "CLIP": None, "ANNEAL_START": None}
    assert "x0.7" in answer.rationale


@pytest.mark.parametrize("progress,slope", [(0.25, 0.004), (0.35, -0.02)])
def test_no_plateau_before_30_percent_or_on_a_falling_loss(workspace, progress, slope):
    answer, settings, changed = decide(workspace, facts(progress=progress, slope=slope, ratio=5e-3))
    assert not changed


def test_no_plateau_once_an_anneal_is_set(workspace):
    answer, settings, changed = decide(workspace, facts(progress=0.6, slope=0.0), settings={"ANNEAL_START": 0.8})
    assert not changed


@pytest.mark.parametrize("progress,start", [(0.5, 0.8), (0.61, 0.8), (0.9, 0.9)])
def test_anneal_from_half_the_budget(workspace, progress, start):
    answer, settings, changed = decide(workspace, facts(progress=progress, slope=-0.2))
    assert settings == {"LR_SCALE": 1.0, "CLIP": None, "ANNEAL_START": start}
    assert_four_parts(answer.rationale, changed=True)
    assert "is a schedule" in answer.rationale


def test_nothing_fires_keeps(workspace):
    before = (workspace / "updater.py").read_text()
    answer, settings, changed = decide(workspace, facts(progress=0.45, slope=-0.2, ratio=5e-3))
    assert not changed and (workspace / "updater.py").read_text() == before
    assert_four_parts(answer.rationale, changed=False)
    assert "no rule fired" in answer.rationale


def test_a_rewritten_updater_is_kept(workspace, opal):
    (workspace / "updater.py").write_text(opal.sgd_updater())
    answer, settings, changed = decide(workspace, facts(ratio=0.05))
    assert not changed and settings is None
    assert_four_parts(answer.rationale, changed=False)


def test_first_rule_wins(workspace):
    # a spike and a high ratio at once: instability decides (halve and clip, not halve only)
    answer, settings, changed = decide(workspace, facts(reason="wake: loss spike", ratio=0.05, progress=0.9))
    assert settings == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}


def test_the_edited_program_passes_the_check_and_loads(workspace):
    decide(workspace, facts(reason="wake: loss spike"))
    decide(workspace, facts(progress=0.7, slope=-0.2))
    source = (workspace / "updater.py").read_text()
    assert read_settings(source) == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": 0.8}
    assert check_source(source, "updater.py") == []
    module = load_program("updater", source).module
    assert (module.LR_SCALE, module.CLIP, module.ANNEAL_START) == (0.5, 1.0, 0.8)


def test_facts_are_read_from_the_workspace_when_not_given(workspace):
    (workspace / ".opal").mkdir()
    (workspace / ".opal" / "facts.json").write_text(json.dumps(facts(ratio=0.05)))
    answer, settings, changed = decide(workspace, {})
    assert settings["LR_SCALE"] == 0.5


# -- whole runs ---------------------------------------------------------------------------------------------------


def _run(opal, run_dir, steps=300, sleep=0.0, **options):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", total_steps=steps, run_dir=run_dir, **options)
    opal.train(model, optimizer, steps, sleep=sleep)
    optimizer.close()
    return model, opal.events(run_dir)


def test_two_heuristic_runs_are_identical(opal, tmp_path):
    first, first_events = _run(opal, tmp_path / "a")
    second, second_events = _run(opal, tmp_path / "b")
    assert opal.mismatches(first, second) == []
    assert opal.without_timing(first_events) == opal.without_timing(second_events)
    assert opal.of_kind(first_events, "applied"), "the heuristic should change something on this run"
    assert (tmp_path / "a" / "programs" / "v001" / "updater.py").read_text() == \
        (tmp_path / "b" / "programs" / "v001" / "updater.py").read_text()
    # and differs from the plain run once it has changed something
    assert opal.mismatches(opal.plain_adamw(300), first)


def test_non_blocking_heuristic_answers_from_a_child_process(opal, run_dir):
    """The heuristic computes, so a non-blocking decision runs in ``python -m opalctl.opal.agents.worker``."""
    # 40 updates of 30 ms after the decision: time for the child process to answer before the run ends
    model, log = _run(opal, run_dir, steps=100, sleep=0.03, decisions=1, schedule=[0.6], blocking=False)
    outcomes = opal.of_kind(log, "applied", "kept", "decision_failed")
    assert [e["kind"] for e in outcomes] == ["applied"], outcomes  # at 60 % the anneal rule fires
    assert outcomes[0]["update"] >= 60
    assert read_settings((run_dir / "programs" / "v001" / "updater.py").read_text())["ANNEAL_START"] == 0.8
    assert (run_dir / "agent" / "decisions" / "001" / "response.md").read_text().startswith("Observed:")


# -- the rule each decision records (which rule fired on which signal) --------------------------------------------

SPIKING = {"mean": 1.5, "min": 0.9, "max": 5.0, "count": 25, "nonfinite": 0}
RULE_CASES = {
    # rule: (facts built to trigger it, the settings it writes, its signal, value, threshold)
    "non-finite loss": (facts(window={"mean": 1.0, "min": 0.8, "max": 1.2, "count": 25, "nonfinite": 3}),
                        {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}, "non-finite losses in the window", 3, 0),
    "spike": (facts(window=SPIKING), {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}, "loss window max", 5.0,
              3.0),
    "update size high": (facts(ratio=0.05), {"LR_SCALE": 0.5, "CLIP": None, "ANNEAL_START": None},
                         "median update/weight ratio", 0.05, 3e-2),
    "update size low": (facts(ratio=5e-5), {"LR_SCALE": 2.0, "CLIP": None, "ANNEAL_START": None},
                        "median update/weight ratio", 5e-5, 1e-4),
    "plateau": (facts(progress=0.35, slope=0.004, ratio=5e-3), {"LR_SCALE": 0.7, "CLIP": None, "ANNEAL_START": None},
                "loss slope per 100 updates / mean loss", 0.004, 0.005),
    "anneal": (facts(progress=0.6, slope=-0.2, ratio=5e-3), {"LR_SCALE": 1.0, "CLIP": None, "ANNEAL_START": 0.8},
               "budget progress", 0.6, 0.5),
}


def _decision_folder(workspace, answer):
    """Where the records put a decision's transcript (``decisions/NNN/transcript.json``)."""
    folder = workspace.parent / "decisions" / "001"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transcript.json").write_text(json.dumps(answer.transcript))
    return folder


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_each_rule_records_which_signal_fired_it_and_writes_a_program_that_loads(workspace, rule):
    from opalctl.opal.agents.heuristic import RULES, decided_by

    given, written, signal, value, threshold = RULE_CASES[rule]
    answer, settings, changed = decide(workspace, given)
    assert changed and settings == written
    check = decided_by(_decision_folder(workspace, answer))
    assert (check.rule, check.signal, check.fired) == (rule, signal, True)
    assert check.value == pytest.approx(value) and check.threshold == pytest.approx(threshold)
    # every rule before it was checked and did not fire; none after it was checked
    checked = [entry["rule"] for entry in answer.transcript]
    assert checked[-1] == rule and [e["fired"] for e in answer.transcript] == [False] * (len(checked) - 1) + [True]
    assert len(checked) <= len(RULES)
    assert f"rule {check.words()}" in answer.rationale  # the Changed line says it in words too
    source = (workspace / "updater.py").read_text()
    assert check_source(source, "updater.py") == []
    module = load_program("updater", source).module
    assert {"LR_SCALE": module.LR_SCALE, "CLIP": module.CLIP, "ANNEAL_START": module.ANNEAL_START} == written


def test_a_decision_where_nothing_fires_records_that_no_rule_fired(workspace):
    from opalctl.opal.agents.heuristic import decided_by

    answer, settings, changed = decide(workspace, facts(progress=0.45, slope=-0.2, ratio=5e-3))
    assert not changed
    check = decided_by(_decision_folder(workspace, answer))
    assert check.rule == "none" and [e["rule"] for e in answer.transcript][:2] == ["non-finite loss", "spike"]


@pytest.mark.parametrize("how", ["field", "empty bins"])
def test_with_no_loss_observed_the_heuristic_keeps_and_says_nothing_can_be_said_of_a_trend(workspace, how):
    from opalctl.opal.agents.heuristic import NO_LOSS_SENTENCE, decided_by

    # late in the budget with a high update size: anneal and update-size rules would fire on a loss-less report
    given = facts(progress=0.9, ratio=0.05, window={"mean": None, "min": None, "max": None, "count": 0,
                                                    "nonfinite": 0},
                  bins=[{"start": 1, "end": 25, "count": 0, "mean": None, "min": None, "max": None, "nonfinite": 0}])
    if how == "field":
        given["losses_observed"] = 0
        given["losses"]["bins"] = []
    answer, settings, changed = decide(workspace, given)
    assert not changed and settings == DEFAULTS
    assert_four_parts(answer.rationale, changed=False)
    assert NO_LOSS_SENTENCE in answer.rationale and "steady" not in answer.rationale
    assert decided_by(_decision_folder(workspace, answer)).rule == "no loss"


def test_a_real_loss_spike_in_a_run_fires_the_spike_rule_and_its_program_is_applied(opal, run_dir):
    from opalctl.opal.agents.heuristic import decided_by

    # a task whose loss jumps 60-fold at update 150 (the batch's targets scaled): the analysis wakes the agent
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", total_steps=200, run_dir=run_dir, decisions=1,
                     schedule=[0.95])
    for update in range(200):
        x, y = opal.DATA[update % opal.N_BATCHES]
        optimizer.zero_grad()
        loss = ((model(x) - y * (60.0 if update == 150 else 1.0)) ** 2).mean()
        loss.backward()
        optimizer.step(loss=loss)
    optimizer.close()
    woken = [e for e in opal.events(run_dir) if e["kind"] == "requested" and "spike" in str(e.get("reason"))]
    assert woken, "the spike should wake the agent"
    check = decided_by(run_dir / "agent" / "decisions" / f"{woken[0]['decision']:03d}")
    assert check.rule == "spike" and check.fired
    applied = read_settings((run_dir / "programs" / "v001" / "updater.py").read_text())
    assert applied == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}


def test_a_spike_wake_up_records_the_peak_and_the_threshold_the_analysis_saw(workspace):
    from opalctl.opal.agents.heuristic import decided_by

    answer, settings, changed = decide(workspace, facts(reason="wake: loss spike: 0.6352 against a median of 0.01564"))
    assert settings == {"LR_SCALE": 0.5, "CLIP": 1.0, "ANNEAL_START": None}
    check = decided_by(_decision_folder(workspace, answer))
    assert (check.rule, check.signal, check.value) == ("spike", "loss at the wake-up", 0.6352)
    assert check.threshold == pytest.approx(3 * 0.01564) and check.comparison == ">"
