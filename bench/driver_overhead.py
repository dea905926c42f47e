"""How much does the formal run's bookkeeping cost? ``opalctl run`` against a minimal hand-written loop.

Both do the same training work on the built-in ``digits`` task, built from its shipped protocol (same parent,
sampler, AdamW arguments, clipping, one thread), in this one process. The hand loop does nothing else, and does it
the way the run does: it clips a list of the parameters made once (clipping ``model.parameters()``, a new
generator each update, measured 3 % slower on digits, which would flatter the run). The run does everything a
formal run does: the budget clock, the schedule, one record line per update, row digests, resume checkpoints
every 10 % of the budget (the default), and at four stages a checkpoint, an evaluation of every split and a
promotion decision.

A block is one formal run of 24,000 updates by default: about what the shipped digits protocol's 20 CPU-seconds
buy on this task (``opalctl pilot``), so that the costs a run pays a fixed number of times (stages, checkpoints)
weigh what they weigh in a real run; ``--updates`` changes it.

Side by side, in slices. The host's speed drifts by several percent within a minute on a shared machine, so two
stretches of 20 seconds run one after the other differ by that much whatever they run (single blocks of the old
alternating design spread from 0.91 to 1.10). So the hand loop runs inside the formal run, in slices: the run
calls its progress callback about every 0.25 s, between two updates; there the bench runs the hand loop until it
has done as many updates as the run, and times that. The run's time is its loop's time less the time spent in the
callback. Both therefore sample the host over the same seconds, and the ratio of one block is steady to a few
tenths of a percent. Each side finds the caches holding the other's model after a switch, once per slice (about
270 updates). ``--separate`` runs the old design instead: whole hand loops and whole runs, alternating.

Reported ratios (run updates per second / hand updates per second):
- ``loop``: the run's whole loop, from its first update to its last, stages and checkpoints included;
- ``updates``: only the timed update intervals of the run (what the budget is charged for), which shows that the
  clock itself charges the same work the hand loop does.
Target: loop ratio at least 0.97. ``outside_us`` is the run's own time outside its timed updates, per update
(records, meter, checks, checkpoints, stage evaluations).
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

from common import setup  # noqa: E402

SLICE_UPDATES = 256  # the hand loop catches up once it is this many updates behind (about one progress call)


class HandLoop:
    """The training a formal run of the ``adamw`` arm does, written out by hand: nothing but the updates."""

    def __init__(self, shipped: dict):
        import torch

        task, train, parent, batch_size = shipped["setup"]
        self.task = task
        self.model = task.build(parent, {}, 1).model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **shipped["optimizer"])
        self.sampler = task.sampler(train, 1, batch_size)
        self.parameters = list(self.model.parameters())  # made once, as the run does (see the module docstring)
        self.clip = shipped["gradient_clip"]
        self.updates = 0
        self.seconds = 0.0

    def run(self, count: int) -> float:
        import torch

        task, model, optimizer, sampler = self.task, self.model, self.optimizer, self.sampler
        parameters, clip, clip_grad_norm_ = self.parameters, self.clip, torch.nn.utils.clip_grad_norm_
        started = time.perf_counter()
        for _ in range(count):
            batch = sampler.next_batch()
            loss, _ = task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip_grad_norm_(parameters, clip)
            optimizer.step()
        seconds = time.perf_counter() - started
        self.updates += count
        self.seconds += seconds
        return seconds


def formal_run(lock: Path, runs: Path, progress=None) -> dict:
    from opalctl.driver.run import run

    report = run(lock, "adamw", 1, runs_dir=runs, progress=progress)
    seconds = report["seconds"]
    return {"loop": seconds["this_session_loop_wall"], "updates": seconds["train_wall"], "count": report["updates"],
            "checkpoints": seconds["checkpoint_wall"], "evaluations": seconds["eval_wall"]}


def interleaved_block(shipped: dict, lock: Path, runs: Path) -> tuple[float, int, dict]:
    """One formal run with the hand loop run in slices inside its progress callback; the run's loop seconds are
    given less the callback's."""
    hand = HandLoop(shipped)
    hand.run(100)  # its first updates pay for allocations the run pays before its loop starts
    hand.updates = 0
    hand.seconds = 0.0
    in_callback = 0.0

    def progress(used: float, total: float, **fields) -> None:
        nonlocal in_callback
        started = time.perf_counter()
        behind = int(used) - hand.updates  # the updates clock: budget used is the run's update count
        if behind >= SLICE_UPDATES:
            hand.run(behind)
        in_callback += time.perf_counter() - started

    run = formal_run(lock, runs, progress)
    run["loop"] -= in_callback
    hand.run(run["count"] - hand.updates)  # the last slice, after the run (under 0.25 s of it)
    return hand.seconds, hand.updates, run


def separate_block(shipped: dict, lock: Path, runs: Path, updates: int, hand_first: bool) -> tuple[float, int, dict]:
    """A whole hand loop and a whole formal run, one after the other."""
    hand = HandLoop(shipped)
    hand.run(100)
    if hand_first:
        seconds = hand.run(updates)
        run = formal_run(lock, runs)
    else:
        run = formal_run(lock, runs)
        seconds = hand.run(run["count"])
    return seconds, run["count"], run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=24000, help="updates per block (one formal run)")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--separate", action="store_true",
                        help="alternate whole hand loops and whole runs instead of interleaving them in slices")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    import yaml

    from opalctl.protocol.freeze import freeze

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="opalctl-bench-"))
    try:
        shipped = {"setup": setup(work, "digits")}  # the task, its training rows, the parent, the batch size
        protocol = work / "digits.yaml"
        settings = yaml.safe_load(protocol.read_text())
        shipped["optimizer"] = {k: v for k, v in settings["arms"]["adamw"]["optimizer"].items() if k != "name"}
        shipped["gradient_clip"] = float(settings["training"]["gradient_clip"])
        text = protocol.read_text().replace("clock: cpu, amount: 20", f"clock: updates, amount: {args.updates}")
        protocol.write_text(text)
        lock = Path(freeze(protocol, force=True)["lock"])
        rows = []
        for block in range(args.blocks):
            runs = work / f"runs-{block}"
            if args.separate:
                hand_seconds, hand_updates, run = separate_block(shipped, lock, runs, args.updates, hand_first=block % 2 == 0)
            else:
                hand_seconds, hand_updates, run = interleaved_block(shipped, lock, runs)
            hand_rate = hand_updates / hand_seconds
            rows.append({"block": block, "hand_updates_per_second": hand_rate,
                         "run_loop_updates_per_second": run["count"] / run["loop"],
                         "run_timed_updates_per_second": run["count"] / run["updates"], "updates": run["count"],
                         "checkpoint_share": run["checkpoints"] / run["loop"],
                         "evaluation_share": run["evaluations"] / run["loop"],
                         "loop_ratio": run["count"] / run["loop"] / hand_rate,
                         "updates_ratio": run["count"] / run["updates"] / hand_rate,
                         "outside_us": (run["loop"] - run["updates"]) / run["count"] * 1e6,
                         "update_us": 1e6 / hand_rate})
            print(f"block {block}: hand {hand_rate:,.0f} upd/s, run loop {rows[-1]['run_loop_updates_per_second']:,.0f} "
                  f"upd/s, ratio {rows[-1]['loop_ratio']:.3f}", file=sys.stderr)
        result = {
            "bench": "driver_overhead",
            "task": "digits",
            "design": "separate" if args.separate else "interleaved",
            "updates_per_block": args.updates,
            "blocks": rows,
            **{f"{key}_median": statistics.median(r[key] for r in rows)
               for key in ("loop_ratio", "updates_ratio", "checkpoint_share", "evaluation_share", "outside_us",
                           "update_us")},
            "target": 0.97,
        }
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"driver overhead (digits, {args.updates} updates x {args.blocks} blocks, {result['design']}): "
                  f"run/hand loop ratio {result['loop_ratio_median']:.3f} (target >= 0.97; blocks "
                  f"{min(r['loop_ratio'] for r in rows):.3f}-{max(r['loop_ratio'] for r in rows):.3f}), timed "
                  f"updates only {result['updates_ratio_median']:.3f}; of the run's loop, checkpoints "
                  f"{100 * result['checkpoint_share_median']:.1f} %, evaluations "
                  f"{100 * result['evaluation_share_median']:.1f} %; outside its timed updates the run spends "
                  f"{result['outside_us_median']:.1f} us per update (a hand-loop update takes "
                  f"{result['update_us_median']:.0f} us)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
