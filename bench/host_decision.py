"""What does a decision cost through the agent host? The heuristic agent's blocking decisions, timed from outside.

The agent optimizer (``wrap``) runs the heuristic backend in a worker of the agent host (opal/agents/host.py); a
blocking decision is the training loop's wait at a boundary: the question sent, the worker's answer, the programs
it answered loaded. This bench trains the task's parent with AdamW, wrapped with ``backend="heuristic"`` and
``decisions`` blocking decisions at evenly spread fractions, and times each call of ``between_updates`` that asked
a decision (the boundary's whole wait, as a run sees it), and ``close()`` (the host stopped). Only ``wrap``'s public
interface is used, so the same script measures any version of opalctl: run it before and after a change to the
host. Nothing of it is charged to a budget either way (it is waiting).

Reported: the median and the maximum of the decisions' waits, and the close, over ``--runs`` fresh optimizers.
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

from common import TASKS, setup  # noqa: E402


def one_run(task, train, parent: Path, batch: int, decisions: int, updates: int, folder: Path):
    import torch

    from opalctl.opal import wrap

    model = task.build(parent, {}, 1).model
    optimizer = wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model, total_steps=updates,
                     backend="heuristic", decisions=decisions, schedule="uniform", blocking=True,
                     manual_boundaries=True, run_dir=folder)
    sampler = task.sampler(train, 1, batch)
    waits = []
    for _ in range(updates):
        if optimizer.needs_boundary():
            asked = optimizer.figures()["decisions_asked"]
            started = time.perf_counter()
            optimizer.between_updates()
            if optimizer.figures()["decisions_asked"] > asked:  # a boundary that asked (others flush records)
                waits.append(time.perf_counter() - started)
        loss, _ = task.loss(model, sampler.next_batch())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(loss=loss)
    started = time.perf_counter()
    optimizer.close()
    return waits, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="digits")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decisions", type=int, default=8)
    parser.add_argument("--updates", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="opalctl-bench-host-"))
    try:
        task, train, parent, batch = setup(work, options.task)
        waits, closes = [], []
        for number in range(options.runs):
            got, closed = one_run(task, train, parent, batch, options.decisions, options.updates,
                                  work / f"run-{number}")
            waits.extend(got)
            closes.append(closed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"task": options.task, "decisions": len(waits), "median_wait_ms": 1000 * statistics.median(waits),
              "max_wait_ms": 1000 * max(waits), "median_close_ms": 1000 * statistics.median(closes)}
    if options.json:
        print(json.dumps(result))
        return
    print(f"{result['task']}: {result['decisions']} blocking heuristic decisions over {options.runs} runs: median "
          f"{result['median_wait_ms']:.0f} ms, max {result['max_wait_ms']:.0f} ms; close() median "
          f"{result['median_close_ms']:.0f} ms")


if __name__ == "__main__":
    main()
