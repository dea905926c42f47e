"""The parts of an arm that trains, built the same way for a formal run and for a pilot.

The checks come first and are written once: the arm and the seed must be the protocol's, and the device and the
clock must be usable on this machine. Then ``build_arm`` builds, in one fixed order (the order matters: the
model's initialisation and the sampler draw from the generators seeded here), the task's model from the parent,
its optimizer, its learning-rate schedule and its sampler. What the pilot measures is therefore what the run will
spend.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.driver.budget import clock_spec, require_cuda
from opalctl.driver.ranks import rank_seed
from opalctl.errors import BadInput
from opalctl.tasks import make_task


def choose_arm(protocol, arm_name: str, seed: int, source: str, owner: str):
    """The protocol's arm ``arm_name``, once ``seed`` is known to be one of its seeds. ``source`` names the file
    in the sentence (``lock runs/x.json``), ``owner`` whose seeds they are (``the lock's``)."""
    if arm_name not in protocol.arms:
        raise BadInput(f"{source} has no arm {arm_name!r}; its arms are {', '.join(protocol.arms)}")
    if seed not in protocol.seeds:
        raise BadInput(f"seed {seed} is not one of {owner} seeds ({', '.join(map(str, protocol.seeds))})")
    return protocol.arms[arm_name]


def check_device(protocol, *, advice: str, clock_needs_device: bool = True) -> None:
    """Refuse a device this machine lacks, and (for a formal run) a clock that needs a device the run lacks."""
    device = protocol.training.device
    if device == "cuda":
        require_cuda("training.device is cuda", advice)
    spec = clock_spec(protocol.budget.clock)
    if clock_needs_device and spec.needs_cuda and device != "cuda":
        raise BadInput(f"budget.clock is {spec.name}, which needs training.device: cuda")


@dataclass
class ArmParts:
    """What trains: the task and its data, the model built from the parent, the optimizer, the schedule, the
    sampler and the gradient clipping the update applies (None when the optimizer clips, as an agent does), and
    for an arm with parameter groups, which parameters each group holds."""

    task: Any
    splits: dict[str, Any]
    built: Any  # the task's Built: model, inherited, initialised
    model: Any
    shapes: dict[str, tuple[int, ...]]
    optimizer: Any
    schedule: Any
    sampler: Any
    clip: float | None
    groups: list[dict] | None = None  # an arm with parameter groups: what each holds (driver/groups.py)


def build_arm(protocol, arm, seed: int, parent_path: Path, data_paths: dict[str, Path], rank: int = 0) -> ArmParts:
    """The arm's parts on ``protocol.training.device``, trained on ``data_paths["train"]``. The formal run and the
    pilot pass only ``train``: the evaluation splits are the evaluator's (driver/evaluator.py); any other split
    named is loaded too. Every rank of a torchrun run builds the same model; ``rank``'s sampler draws its own
    batches (``ranks.rank_seed``: rank 0's are those of a single-process run)."""
    import torch

    from opalctl.driver.arm import BudgetSchedule, build_optimizer

    device = protocol.training.device
    torch.set_num_threads(protocol.budget.threads)
    task = make_task(protocol.task.entry, protocol.task.config)
    splits = task.load(data_paths)
    torch.manual_seed(seed)
    built = task.build(parent_path, arm.model, seed, device)
    model = built.model
    model.train()
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    arm_name = next((name for name, value in protocol.arms.items() if value is arm), "?")  # for a refusal's key
    optimizer, groups = build_optimizer(arm, model, f"arms.{arm_name}")
    schedule = BudgetSchedule(optimizer, arm.schedule if isinstance(arm.schedule, str) else arm.schedule.model_dump())
    sampler = task.sampler(splits["train"], rank_seed(seed, rank), protocol.training.batch_size, device)
    return ArmParts(task=task, splits=splits, built=built, model=model, shapes=shapes, optimizer=optimizer,
                    schedule=schedule, sampler=sampler, clip=protocol.training.gradient_clip, groups=groups)


def peak_memory_bytes() -> int:
    """The process's peak resident memory so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
