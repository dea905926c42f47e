"""``opalctl pilot``: a short, never-formal throughput measurement, before anyone commits to a budget.

It reads only what a formal run would treat as public: the training rows and the parent. It never evaluates,
never writes a file, and never touches a run folder, so running it any number of times changes nothing about
the formal runs. The first updates warm up allocators and caches and are not counted. The arm is built by the
formal run's own build step (``build.build_arm``), so what it measures is what the run will spend.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from opalctl.driver.build import build_arm, check_device, choose_arm, peak_memory_bytes
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


def _inputs(path: Path, protocol, lock, seed: int) -> tuple[Path, Path]:
    """The training rows and the parent, checked against the lock when there is one."""
    if lock is None:
        return path.parent / protocol.data["train"], path.parent / protocol.parent_for(seed)
    from opalctl.protocol.verify import require_unchanged

    require_unchanged(lock, roles=["data.train", f"parent.seed-{seed}"])
    return lock.data_path("train"), lock.parent_path(seed)


def _measure(parts, device: str, steps: int, progress) -> tuple[list[float], list[float], list[float]]:
    """CPU and wall seconds and the loss of each update after the warm-up."""
    import torch

    from opalctl.driver.arm import make_update

    update = make_update(parts.task, parts.model, parts.optimizer, parts.clip)
    cpu_times, wall_times, losses = [], [], []
    for index in range(WARMUP + steps):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        batch = parts.sampler.next_batch()
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
    return cpu_times, wall_times, losses


def _figures(path: Path, arm_name: str, seed: int, steps: int, protocol, parts,
             measured: tuple[list[float], list[float], list[float]], projected: float) -> dict[str, Any]:
    """The pilot's record, from its measured updates and the updates the budget is projected to buy."""
    from opalctl import checkpoints

    cpu_times, wall_times, losses = measured
    cpu_per, wall_per = statistics.fmean(cpu_times), statistics.fmean(wall_times)
    budget, model, arm = protocol.budget, parts.model, protocol.arms[arm_name]
    checkpoint_bytes = len(checkpoints.encode(model.state_dict(), kind="resume",
                                              extra={"optimizer": parts.optimizer.state_dict(),
                                                     "sampler": parts.sampler.state_dict()}))
    return {
        "protocol": str(path),
        "arm": arm_name,
        "seed": seed,
        "formal": False,
        "steps": steps,
        "warmup": WARMUP,
        "threads": budget.threads,
        "device": protocol.training.device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "cpu_seconds_per_update": cpu_per,
        "cpu_seconds_per_update_median": statistics.median(cpu_times),
        "wall_seconds_per_update": wall_per,
        "wall_seconds_per_update_median": statistics.median(wall_times),
        "updates_per_cpu_second": 1.0 / cpu_per if cpu_per > 0 else None,
        "budget": {"clock": budget.clock, "amount": budget.amount * arm.budget_multiplier,
                   "fractions": budget.fractions},
        "projected_updates": projected,
        "projected_stage_updates": [projected * f for f in budget.fractions],
        "examples_per_update": protocol.training.batch_size,
        "checkpoint_bytes": checkpoint_bytes,
        "peak_memory_bytes": peak_memory_bytes(),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "notes": [],
    }


def pilot(path: str | Path, arm_name: str, *, steps: int = 24, seed: int | None = None,
          progress=None) -> dict[str, Any]:
    import torch

    from opalctl.driver.budget import clock_spec

    path = Path(path)
    if steps < 1:
        raise BadInput("--steps must be at least 1")
    protocol, lock = _source(path)
    seed = protocol.seeds[0] if seed is None else seed
    arm = choose_arm(protocol, arm_name, seed, str(path), "the protocol's")
    train_path, parent_path = _inputs(path, protocol, lock, seed)
    device = protocol.training.device
    check_device(protocol, advice="use cpu for the pilot", clock_needs_device=False)
    with contextlib.redirect_stdout(sys.stderr):  # what the task prints: stdout carries the pilot's report alone
        parts = build_arm(protocol, arm, seed, parent_path, {"train": train_path})
        parts.schedule.apply(0.0)
        cpu_times, wall_times, losses = _measure(parts, device, steps, progress)

    cpu_per, wall_per = statistics.fmean(cpu_times), statistics.fmean(wall_times)
    clock = clock_spec(protocol.budget.clock)
    projected = clock.projected_updates(protocol.budget.amount * arm.budget_multiplier, cpu_per, wall_per)
    result = _figures(path, arm_name, seed, steps, protocol, parts, (cpu_times, wall_times, losses), projected)
    if device == "cuda":
        result["peak_device_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    if clock.needs_cuda and device != "cuda":
        result["notes"].append(f"a {clock.name} clock projected from wall time: this machine has no CUDA device")
    if arm.agent is not None:
        from opalctl.opal.agents import registry

        result["notes"].append("an agent arm: this measures its starting program (the plain optimizer)")
        agent = arm.agent
        if missing := registry.unready(agent):
            result["notes"].append(f"{missing}; a run of this arm is refused until it is")
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
