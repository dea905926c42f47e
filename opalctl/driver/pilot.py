"""``opalctl pilot``: a short, never-formal throughput measurement, and the wall time it forecasts, before anyone
commits to a budget.

It reads only what a formal run would treat as public: the training rows and the parent. It never evaluates,
never writes a file, and never touches a run folder, so running it any number of times changes nothing about
the formal runs. The arm is built by the formal run's own build step (``build.build_arm``), so what it measures is
what the run will spend.

What it measures, and why so: the first updates warm up allocators, caches and lazy initialisation and are not
counted (``WARMUP`` updates); then at least ``steps`` updates and ``seconds`` of
wall time, each timed as the run's clock times it (batch, forward, loss, backward, clipping, step), with the
garbage collector's objects set aside as the run's loop does. A count of updates alone was the old pilot's: 24
updates of a digits-sized model are 25 ms, which one pause of the machine moves by a fifth. The wall time the run
spends outside its charged updates is measured too, part by part (driver/forecast.py adds them up): a fresh
interpreter importing what a run imports (a run starts two, its own and the evaluator's), the lock's check, the
arm's build, a resume checkpoint's encoding, and a forward pass over as many bytes as the evaluation files hold.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opalctl import checkpoints
from opalctl.driver.budget import clock_spec
from opalctl.driver.build import build_arm, check_device, choose_arm, peak_memory_bytes
from opalctl.driver.forecast import RunForecast
from opalctl.errors import BadInput
from opalctl.opal.agents import registry
from opalctl.opal.estimate import estimate
from opalctl.protocol.lock import read_lock

WARMUP = 10  # updates not counted (digits is steady from about the 10th, pylm from the 3rd: bench/README.md)
MEASURE_SECONDS = 3.0  # wall seconds of counted updates, at the least (``seconds``)
# A run's wall time outside its measured parts, calibrated against real runs by bench/forecast.py (bench/README.md):
PROCESS_STARTS = 2  # interpreters that import torch before a run's first update: the run's and its evaluator's
CLOSE_STARTS = 1.0  # the close (report, the evaluator's and steps helper's ends, exits) in process starts
LOOP_SECONDS_PER_UPDATE = 22e-6  # the loop's own work between two updates (bench/driver_overhead.py)
DURABLE_WRITE_SECONDS = 0.01  # a checkpoint's or record's durable write (fsync), beside its encoding
AGENT_DECISION_SECONDS = 0.05  # one answer of an agent that does not wait (heuristic, keep) through the host


def _source(path: Path):
    """A protocol (``.yaml``) or a lock (``.json``): the protocol and the folder its paths are relative to."""
    from opalctl.protocol.schema import load_protocol

    if path.suffix == ".json":
        lock = read_lock(path)
        return lock.protocol(), lock
    return load_protocol(path), None


def _inputs(path: Path, protocol, lock, seed: int) -> tuple[Path, Path]:
    """The training rows and the parent, checked against the lock when there is one."""
    if lock is None:
        return path.parent / protocol.data["train"], path.parent / protocol.parent_for(seed)
    from opalctl.protocol.recheck import require_unchanged

    require_unchanged(lock, roles=["data.train", f"parent.seed-{seed}"])
    return lock.data_path("train"), lock.parent_path(seed)


class Measured:
    """The pilot's timed updates: CPU and wall seconds and the loss of each update after the warm-up."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.losses: list[float] = []

    @property
    def cpu_per_update(self) -> float:
        return statistics.fmean(self.cpu)

    @property
    def wall_per_update(self) -> float:
        return statistics.fmean(self.wall)


def _measure(parts, device: str, steps: int, seconds: float, progress) -> Measured:
    """Warm up, then time at least ``steps`` updates and ``seconds`` of wall time of them (module docstring)."""
    import torch

    from opalctl.driver.arm import make_update

    update = make_update(parts.task, parts.model, parts.optimizer, parts.clip)
    next_batch = parts.sampler.next_batch

    def one() -> tuple[float, float, Any]:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        loss = update(next_batch())
        if device == "cuda":
            torch.cuda.synchronize()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        return cpu1 - cpu0, wall1 - wall0, loss

    gc.freeze()  # as the run's loop does: a full collection over every live object is no update's cost
    try:
        for _ in range(WARMUP):
            one()
        measured = Measured(WARMUP)
        started = time.perf_counter()
        while len(measured.cpu) < steps or time.perf_counter() - started < seconds:
            cpu, wall, loss = one()
            measured.cpu.append(cpu)
            measured.wall.append(wall)
            measured.losses.append(float(loss.detach()))
            if progress is not None:
                count, elapsed = len(measured.cpu), time.perf_counter() - started
                expected = max(steps, int(count * seconds / elapsed) if elapsed > 0 else count, count)
                progress(count, expected)
    finally:
        gc.unfreeze()
    return measured


_process_start: float | None = None  # measured once per process: a grid's forecast pilots every arm


def process_start_seconds() -> float:
    """Wall seconds a fresh interpreter takes to import what a run imports (torch and the run's modules), as the
    machine is loaded now."""
    global _process_start
    if _process_start is None:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, opalctl.driver.run, opalctl.driver.evaluator"],
                       check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        _process_start = time.perf_counter() - started
    return _process_start


def _timed(action) -> tuple[Any, float]:
    started = time.perf_counter()
    value = action()
    return value, time.perf_counter() - started


def _evaluation_bytes(path: Path, protocol, lock) -> tuple[int, int]:
    """The bytes of the evaluation files and of the training file (sizes only: nothing of them is read)."""
    if lock is not None:
        sizes = {role.removeprefix("data."): record["bytes"] for role, record in lock.records.items()
                 if role.startswith("data.")}
    else:
        sizes = {}
        for role, relative in protocol.data.items():
            with contextlib.suppress(OSError):
                sizes[role] = (path.parent / relative).stat().st_size
    train = sizes.pop("train", 0)
    return sum(sizes.values()), train


def _batch_bytes(batch) -> int:
    """The bytes of a batch's tensors (inputs and targets), what the evaluation splits' bytes are compared with."""
    total = 0
    for value in (batch.inputs, batch.targets):
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        total += sum(int(v.nelement() * v.element_size()) for v in values if hasattr(v, "element_size"))
    return total


def _stage_evaluation_seconds(parts, device: str, evaluation_bytes: int) -> tuple[float, float]:
    """A stage's evaluation, forecast without reading an evaluation split: the forward pass of as
    many training batches as the evaluation files hold bytes, from one batch's time; and that batch's time."""
    import torch

    batch = parts.sampler.next_batch()
    size = max(1, _batch_bytes(batch))
    parts.task.loss(parts.model, batch)  # with gradients, as the task's loss insists: a little dearer than evaluate
    started = time.perf_counter()
    parts.task.loss(parts.model, batch)
    if device == "cuda":
        torch.cuda.synchronize()
    forward = time.perf_counter() - started
    parts.model.zero_grad(set_to_none=True)
    return forward * math.ceil(evaluation_bytes / size), forward


def _resume_checkpoints(fractions: list[float], every: float) -> int:
    """The resume checkpoints a run writes: one at update 0, one at each stage and at each ``every`` of the
    budget (driver/run.py, ``BudgetLoop._boundary``), where they fall together one."""
    points = {round(k * every, 9) for k in range(1, int(1 / every + 1e-9) + 1)}
    points |= {round(f, 9) for f in fractions}
    return 1 + len(points)


def _run_forecast(protocol, arm, figures: dict[str, Any], measured: Measured, timings: dict[str, float],
                  agent_waiting: float) -> RunForecast:
    """One run's wall time from the pilot's figures (driver/forecast.py adds the parts up)."""
    budget = protocol.budget
    updates = figures["projected_updates"]
    stages = len(budget.fractions)
    resume = _resume_checkpoints(list(budget.fractions), protocol.training.checkpoint_every)
    start_each = timings["process_start"]
    checkpoint = timings["checkpoint_encode"] + DURABLE_WRITE_SECONDS
    evaluation = timings["stage_evaluation"] + DURABLE_WRITE_SECONDS
    decisions = arm.agent.decisions if arm.agent is not None else 0
    assumptions = [
        f"training: {updates:,.0f} updates x {measured.wall_per_update:.3g} s of wall time each, as measured "
        f"over {len(measured.wall)} updates after {measured.warmup} of warm-up, with the machine as loaded as now",
        f"start: {PROCESS_STARTS} interpreters importing torch ({start_each:.2g} s each, measured now), "
        + (f"the lock checked twice ({timings['verify']:.2g} s each)" if timings.get("verify") is not None else
           "the lock's check left out (a protocol has none)")
        + f", the arm built ({timings['build']:.2g} s), the anchor evaluated ({timings['stage_evaluation']:.2g} s)",
        f"stages: {stages} x (a checkpoint and an evaluation, {checkpoint + evaluation:.2g} s): the evaluation "
        f"forecast as a forward pass over the evaluation files' {figures['evaluation_bytes']:,} bytes of training "
        f"batches (the pilot never reads an evaluation split)",
        f"checkpoints: {resume} resume checkpoints ({figures['checkpoint_bytes']:,} bytes each, {checkpoint:.2g} s "
        f"with a {DURABLE_WRITE_SECONDS:g} s durable write)",
        f"close: the report and the processes ending, about {CLOSE_STARTS:g} interpreter start",
    ]
    if figures.get("clock_note"):
        assumptions.append(figures["clock_note"])
    if arm.agent is not None:
        assumptions.append(f"agent: {decisions} decisions; the waiting is estimate's typical figure"
                           if agent_waiting else
                           f"agent: {decisions} decisions of about {AGENT_DECISION_SECONDS:g} s each through the "
                           f"agent host, and one more interpreter start for it")
    agent_seconds = agent_waiting if agent_waiting else (
        decisions * AGENT_DECISION_SECONDS + start_each if arm.agent is not None else 0.0)
    return RunForecast(
        updates=updates,
        start=PROCESS_STARTS * start_each + 2 * timings.get("verify", 0.0) + timings["build"] + timings["stage_evaluation"]
        + checkpoint,
        training=updates * measured.wall_per_update if math.isfinite(updates) else math.inf,
        between_updates=updates * LOOP_SECONDS_PER_UPDATE if math.isfinite(updates) else math.inf,
        stages=stages * (checkpoint + evaluation),
        checkpoints=(resume - 1) * checkpoint,
        agent_waiting=agent_seconds,
        close=CLOSE_STARTS * start_each,
        assumptions=tuple(assumptions))


def _figures(path: Path, arm_name: str, seed: int, steps: int, protocol, parts, measured: Measured,
             projected: float, checkpoint_bytes: int) -> dict[str, Any]:
    """The pilot's record, from its measured updates and the updates the budget is projected to buy."""
    budget, model, arm = protocol.budget, parts.model, protocol.arms[arm_name]
    cpu_per, wall_per = measured.cpu_per_update, measured.wall_per_update
    return {
        "protocol": str(path),
        "arm": arm_name,
        "seed": seed,
        "formal": False,
        "steps": len(measured.cpu),
        "warmup": measured.warmup,
        "threads": budget.threads,
        "device": protocol.training.device,
        "parameters": sum(p.numel() for p in model.parameters()),
        "cpu_seconds_per_update": cpu_per,
        "cpu_seconds_per_update_median": statistics.median(measured.cpu),
        "wall_seconds_per_update": wall_per,
        "wall_seconds_per_update_median": statistics.median(measured.wall),
        "updates_per_cpu_second": 1.0 / cpu_per if cpu_per > 0 else None,
        "budget": {"clock": budget.clock, "amount": budget.amount * arm.budget_multiplier,
                   "fractions": budget.fractions},
        "projected_updates": projected,
        "projected_stage_updates": [projected * f for f in budget.fractions],
        "examples_per_update": protocol.training.batch_size,
        "checkpoint_bytes": checkpoint_bytes,
        "peak_memory_bytes": peak_memory_bytes(),
        "loss_first": measured.losses[0],
        "loss_last": measured.losses[-1],
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        "notes": [],
    }


def pilot(path: str | Path, arm_name: str, *, steps: int = 24, seconds: float = MEASURE_SECONDS,
          seed: int | None = None, progress=None) -> dict[str, Any]:
    """Measure ``arm_name`` (at least ``steps`` updates and ``seconds`` of them, after the warm-up) and forecast
    the wall time of its run (``forecast``: driver/forecast.py's ``RunForecast.to_json``)."""
    import torch


    path = Path(path)
    if steps < 1:
        raise BadInput("--steps must be at least 1")
    if not seconds >= 0:
        raise BadInput("--seconds must be a number of seconds, 0 or more")
    protocol, lock = _source(path)
    seed = protocol.seeds[0] if seed is None else seed
    arm = choose_arm(protocol, arm_name, seed, str(path), "the protocol's")
    timings: dict[str, float] = {}
    if lock is not None:
        _, timings["verify"] = _timed(lambda: _verify(lock))
    train_path, parent_path = _inputs(path, protocol, lock, seed)
    device = protocol.training.device
    check_device(protocol, advice="use cpu for the pilot", clock_needs_device=False)
    with contextlib.redirect_stdout(sys.stderr):  # what the task prints: stdout carries the pilot's report alone
        parts, timings["build"] = _timed(lambda: build_arm(protocol, arm, seed, parent_path, {"train": train_path}))
        parts.schedule.apply(0.0)
        measured = _measure(parts, device, steps, seconds, progress)
        evaluation_bytes, _ = _evaluation_bytes(path, protocol, lock)
        timings["stage_evaluation"], _ = _stage_evaluation_seconds(parts, device, evaluation_bytes)
    encoded, timings["checkpoint_encode"] = _timed(lambda: checkpoints.encode(
        parts.model.state_dict(), kind="resume", extra={"optimizer": parts.optimizer.state_dict(),
                                                        "sampler": parts.sampler.state_dict()}))
    timings["process_start"] = process_start_seconds()

    clock = clock_spec(protocol.budget.clock)
    projected = clock.projected_updates(protocol.budget.amount * arm.budget_multiplier, measured.cpu_per_update,
                                        measured.wall_per_update)
    result = _figures(path, arm_name, seed, steps, protocol, parts, measured, projected, len(encoded))
    result["evaluation_bytes"] = evaluation_bytes
    result["timings"] = timings
    if device == "cuda":
        result["peak_device_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    if clock.needs_cuda and device != "cuda":
        result["notes"].append(f"a {clock.name} clock projected from wall time: this machine has no CUDA device")
        result["clock_note"] = result["notes"][-1]
    if lock is None:
        result["notes"].append("measured from a protocol: the lock's check, which a run makes, is not in the start "
                               "forecast; pilot the lock for it")
    agent_waiting = 0.0
    if arm.agent is not None:
        agent_waiting = _agent_notes(arm.agent, projected, measured.wall_per_update, result)
    forecast = _run_forecast(protocol, arm, result, measured, timings, agent_waiting)
    result.pop("clock_note", None)
    result["forecast"] = forecast.to_json()
    return result


def _verify(lock) -> None:
    """The lock's whole check, as a run makes it (and its evaluator again)."""
    from opalctl.protocol.recheck import require_unchanged

    require_unchanged(lock)


def _agent_notes(agent, projected: float, wall_per: float, result: dict[str, Any]) -> float:
    """An agent arm's notes and, for an agent that keeps training waiting, estimate's forecast; returns the
    typical seconds training waits for it (0 for an agent that answers at once)."""
    result["notes"].append("an agent arm: this measures its starting program (the plain optimizer)")
    if missing := registry.unready(agent):
        result["notes"].append(f"{missing}; a run of this arm is refused until it is")
    if not registry.waits(agent):
        kind, _ = registry.find(agent.backend)
        result["notes"].append(f"the {kind.name} backend answers in milliseconds and costs nothing, so there "
                               f"is no waiting or cost to forecast")
        return 0.0

    steps = max(1, int(projected)) if projected != float("inf") else 1
    model, effort = registry.forecast_model(agent)
    result["agent_forecast"] = estimate(steps, wall_per, decisions=agent.decisions, blocking=agent.blocking,
                                        max_lag=agent.max_lag, model=model, effort=effort)
    return float(result["agent_forecast"]["waiting_seconds"]["typical"])
