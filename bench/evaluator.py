"""What does judging in a process of its own cost? The evaluator against today's in-process judge.

Both judge the same four stage checkpoints of the task's shipped protocol (its first arm, seed 1; each stage the
parent's weights moved a little, so every stage is a new model): the in-process side with a ``Judge`` built in
this process (``Judge.judge``: load the checkpoint into the judge's model, evaluate every split, decide), the
evaluator side by sending each stage to a real evaluator process (``driver/evaluator.py``) and reading its answer,
which adds the pipe's round trip, the JSON of the records and the stage file the evaluator writes. Blocks of the
two sides alternate, so the host's drift falls on both alike; each block judges the four stages once, and each
evaluator block starts a fresh evaluator (a run's stages 1-4), whose start-up (the interpreter, torch, the lock,
the splits, the judge's model, the anchor record's check) is timed apart: a run pays it once, while its training
process builds the arm.

Reported: the median per-stage seconds of each side, their ratio (evaluator / in-process) and difference, and the
median start-up. ``--task pylm`` for the larger model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import TASKS  # noqa: E402


def prepare(work: Path, name: str):
    """The task's shipped protocol frozen under ``work``, the judge's inputs, and four stage checkpoints."""
    import torch

    from opalctl import checkpoints
    from opalctl.layout import LockRuns
    from opalctl.protocol.freeze import freeze
    from opalctl.protocol.lock import read_lock
    from opalctl.tasks import make_task
    from opalctl.tasks.builtin import init

    init(name, work, seeds=[1])
    lock = read_lock(Path(freeze(work / f"{name}.yaml", force=True)["lock"]))
    protocol = lock.protocol()
    arm_name = next(iter(protocol.arms))
    arm = protocol.arms[arm_name]
    paths = LockRuns.of(work / "runs", lock).run(arm_name, 1)
    paths.training.mkdir(parents=True)
    task = make_task(protocol.task.entry, protocol.task.config)
    torch.set_num_threads(protocol.budget.threads)
    model = task.build(lock.parent_path(1), arm.model, 1).model
    initial = checkpoints.save(paths.initial, model.state_dict(), kind="initial")
    paths.initial_record = {"file": paths.name_of(paths.initial), "sha256": initial["sha256"],
                            "model_sha256": initial["model_sha256"]}
    generator = torch.Generator().manual_seed(0)
    stages = []
    for index in range(len(protocol.budget.fractions)):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
        record = checkpoints.save(paths.stage_checkpoint(index + 1), model.state_dict(), kind="stage",
                                  meta={"stage": index + 1})
        stages.append({"index": index, "name": paths.name_of(paths.stage_checkpoint(index + 1)), **record})
    return lock, protocol, arm_name, arm, paths, task, stages


def facts_of(index: int):
    from opalctl.formats import StageFacts

    return StageFacts(update=index + 1, budget_used=float(index + 1), budget_fraction_used=(index + 1) / 4,
                      examples=0, train_cpu_seconds=0.0, train_wall_seconds=0.0, loss=None)


def in_process_block(lock, protocol, arm, task, splits, anchor_metrics, stages, run_dir: Path) -> list[float]:
    from opalctl.driver.judge import Incumbent, Judge, SavedStage
    from opalctl.files import atomic_write_json

    judge = Judge.build(task, splits, lock.parent_path(1), arm, 1, protocol.training.device, protocol)
    incumbent, seconds = Incumbent(), []
    for stage in stages:
        saved = SavedStage(index=stage["index"], root=run_dir, name=stage["name"], sha256=stage["sha256"],
                           model_sha256=stage["model_sha256"], bytes=stage["bytes"])
        started = time.perf_counter()
        records, incumbent = judge.judge([saved], facts_of(stage["index"]), incumbent, anchor_metrics)
        for record in records:
            atomic_write_json(run_dir / f"stage-{record.stage:02d}.json", record.to_json())
        seconds.append(time.perf_counter() - started)
    return seconds


def evaluator_block(lock, arm_name, paths, stages) -> tuple[float, list[float], dict]:
    from opalctl.driver.evaluator import EvaluatorProcess
    from opalctl.formats import Message, Opening, StageReached, StageSaved, Starting

    started = time.perf_counter()
    evaluator = EvaluatorProcess(Opening(lock=str(lock.path), lock_sha256=lock.sha256, arm=arm_name, seed=1,
                                         run_dir=str(paths.root), anchor_dir=str(paths.anchor.folder),
                                         sys_path=list(sys.path)))
    try:
        evaluator.answer()
        start_up = time.perf_counter() - started
        evaluator.ask(Message.START, Starting(confinement=None, initial=paths.initial_record, inherited=None,
                                              initialised=None, groups=None, host="bench"))
        anchor = json.loads(paths.anchor.record.read_text())
        seconds = []
        for stage in stages:
            started = time.perf_counter()
            evaluator.ask(Message.STAGE, StageReached(saved=[StageSaved.of(stage["index"], stage)],
                                                      facts=facts_of(stage["index"])))
            seconds.append(time.perf_counter() - started)
    finally:
        evaluator.end()
    return start_up, seconds, anchor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="digits")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each side (four stages each)")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opalctl-bench-evaluator-"))
    try:
        lock, protocol, arm_name, arm, paths, task, stages = prepare(work, options.task)
        first_start, _, anchor = evaluator_block(lock, arm_name, paths, stages)  # evaluates the anchor once
        splits = task.load({split: lock.data_path(split) for split in protocol.data if split != "train"})
        starts, child, here = [], [], []
        for _ in range(options.blocks):
            start_up, seconds, _ = evaluator_block(lock, arm_name, paths, stages)
            starts.append(start_up)
            child.extend(seconds)
            here.extend(in_process_block(lock, protocol, arm, task, splits, anchor["metrics"], stages,
                                         paths.root))
        result = {
            "task": options.task, "blocks": options.blocks, "stages": len(child),
            "in_process_stage_s": statistics.median(here), "evaluator_stage_s": statistics.median(child),
            "ratio": statistics.median(child) / statistics.median(here),
            "extra_per_stage_ms": 1000 * (statistics.median(child) - statistics.median(here)),
            "start_up_s": statistics.median(starts), "start_up_range_s": [min(starts), max(starts)],
            "first_start_with_anchor_evaluation_s": first_start,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if options.json:
        print(json.dumps(result))
        return
    print(f"{result['task']}: {result['stages']} stages in {result['blocks']} blocks of each side")
    print(f"  per stage: in-process {1000 * result['in_process_stage_s']:.2f} ms, evaluator "
          f"{1000 * result['evaluator_stage_s']:.2f} ms: ratio {result['ratio']:.3f}, "
          f"{result['extra_per_stage_ms']:+.2f} ms")
    print(f"  evaluator start-up, once per run: {result['start_up_s']:.2f} s (range "
          f"{result['start_up_range_s'][0]:.2f}-{result['start_up_range_s'][1]:.2f} s; the first, which evaluates "
          f"the anchor: {result['first_start_with_anchor_evaluation_s']:.2f} s)")


if __name__ == "__main__":
    main()
