"""``opalctl pilot``: a short, never-formal throughput measurement, before anyone commits to a budget.

It reads only what a formal run would treat as public: the training rows and the parent. It never evaluates,
never writes a file, and never touches a run folder, so running it any number of times changes nothing about
the formal runs. The first updates warm up allocators and caches and are not counted.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput

WARMUP = 3


def _source(path: Path):
    """A protocol (``.yaml``) or a lock (``.json``): the protocol and the folder its paths are relative to."""
    from opalctl.protocol.lock import read_lock
    from opalctl.protocol.schema import load_protocol

    if path.suffix == ".json":
        lock = read_lock(path)
        return lock.protocol(), lock
    return load_protocol(path), None


def projected_updates(clock: str, amount: float, cpu_per_update: float, wall_per_update: float) -> float:
    if clock == "updates":
        return float(amount)
    per_update = cpu_per_update if clock == "cpu" else wall_per_update
    return amount / per_update if per_update > 0 else float("inf")


def peak_memory_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def pilot(path: str | Path, arm_name: str, *, steps: int = 24, seed: int | None = None,
          progress=None) -> dict[str, Any]:
    import torch

    from opalctl import checkpoints
    from opalctl.driver.arm import BudgetSchedule, build_optimizer, make_update
    from opalctl.tasks import make_task

    path = Path(path)
    if steps < 1:
        raise BadInput("--steps must be at least 1")
    protocol, lock = _source(path)
    if arm_name not in protocol.arms:
        raise BadInput(f"{path} has no arm {arm_name!r}; its arms are {', '.join(protocol.arms)}")
    seed = protocol.seeds[0] if seed is None else seed
    if seed not in protocol.seeds:
        raise BadInput(f"seed {seed} is not one of the protocol's seeds ({', '.join(map(str, protocol.seeds))})")
    arm = protocol.arms[arm_name]
    if lock is not None:
        from opalctl.protocol.verify import require_unchanged

        require_unchanged(lock, roles=["data.train", f"parent.seed-{seed}"])
        train_path, parent_path = lock.data_path("train"), lock.parent_path(seed)
    else:
        train_path = path.parent / protocol.data["train"]
        parent_path = path.parent / protocol.parent_for(seed)
    device = protocol.training.device
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("training.device is cuda but this machine has no CUDA device; use cpu for the pilot")

    torch.set_num_threads(protocol.budget.threads)
    task = make_task(protocol.task.entry, protocol.task.config)
    train = task.load({"train": train_path})["train"]
    built = task.build(parent_path, arm.model, seed, device)
    model = built.model
    model.train()
    optimizer = build_optimizer(arm, model.parameters())
    schedule = BudgetSchedule(optimizer, arm.schedule)
    schedule.apply(0.0)
    sampler = task.sampler(train, seed, protocol.training.batch_size, device)

    update = make_update(task, model, optimizer, protocol.training.gradient_clip)
    cpu_times, wall_times, losses = [], [], []
    for index in range(WARMUP + steps):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        batch = sampler.next_batch()
        loss = update(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        if index >= WARMUP:
            cpu_times.append(cpu1 - cpu0)
            wall_times.append(wall1 - wall0)
            losses.append(float(loss.detach()))
        if progress is not None:
            progress(index + 1, WARMUP + steps)

    checkpoint_bytes = len(checkpoints.encode(model.state_dict(), kind="resume",
                                              extra={"optimizer": optimizer.state_dict(),
                                                     "sampler": sampler.state_dict()}))
    cpu_per, wall_per = statistics.fmean(cpu_times), statistics.fmean(wall_times)
    budget = protocol.budget
    amount = budget.amount * arm.budget_multiplier
    projected = projected_updates(budget.clock, amount, cpu_per, wall_per)
    parameters = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "protocol": str(path),
        "arm": arm_name,
        "seed": seed,
        "formal": False,
        "steps": steps,
        "warmup": WARMUP,
        "threads": budget.threads,
        "device": device,
        "parameters": parameters,
        "cpu_seconds_per_update": cpu_per,
        "cpu_seconds_per_update_median": statistics.median(cpu_times),
        "wall_seconds_per_update": wall_per,
        "wall_seconds_per_update_median": statistics.median(wall_times),
        "updates_per_cpu_second": 1.0 / cpu_per if cpu_per > 0 else None,
        "budget": {"clock": budget.clock, "amount": amount, "fractions": budget.fractions},
        "projected_updates": projected,
        "projected_stage_updates": [projected * f for f in budget.fractions],
        "examples_per_update": protocol.training.batch_size,
        "checkpoint_bytes": checkpoint_bytes,
        "peak_memory_bytes": peak_memory_bytes(),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "notes": [],
    }
    if device == "cuda":
        result["peak_device_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    if budget.clock == "gpu" and device != "cuda":
        result["notes"].append("a gpu clock projected from wall time: this machine has no CUDA device")
    if arm.agent is not None:
        from opalctl.opal.agents import registry

        result["notes"].append("an agent arm: this measures its starting program (the plain optimizer)")
        agent = arm.agent
        if not registry.waits(agent):
            kind, _ = registry.find(agent.backend)
            result["notes"].append(f"the {kind.name} backend answers in milliseconds and costs nothing, so there "
                                   f"is no waiting or cost to forecast")
        else:
            from opalctl.opal.estimate import estimate

            steps = max(1, int(projected)) if projected != float("inf") else 1
            model, effort = registry.forecast_model(agent)
            result["agent_forecast"] = estimate(steps, wall_per, decisions=agent.decisions, blocking=agent.blocking,
                                                max_lag=agent.max_lag, model=model, effort=effort)
    return result
