"""Parameter groups chosen by rule (``arms.NAME.groups``, ``protocol.schema.GroupSpec``): which parameters each
group takes, and the torch parameter groups the arm's optimizer is built with.

A group's ``match`` lists rules and name patterns; a parameter is selected when any of them selects it:

- ``bias``: its qualified name ends in ``bias``;
- ``norm``: it belongs to a normalisation module (torch's LayerNorm, BatchNorm*, InstanceNorm*, GroupNorm, RMSNorm,
  LocalResponseNorm, or a model's own class whose name ends in ``Norm``, as nanoGPT's ``LayerNorm`` and most
  ``RMSNorm`` classes are);
- ``ndim<2``: it has fewer than two dimensions (biases, norm gains, scalars);
- anything else is a pattern matched against the whole qualified name (``fnmatch``, case-sensitive; ``*`` crosses
  dots): ``head.*``, ``*embed*``, ``blocks.0.*``.

Each parameter belongs to exactly one group: the first whose ``match`` selects it (groups are read in the order
written); a parameter no group selects trains with the optimizer's own settings, in a last group. The torch
optimizer's ``param_groups`` are therefore the groups as written, then the rest, which is the order of ``lrs`` in
a run's steps records. A rule or pattern that selects no parameter of the model, and a group every parameter of
which an earlier group took, are refused, so a typo cannot leave a recipe silently unapplied.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.tasks import make_task


def _norm_classes() -> tuple[type, ...]:
    import torch.nn as nn

    names = ("LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm", "CrossMapLRN2d")
    found = tuple(getattr(nn, name) for name in names if hasattr(nn, name))  # RMSNorm: torch 2.4 and later
    return found + (nn.modules.batchnorm._NormBase,)  # every BatchNorm and InstanceNorm


def is_norm(module) -> bool:
    """Whether ``module`` normalises: one of torch's normalisation modules, or a class of the model's own (or one of
    its bases) whose name ends in ``Norm``."""
    return isinstance(module, _norm_classes()) or any(cls.__name__.endswith("Norm") for cls in type(module).__mro__)


def norm_parameter_ids(model) -> set[int]:
    """The ids of the parameters the model's normalisation modules hold themselves."""
    return {id(p) for module in model.modules() if is_norm(module) for p in module.parameters(recurse=False)}


def selects(selector: str, name: str, parameter, norms: set[int]) -> bool:
    """Whether one entry of a group's ``match`` selects the parameter ``name``."""
    if selector == "bias":
        return name.endswith("bias")
    if selector == "norm":
        return id(parameter) in norms
    if selector == "ndim<2":
        return parameter.dim() < 2
    return fnmatch.fnmatchcase(name, selector)


@dataclass
class ParameterGroup:
    """One group as the optimizer gets it: its parameters (the model's order) and what it sets."""

    names: list[str]
    parameters: list[Any]
    weight_decay: float | None = None
    lr_scale: float = 1.0

    def torch_group(self) -> dict[str, Any]:
        group: dict[str, Any] = {"params": self.parameters}
        if self.weight_decay is not None:
            group["weight_decay"] = self.weight_decay
        return group


def assign(groups, model, where: str) -> list[ParameterGroup]:
    """The arm's groups (``GroupSpec`` list) over ``model.named_parameters()``, then the rest (left out when no
    parameter is left). ``where`` opens each refusal: ``PROTOCOL: arms.NAME``."""
    named = list(model.named_parameters())
    norms = norm_parameter_ids(model)
    for index, spec in enumerate(groups):
        for position, selector in enumerate(spec.match):
            if not any(selects(selector, name, p, norms) for name, p in named):
                raise BadInput(f"{where}.groups[{index}].match[{position}]: {_nothing(selector, named)}")
    out = [ParameterGroup([], [], spec.weight_decay, spec.lr_scale) for spec in groups]
    rest = ParameterGroup([], [])
    for name, parameter in named:
        group = next((out[i] for i, spec in enumerate(groups)
                      if any(selects(s, name, parameter, norms) for s in spec.match)), rest)
        group.names.append(name)
        group.parameters.append(parameter)
    for index, group in enumerate(out):
        if not group.parameters:
            raise BadInput(f"{where}.groups[{index}]: every parameter it selects is taken by an earlier group (the "
                           f"first group that selects a parameter takes it); remove this group or move it up")
    return out + ([rest] if rest.parameters else [])


def _nothing(selector: str, named: list) -> str:
    if selector == "norm":
        return "the rule 'norm' selects no parameter: the model has no normalisation module with parameters; remove it"
    if selector in ("bias", "ndim<2"):
        return f"the rule {selector!r} selects no parameter of the model; remove it"
    examples = ", ".join(repr(name) for name, _ in named[:3]) + (", ..." if len(named) > 3 else "")
    return (f"{selector!r} matches no parameter of the model (the rules are bias, norm and ndim<2; a pattern is "
            f"matched against whole names such as {examples}); correct it or remove it")


def build_grouped(cls, arguments: dict[str, Any], groups: list[ParameterGroup]):
    """The torch optimizer ``cls(groups, **arguments)``, each group's learning rate ``lr_scale`` times the
    optimizer's (its ``defaults``: the protocol's ``lr``, or the class's own when the protocol leaves it out)."""
    optimizer = cls([group.torch_group() for group in groups], **arguments)
    for torch_group, group in zip(optimizer.param_groups, groups):
        if group.lr_scale != 1.0:
            torch_group["lr"] = torch_group["lr"] * group.lr_scale
    return optimizer


def group_records(optimizer, groups: list[ParameterGroup]) -> list[dict[str, Any]]:
    """What each group of the built optimizer holds, for the run's start record (``formats.StartRecord.groups``):
    its parameters' names, and the learning rate and weight decay the torch group holds before any schedule."""
    return [{"parameters": list(group.names), "lr": float(torch_group["lr"]),
             "weight_decay": None if torch_group.get("weight_decay") is None else float(torch_group["weight_decay"])}
            for torch_group, group in zip(optimizer.param_groups, groups)]


def check_groups(protocol, protocol_path: Path) -> None:
    """Build each grouped arm's model once (on the CPU, from the first seed's parent) and assign its groups, so a
    pattern that matches nothing is refused at ``freeze``, not in a run."""
    grouped = {name: arm for name, arm in protocol.arms.items() if arm.groups}
    if not grouped:
        return
    task = make_task(protocol.task.entry, protocol.task.config)
    seed = protocol.seeds[0]
    parent = protocol_path.parent / protocol.parent_for(seed)
    for name, arm in grouped.items():
        assign(arm.groups, task.build(parent, arm.model, seed, "cpu").model, f"{protocol_path}: arms.{name}")
