"""``arms.NAME.schedule``: a name, as every protocol wrote it before warm-ups and floors (and as its lock resolves
it still, so no lock's digest moves), or a mapping with a warm-up, a floor and the wsd schedule. The factors of
the names are held against their plain formulas, exactly; the runs that read each update's learning rate back
are in test_learning_rates.py."""

from __future__ import annotations

import math

import pytest
import yaml

from opalctl.driver.arm import Schedule, schedule_factor
from opalctl.protocol.freeze import resolved_protocol
from opalctl.protocol.schema import ProtocolError, load_protocol
from opalctl.tasks.builtin import protocol_text

FRACTIONS = [i / 997 for i in range(998)] + [0.8, 0.8 + 1e-12, 1.0, -0.5, 1.5]


def plain(name: str, fraction: float) -> float:
    """The factors every named schedule gave before schedules could be mappings."""
    fraction = min(max(fraction, 0.0), 1.0)
    return {"constant": 1.0, "cosine": 0.5 * (1.0 + math.cos(math.pi * fraction)), "linear": 1.0 - fraction,
            "anneal-end": 1.0 if fraction <= 0.8 else max(0.0, (1.0 - fraction) / 0.2)}[name]


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "anneal-end"])
def test_a_named_schedule_gives_exactly_the_factors_it_always_gave(name):
    assert [schedule_factor(name, f) for f in FRACTIONS] == [plain(name, f) for f in FRACTIONS]
    assert [Schedule.of({"name": name}).factor(f) for f in FRACTIONS] == [plain(name, f) for f in FRACTIONS]


def test_a_warm_up_rises_linearly_then_the_schedule_runs_over_the_rest_down_to_its_floor():
    schedule = Schedule.of({"name": "linear", "warmup": 0.2, "min_lr": 0.25})
    assert schedule.factor(0.0) == 0.0 and schedule.factor(0.1) == pytest.approx(0.5)
    assert schedule.factor(0.2) == 1.0 and schedule.factor(0.6) == pytest.approx(0.25 + 0.75 * 0.5)
    assert schedule.factor(1.0) == pytest.approx(0.25)
    assert not schedule.constant and Schedule.of({"name": "constant", "warmup": 0.1}).factor(0.5) == 1.0


@pytest.mark.parametrize(("shape", "half_way"), [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_holds_the_peak_then_decays_over_its_last_part(shape, half_way):
    schedule = Schedule.of({"name": "wsd", "decay": 0.4, "decay_shape": shape})
    assert schedule.factor(0.3) == 1.0 and schedule.factor(0.6) == 1.0
    assert schedule.factor(0.8) == pytest.approx(half_way) and schedule.factor(1.0) == pytest.approx(0.0, abs=1e-15)
    assert Schedule.of("wsd").factor(0.9) == pytest.approx(0.5)  # the name alone: the last fifth, linear


def test_a_named_schedule_resolves_to_its_name_and_a_mapping_to_every_key(tmp_path):
    text = protocol_text("digits", [1]).replace(
        "schedule: cosine}", "schedule: {name: cosine, warmup: 0.05, min_lr: 0.1}}")
    path = tmp_path / "digits.yaml"
    path.write_text(protocol_text("digits", [1]))
    assert resolved_protocol(load_protocol(path))["arms"]["adamw-cosine"]["schedule"] == "cosine"
    path.write_text(text)
    assert resolved_protocol(load_protocol(path))["arms"]["adamw-cosine"]["schedule"] == {
        "name": "cosine", "warmup": 0.05, "min_lr": 0.1, "decay": 0.2, "decay_shape": "linear"}


@pytest.mark.parametrize(("schedule", "said"), [
    ("{name: cosine, decay: 0.3}", "decay belongs to the wsd schedule; remove it or write name: wsd"),
    ("{name: constant, min_lr: 0.1}", "a constant schedule never falls, so min_lr has nothing to floor"),
    ("{name: cosine, warmup: 1.0}", "warmup"),
    ("{name: cosine, warmup: 0.1, floor: 0.1}", "floor"),
    ("cosinus", "input should be 'constant', 'cosine', 'linear', 'anneal-end' or 'wsd'"),
])
def test_a_schedule_that_cannot_be_is_refused_naming_its_key(tmp_path, schedule, said):
    path = tmp_path / "digits.yaml"
    path.write_text(protocol_text("digits", [1]).replace("schedule: cosine}", f"schedule: {schedule}}}"))
    with pytest.raises(ProtocolError) as refused:
        load_protocol(path)
    message = refused.value.message
    assert "arms.adamw-cosine.schedule" in message and said in message, message
    assert "[mapping]" not in message and "[name]" not in message


def test_controls_name_an_agent_arms_own_recipe_as_the_fixed_schedule_it_kept():
    """An agent that changed nothing on an arm with a warm-up and a floor ran that arm's own fixed schedule: the
    controls say so, rather than "not reducible" for want of a built-in name."""
    from opalctl.compare.controls import RunEquivalence, effective_factors, fixed_equivalent

    recipe = {"name": "cosine", "warmup": 0.1, "min_lr": 0.1, "decay": 0.2, "decay_shape": "linear"}
    fractions = [u / 50 for u in range(50)]
    factors = effective_factors([], fractions, recipe)
    assert factors == [Schedule.of(recipe).factor(f) for f in fractions]
    assert fixed_equivalent(factors, fractions) is None  # no built-in schedule is this one
    assert fixed_equivalent(factors, fractions, recipe) == (recipe, 1.0)
    assert RunEquivalence(seed=1, schedule=recipe).words() == "fixed schedule `cosine (warm-up 0.1, floor 0.1)`"


def test_the_recipes_page_arms_are_protocol_arms(tmp_path):
    """docs/recipes.md's example arms freeze as written (into the digits protocol)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text(encoding="utf-8")
    block = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    arms = yaml.safe_load(block)["arms"]
    assert set(arms) == {"nanogpt", "wsd", "finetune"}
    protocol = yaml.safe_load(protocol_text("digits", [1]))
    protocol["arms"].update(arms)
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(protocol, sort_keys=False))
    resolved = resolved_protocol(load_protocol(path))["arms"]
    assert resolved["nanogpt"]["schedule"]["warmup"] == 0.02 and resolved["wsd"]["schedule"]["decay_shape"] == "sqrt"
    assert resolved["nanogpt"]["groups"] == [{"match": ["ndim<2"], "weight_decay": 0.0, "lr_scale": 1.0}]
    assert "groups" not in resolved["wsd"]


def test_the_recipes_page_fine_tuning_groups_split_the_pylm_model_as_it_says():
    """docs/recipes.md's fine-tuning arm on the model it names (pylm's): the embeddings at a tenth of the learning
    rate, biases and norms undecayed, the rest (the matrices of the blocks and the head) as the optimizer says."""
    from pathlib import Path

    from opalctl.driver.arm import build_optimizer
    from opalctl.protocol.schema import Arm
    from opalctl.tasks.pylm import PyLMConfig, build_model

    page = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text(encoding="utf-8")
    arm = Arm.model_validate(yaml.safe_load(page.split("```yaml\n", 1)[1].split("```", 1)[0])["arms"]["finetune"])
    model = build_model(PyLMConfig(layers=1, width=16, heads=2, context=8), seed=1)
    _, groups = build_optimizer(arm, model, "arms.finetune")
    named = dict(model.named_parameters())
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(2.0e-5 * 0.1, 0.01), (2.0e-5, 0.0), (2.0e-5, 0.01)]
    assert groups[0]["parameters"] == ["embed.weight", "position.weight"]
    assert groups[1]["parameters"] == [n for n in named if n.endswith("bias") or ".norm" in n or n.startswith("norm")]
    assert groups[2]["parameters"] == [n for n in named if n not in groups[0]["parameters"] + groups[1]["parameters"]]
    assert all(named[n].dim() == 2 for n in groups[2]["parameters"])
