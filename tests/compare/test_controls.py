"""What an agent arm's applied programs amount to (opalctl/compare/controls.py), on constructed inputs: the settings
read only from an updater that is the starting one but for its settings lines, the factor the starting updater
applies, the factor at every update and the fixed schedule it equals (or why none does), and the sentence per arm.
The nanoGPT-like case end to end is tests/compare/test_controls_nanogpt.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest

from opalctl.compare.controls import (
    RunEquivalence,
    Switch,
    arm_controls,
    effective_factors,
    fixed_equivalent,
    run_equivalence,
    setting_factor,
    updater_settings,
    verdict_pointer,
)
from opalctl.driver.arm import Schedule
from opalctl.opal.agents.heuristic import write_settings
from opalctl.opal.programs import default_sources

STARTING = default_sources()["updater.py"]
NONE = {"LR_SCALE": 1.0, "CLIP": None, "ANNEAL_START": None}
ADAMW = {"optimizer": {"name": "AdamW", "lr": 0.001}, "schedule": "constant", "budget_multiplier": 1.0, "model": {},
         "agent": None}
AGENT = {**ADAMW, "agent": {"backend": "heuristic"}}


def fractions(total: int) -> list[float]:
    return [u / total for u in range(total)]


def test_the_starting_updater_with_other_settings_gives_its_settings():
    edited = write_settings(STARTING, {"LR_SCALE": 0.5, "CLIP": None, "ANNEAL_START": 0.8})
    assert updater_settings(edited, STARTING) == {"LR_SCALE": 0.5, "CLIP": None, "ANNEAL_START": 0.8}
    assert updater_settings(STARTING, STARTING) == NONE
    # a comment or spacing may differ: the trees are compared, not the text
    assert updater_settings(STARTING.replace("import torch\n", "import torch   # the same\n\n"), STARTING) == NONE


@pytest.mark.parametrize(("edit", "said"), [
    (lambda s: s.replace("factor = LR_SCALE\n", "factor = LR_SCALE * 0.9\n"), "its code was changed"),
    (lambda s: s.replace("LR_SCALE = 1.0", "LR_SCALE = 2.0 * 0.5"), "other than one number or None"),
    (lambda s: s.replace("CLIP = None", "CLIPPED = None"), "lacks the settings lines CLIP"),
    (lambda s: s + "\nLR_SCALE = 3.0\n", "other than one number or None"),
    (lambda s: s.replace("def build", "def build(:"), "does not parse"),
])
def test_any_other_edit_of_the_updater_is_not_read_as_settings(edit, said):
    reason = updater_settings(edit(STARTING), STARTING)
    assert isinstance(reason, str) and said in reason


def test_setting_factor_is_the_starting_updaters_own_factor():
    """The shipped updater's Updater.factor, run with each setting, gives what setting_factor computes."""
    torch_stub = sys.modules.get("torch") or types.ModuleType("torch")
    for settings in ({"LR_SCALE": 1.0, "CLIP": None, "ANNEAL_START": None},
                     {"LR_SCALE": 0.35, "CLIP": None, "ANNEAL_START": 0.8},
                     {"LR_SCALE": 2.0, "CLIP": None, "ANNEAL_START": 0.6133}):
        spec = importlib.util.spec_from_loader("starting_updater", loader=None)
        module = importlib.util.module_from_spec(spec)
        module.torch = torch_stub
        exec(compile(write_settings(STARTING, settings), "updater.py", "exec"), module.__dict__)
        updater = module.Updater.__new__(module.Updater)
        for progress in [i / 97 for i in range(98)]:
            assert setting_factor(settings, progress) == updater.factor(progress)


def test_the_anneal_applied_before_eighty_percent_is_the_anneal_end_schedule():
    total = 150
    f = fractions(total)
    switches = [Switch(0, NONE), Switch(93, {**NONE, "ANNEAL_START": 0.8})]
    assert fixed_equivalent(effective_factors(switches, f, "constant"), f) == ("anneal-end", 1.0)
    # the factors differ from the built-in's only by rounding (1 - 0.8 is not 0.2 in binary): within TOLERANCE
    built_in = [Schedule("anneal-end").factor(x) for x in f]
    ours = effective_factors(switches, f, "constant")
    assert max(abs(a - b) for a, b in zip(ours, built_in)) < 1e-15


def test_the_anneal_applied_after_eighty_percent_is_no_fixed_schedule():
    f = fractions(150)
    late = [Switch(0, NONE), Switch(130, {**NONE, "ANNEAL_START": 130 / 150})]
    assert fixed_equivalent(effective_factors(late, f, "constant"), f) is None


def test_a_scale_from_the_first_update_is_a_constant_scale_but_from_a_later_update_is_not():
    f = fractions(200)
    first = [Switch(0, {**NONE, "LR_SCALE": 0.5})]
    assert fixed_equivalent(effective_factors(first, f, "constant"), f) == ("constant", 0.5)
    later = [Switch(0, NONE), Switch(40, {**NONE, "LR_SCALE": 0.5})]
    assert fixed_equivalent(effective_factors(later, f, "constant"), f) is None


def test_no_change_is_the_arms_own_schedule_and_a_scale_rides_on_it():
    f = fractions(120)
    assert fixed_equivalent(effective_factors([Switch(0, NONE)], f, "cosine"), f) == ("cosine", 1.0)
    halved = [Switch(0, {**NONE, "LR_SCALE": 0.5})]
    assert fixed_equivalent(effective_factors(halved, f, "linear"), f) == ("linear", 0.5)
    # an anneal on top of a cosine is neither
    annealed = [Switch(0, NONE), Switch(60, {**NONE, "ANNEAL_START": 0.8})]
    assert fixed_equivalent(effective_factors(annealed, f, "cosine"), f) is None


def test_the_arm_sentence_names_the_control_arm_present_missing_or_post_hoc():
    runs = [RunEquivalence(seed=s, schedule="anneal-end", applied=1) for s in (1, 2, 3)]
    present = arm_controls("agent", runs, {"agent": AGENT, "adamw": ADAMW,
                                           "adamw-anneal-end": {**ADAMW, "schedule": "anneal-end"}})
    assert present["sentence"] == ("agent's applied programs equal fixed schedule `anneal-end` on all 3 seeds; "
                                   "control arm `adamw-anneal-end` present in the lock (`opalctl compare LOCK --baseline "
                                   "adamw-anneal-end` pairs the agent with it)")
    missing = arm_controls("agent", runs, {"agent": AGENT, "adamw": ADAMW})
    assert missing["control_arm"] is None and missing["missing_arm"]["name"] == "adamw-anneal-end"
    assert "no such arm in this lock: add one, or run the post-hoc control" in missing["sentence"]
    later = arm_controls("agent", runs, {"agent": AGENT, "adamw": ADAMW},
                         {"adamw-anneal-end": {**ADAMW, "schedule": "anneal-end"}})
    assert later["control_in"] == "post-hoc" and "added after the fact" in later["sentence"]
    mixed = arm_controls("agent", [runs[0], RunEquivalence(seed=2, reason="a program was reverted at update 7")],
                         {"agent": AGENT})
    assert mixed["schedule"] is None
    assert "seed 2: not reducible to a fixed schedule (a program was reverted at update 7)" in mixed["sentence"]
    json.dumps([present, missing, later, mixed])  # what --json prints


def test_a_scaled_control_arm_needs_the_scaled_learning_rate():
    runs = [RunEquivalence(seed=1, schedule="constant", scale=0.5, applied=1)]
    found = arm_controls("agent", runs, {"agent": AGENT, "half": {**ADAMW, "optimizer": {"name": "AdamW",
                                                                                           "lr": 0.0005}}})
    assert found["control_arm"] == "half" and "with the learning rate x0.5" in found["sentence"]
    assert arm_controls("agent", runs, {"agent": AGENT, "adamw": ADAMW})["control_arm"] is None


def test_a_reverted_program_is_not_reducible(tmp_path):
    opal = tmp_path / "training" / "opal"
    opal.mkdir(parents=True)
    (opal / "events.jsonl").write_text(
        json.dumps({"kind": "applied", "update": 10, "version": 1, "decision": 1}) + "\n"
        + json.dumps({"kind": "reverted", "update": 12, "version": 1, "to": 0}) + "\n")
    found = run_equivalence(tmp_path, 1, "constant", 100.0)
    assert found.schedule is None and found.reason == "a program was reverted at update 12"


def test_the_verdict_points_at_the_controls():
    schedule = {"schedule": "anneal-end", "control_arm": None}
    said = verdict_pointer("verdict words.", schedule)
    assert said.endswith(" But its applied programs equal the fixed schedule `anneal-end`, and no control arm ran "
                         "it (see controls).")
    assert "[post-hoc control, added after the fact, not pre-registered]" in verdict_pointer("v.", None, True)
    assert verdict_pointer("v.", {"schedule": None}) == "v."


def test_a_pre_registered_protocol_resolves_without_a_control_key():
    """The ``control`` key is a control lock's alone: every other lock's protocol (and digest) is as it was."""
    from opalctl.protocol.freeze import resolved_protocol
    from opalctl.protocol.schema import Protocol

    protocol = Protocol.model_validate({
        "name": "p", "task": {"entry": "opalctl.tasks.digits:Digits"}, "data": {"train": "t.npz"},
        "parents": "p-{seed}.pt", "seeds": [1], "budget": {"clock": "updates", "amount": 10},
        "training": {"batch_size": 4}, "arms": {"a": {"optimizer": {"name": "SGD", "lr": 0.1}}}})
    assert "control" not in resolved_protocol(protocol)
