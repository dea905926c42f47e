"""``arms.NAME.groups``: parameter groups chosen by rule (``bias``, ``norm``, ``ndim<2``) and by name pattern, each
with its own weight decay and learning-rate multiplier (opalctl/driver/groups.py). A protocol without groups
resolves exactly as before (no lock's digest moves); each parameter lands in the first group that selects it; the
torch optimizer gets the groups as written, then the rest; the budget schedule moves each group's own learning
rate; and what cannot be (a misspelt key, an unknown rule, a pattern that matches nothing, a group left empty, a
weight decay the optimizer has not) is refused in one sentence naming the key. The runs that read each group's
learning rate back are in test_learning_rates.py and test_nanogpt_recipe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from opalctl.driver.arm import BudgetSchedule, Schedule, build_optimizer
from opalctl.driver.groups import assign
from opalctl.errors import BadInput
from opalctl.protocol.freeze import resolved_protocol
from opalctl.protocol.lock import protocol_digest
from opalctl.protocol.schema import GroupSpec, ProtocolError, load_protocol
from opalctl.tasks.builtin import protocol_text
from opalctl.tasks.pylm import PyLMConfig, build_model

PROTOCOLS = Path(__file__).resolve().parents[2] / "protocols"
# the digests of the resolved protocols/*.yaml, computed before parameter groups existed
DIGESTS_BEFORE_GROUPS = {
    "digits": "eee3ad5d3d375413c689f5f509d77f87f313cb2069d4c86c6c5153319b18a0c7",
    "pylm": "dcab6b7dbb2533e024ce785c76eb7a61df899fa1530e50eae5706d0aa7a5dfa8",
    "demo": "586eabfd97b5e312f96e9c8c9f1627e986a787d6928dfe6fc1484abd709ff923",
}
NO_DECAY = [{"match": ["bias", "norm", "ndim<2"], "weight_decay": 0.0}]


@pytest.mark.parametrize("name", sorted(DIGESTS_BEFORE_GROUPS))
def test_a_protocol_without_groups_resolves_and_digests_as_before(name):
    resolved = resolved_protocol(load_protocol(PROTOCOLS / f"{name}.yaml"))
    assert all("groups" not in arm for arm in resolved["arms"].values())
    assert protocol_digest(resolved) == DIGESTS_BEFORE_GROUPS[name]


def digits_protocol(tmp_path: Path, groups, optimizer: dict | None = None) -> Path:
    protocol = yaml.safe_load(protocol_text("digits", [1]))
    arm = {"optimizer": optimizer or {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.1}, "groups": groups}
    protocol["arms"] = {"grouped": arm}
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(protocol, sort_keys=False))
    return path


def test_groups_resolve_with_every_key_in_the_order_written(tmp_path):
    groups = [{"match": ["2.*"], "lr_scale": 0.5}, {"match": ["bias"], "weight_decay": 0}]
    resolved = resolved_protocol(load_protocol(digits_protocol(tmp_path, groups)))
    assert resolved["arms"]["grouped"]["groups"] == [
        {"match": ["2.*"], "weight_decay": None, "lr_scale": 0.5},
        {"match": ["bias"], "weight_decay": 0.0, "lr_scale": 1.0}]


@pytest.mark.parametrize(("groups", "key", "said"), [
    ([{"match": ["bias"], "weight_decay": 0.0, "lr_scal": 2}], "arms.grouped.groups[0].lr_scal",
     "unknown key; check its spelling (known keys: lr_scale, match, weight_decay)"),
    ([{"match": ["ndim<3"], "weight_decay": 0.0}], "arms.grouped.groups[0].match[0]",
     "'ndim<3' is neither a rule (bias, norm, ndim<2) nor a pattern of parameter names"),
    ([{"match": ["bias"]}], "arms.grouped.groups[0]", "this group sets neither weight_decay nor lr_scale"),
    ([{"match": [], "weight_decay": 0.0}], "arms.grouped.groups[0].match", "at least 1 item"),
    ([{"match": ["bias"], "lr_scale": 0}], "arms.grouped.groups[0].lr_scale", "greater than 0"),
    ([{"match": ["bias"], "weight_decay": -0.1}], "arms.grouped.groups[0].weight_decay",
     "greater than or equal to 0"),
])
def test_a_group_that_cannot_be_is_refused_naming_its_key(tmp_path, groups, key, said):
    with pytest.raises(ProtocolError) as refused:
        load_protocol(digits_protocol(tmp_path, groups))
    assert f": {key}: " in refused.value.message and said in refused.value.message, refused.value.message


def test_a_group_weight_decay_on_an_optimizer_without_one_is_refused(tmp_path):
    path = digits_protocol(tmp_path, [{"match": ["bias"], "weight_decay": 0.0}], {"name": "Rprop", "lr": 0.01})
    with pytest.raises(ProtocolError) as refused:
        load_protocol(path)
    assert "arms.grouped.groups[0].weight_decay: Rprop has no weight decay, so a group cannot set one; remove this " \
           "key" in refused.value.message


def pylm_model():
    return build_model(PyLMConfig(layers=2, width=16, heads=2, context=8), seed=1)


def groups_of(specs) -> list[GroupSpec]:
    return [GroupSpec.model_validate(spec) for spec in specs]


def test_the_rules_select_biases_norms_and_vectors_and_the_rest_keeps_the_matrices():
    model = pylm_model()
    no_decay, rest = assign(groups_of(NO_DECAY), model, "arms.a")
    named = dict(model.named_parameters())
    assert no_decay.names == [n for n, p in named.items() if p.dim() < 2]
    assert rest.names == [n for n, p in named.items() if p.dim() >= 2]
    assert "norm.weight" in no_decay.names and "blocks.0.norm1.bias" in no_decay.names
    assert (no_decay.weight_decay, no_decay.lr_scale, rest.weight_decay, rest.lr_scale) == (0.0, 1.0, None, 1.0)


def test_norm_selects_a_models_own_norm_class_and_bias_the_names_ending_in_bias():
    class RMSNorm(torch.nn.Module):  # not torch's: a model's own, as most language models have
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

    model = torch.nn.ModuleDict({"norm": RMSNorm(), "proj": torch.nn.Linear(4, 4),
                                 "bn": torch.nn.BatchNorm1d(4)})
    (norms, rest) = assign(groups_of([{"match": ["norm"], "weight_decay": 0.0}]), model, "arms.a")
    assert norms.names == ["norm.gain", "bn.weight", "bn.bias"] and rest.names == ["proj.weight", "proj.bias"]
    (biases, rest) = assign(groups_of([{"match": ["bias"], "weight_decay": 0.0}]), model, "arms.a")
    assert biases.names == ["proj.bias", "bn.bias"]


def test_each_parameter_lands_in_the_first_group_that_selects_it():
    model = pylm_model()
    head, vectors, rest = assign(groups_of([{"match": ["head.*", "embed.*"], "lr_scale": 0.5},
                                            {"match": ["ndim<2", "*.mlp_in.weight"], "weight_decay": 0.0}]),
                                 model, "arms.a")
    assert head.names == ["embed.weight", "head.weight"]
    named = dict(model.named_parameters())
    assert vectors.names == [n for n, p in named.items() if p.dim() < 2 or n.endswith("mlp_in.weight")]
    assert rest.names == [n for n in named if n not in head.names + vectors.names]
    # a rest that nothing is left for is no group of the optimizer
    assert [g.names for g in assign(groups_of([{"match": ["*"], "lr_scale": 2.0}]), model, "arms.a")] == [list(named)]


@pytest.mark.parametrize(("specs", "said"), [
    ([{"match": ["*.embed*"], "lr_scale": 0.5}],
     "arms.a.groups[0].match[0]: '*.embed*' matches no parameter of the model (the rules are bias, norm and ndim<2; "
     "a pattern is matched against whole names such as 'embed.weight', 'position.weight', 'blocks.0.norm1.weight', "
     "...); correct it or remove it"),
    ([{"match": ["bias"], "weight_decay": 0.0}, {"match": ["*.bias"], "lr_scale": 2.0}],
     "arms.a.groups[1]: every parameter it selects is taken by an earlier group (the first group that selects a "
     "parameter takes it); remove this group or move it up"),
])
def test_a_pattern_matching_nothing_and_a_group_left_empty_are_refused(specs, said):
    with pytest.raises(BadInput) as refused:
        assign(groups_of(specs), pylm_model(), "arms.a")
    assert refused.value.message == said


def test_the_optimizer_gets_each_groups_settings_and_the_schedule_moves_each_groups_own_rate(tmp_path):
    from opalctl.protocol.schema import Arm

    arm = Arm.model_validate({"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.1},
                              "schedule": {"name": "cosine", "warmup": 0.1, "min_lr": 0.1},
                              "groups": [{"match": ["embed.*"], "lr_scale": 0.25},
                                         {"match": ["ndim<2"], "weight_decay": 0.0}]})
    model = pylm_model()
    optimizer, record = build_optimizer(arm, model, "arms.a")
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.25e-3, 0.1), (1.0e-3, 0.0), (1.0e-3, 0.1)]
    named = [name for name, _ in model.named_parameters()]
    vectors = [name for name, p in model.named_parameters() if p.dim() < 2]
    assert record == [  # what the run's start record says of its groups
        {"parameters": ["embed.weight"], "lr": 0.25e-3, "weight_decay": 0.1},
        {"parameters": vectors, "lr": 1.0e-3, "weight_decay": 0.0},
        {"parameters": [n for n in named if n not in vectors and n != "embed.weight"], "lr": 1.0e-3,
         "weight_decay": 0.1}]
    schedule = BudgetSchedule(optimizer, arm.schedule.model_dump())
    factor = schedule.apply(0.5)
    assert factor == Schedule.of(arm.schedule).factor(0.5)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25e-3 * factor, 1.0e-3 * factor, 1.0e-3 * factor]
    schedule.apply(0.05)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25e-3 * 0.5, 1.0e-3 * 0.5, 1.0e-3 * 0.5]


def test_an_optimizer_whose_protocol_leaves_lr_out_scales_its_own_default():
    from opalctl.protocol.schema import Arm

    arm = Arm.model_validate({"optimizer": {"name": "SGD", "momentum": 0.9},
                              "groups": [{"match": ["head.*"], "lr_scale": 0.5}]})
    optimizer, _ = build_optimizer(arm, pylm_model(), "arms.a")
    assert [g["lr"] for g in optimizer.param_groups] == [optimizer.defaults["lr"] * 0.5, optimizer.defaults["lr"]]


def test_freeze_refuses_a_pattern_that_matches_nothing_and_writes_no_lock(project):
    protocol = project.protocol()
    with pytest.raises(BadInput) as refused:
        project.freeze(arms={"grouped": {**protocol["arms"]["adamw"],
                                         "groups": [{"match": ["embed*"], "lr_scale": 0.5}]}})
    assert refused.value.message.startswith(f"{project.protocol_path}: arms.grouped.groups[0].match[0]: 'embed*' "
                                            f"matches no parameter of the model"), refused.value.message
    assert not list(project.folder.glob("*.lock.json"))
    lock = project.freeze(arms={"grouped": {**protocol["arms"]["adamw"],
                                            "groups": [{"match": ["2.*"], "lr_scale": 0.5}]}})
    assert yaml.safe_load(lock.read_text())["protocol"]["arms"]["grouped"]["groups"][0]["match"] == ["2.*"]


def test_a_control_arm_of_a_grouped_agent_arm_keeps_its_groups():
    """compare's controls work on schedule factors: the fixed arm they name for a grouped agent arm is that arm's
    optimizer and groups (its lr scaled, each group's lr_scale kept), and only an arm with the same groups is it."""
    from opalctl.compare.controls import fixed_arm, same_arm

    groups = [{"match": ["ndim<2"], "weight_decay": 0.0, "lr_scale": 1.0}]
    agent_arm = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.1}, "schedule": "constant",
                 "budget_multiplier": 1.0, "model": {}, "agent": {"backend": "heuristic"}, "groups": groups}
    fixed = fixed_arm(agent_arm, "anneal-end", 0.5)
    assert fixed["groups"] == groups and fixed["optimizer"]["lr"] == 0.5e-3 and fixed["agent"] is None
    in_lock = {**fixed, "optimizer": {**fixed["optimizer"]}}
    assert same_arm(fixed, in_lock)
    assert not same_arm(fixed, {key: value for key, value in in_lock.items() if key != "groups"})
