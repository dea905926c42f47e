"""What does the evaluation-integrity recording cost per update? ``IntegrityRecorder.record`` (and the
``maybe_check`` that follows it) against the same update without it.

One process, one thread, the built-in ``digits`` model (``build_mlp(128)``: MLP 64-128-10, the task's parent
checkpoint, AdamW, batch 64 from the task's own sampler; ``--task pylm`` takes the byte-level language model
instead, for scale). Three variants, each with its own model, optimizer and
sampler: ``off`` (batch, forward, backward, step), ``on`` (the same, then ``record(t)`` and ``maybe_check(t)``) and
``pointers`` (``record(t, layouts=False)``: only data pointers compared, what the agent optimizer does while the
released starting program runs).
They train in blocks of updates, interleaved in a rotating order so that noise from the machine falls on both
alike. Figures: the median over blocks of the time per whole update of each variant, their ratio, and the time
spent inside ``record`` + ``maybe_check`` itself (timed around the calls in the ``on`` blocks, less the cost of
reading the clock, measured beside each call) as a share of an ``off`` update: the direct figure, since the
difference of two whole-update medians is within the machine's noise. For scale, a third variant ``one_op`` times
a single trivial torch operation in the same place (zeroing a ring row of the same size): the floor of anything
that touches a tensor once per update. A check (one evaluation's window read and judged) is timed separately: it
runs once per evaluation, not per update. Target: the recording under 1 % of a digits update.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import block_arguments, setup

TARGET = 0.01


class Variant:
    def __init__(self, name: str, task, train, parent: Path, batch_size: int = 64):
        import torch

        from opalctl.opal.integrity import IntegrityRecorder

        self.name = name
        self.task = task
        self.model = task.build(parent, {}, 1).model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.sampler = task.sampler(train, 1, batch_size)
        self.recorder = IntegrityRecorder(dict(self.model.named_parameters())) if name in ("on", "pointers") else None
        self.layouts = name == "on"
        self.scratch = None
        if name == "one_op":
            samples = sum(IntegrityRecorder(dict(self.model.named_parameters()), start=None).sample_counts.values())
            self.scratch = [row for row in torch.zeros(138, samples)]
        self.t = 0
        self.recording: list[float] = []  # seconds inside record + maybe_check, per block

    def block(self, updates: int) -> float:
        task, model, optimizer, sampler, recorder = self.task, self.model, self.optimizer, self.sampler, self.recorder
        scratch = self.scratch
        inside = 0.0
        clock = time.perf_counter
        started = clock()
        for _ in range(updates):
            batch = sampler.next_batch()
            loss, _ = task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            self.t += 1
            if recorder is not None:
                first = clock()
                before = clock()  # first..before: the timer's own cost, measured here and taken off
                recorder.record(self.t, layouts=self.layouts)
                recorder.maybe_check(self.t)
                inside += (clock() - before) - (before - first)
            elif scratch is not None:
                first = clock()
                before = clock()
                scratch[self.t % 138].zero_()
                inside += (clock() - before) - (before - first)
        elapsed = (clock() - started) / updates
        if recorder is not None or scratch is not None:
            self.recording.append(inside / updates)
        return elapsed

    def time_checks(self, count: int = 5) -> float:
        """Seconds per check: an evaluation opened, the window filled, then the timed maybe_check that runs it."""
        recorder = self.recorder
        seconds = []
        for _ in range(count):
            self.block(recorder.window_before)
            recorder.open_check(self.t)
            self.block(recorder.window_after - 1)
            self.t += 1
            recorder.record(self.t)
            started = time.perf_counter()
            findings = recorder.maybe_check(self.t)
            seconds.append(time.perf_counter() - started)
            assert findings is not None
        return statistics.median(seconds)


def main() -> None:
    args = block_arguments(__doc__.splitlines()[0])

    import torch

    torch.set_num_threads(1)
    names = ["off", "on", "pointers", "one_op"]
    with tempfile.TemporaryDirectory(prefix="opalctl-integrity-") as folder:
        task, train, parent, batch_size = setup(Path(folder), args.task)
        variants = {name: Variant(name, task, train, parent, batch_size) for name in names}
        for name in names:  # warm-up block, not counted
            variants[name].block(args.updates)
        for name in ("on", "pointers", "one_op"):
            variants[name].recording.clear()
        times: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.blocks):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                times[name].append(variants[name].block(args.updates))
        check_seconds = variants["on"].time_checks()
        samples = sum(variants["on"].recorder.sample_counts.values())
    median = {name: statistics.median(values) for name, values in times.items()}
    recording = statistics.median(variants["on"].recording)
    share = recording / median["off"]
    pointers = statistics.median(variants["pointers"].recording)
    one_op = statistics.median(variants["one_op"].recording)
    result = {"bench": "integrity_overhead", "task": args.task, "updates_per_block": args.updates, "blocks": args.blocks,
              "samples": samples, "seconds_per_update": median, "ratio_on_off": median["on"] / median["off"],
              "record_seconds_per_update": recording, "record_share_of_update": share,
              "pointers_only_seconds_per_update": pointers, "pointers_only_share_of_update": pointers / median["off"],
              "one_op_seconds_per_update": one_op, "one_op_share_of_update": one_op / median["off"],
              "check_seconds": check_seconds, "target_share": TARGET, "within_target": share < TARGET}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in names:
        print(f"{name:6s} {1e6 * median[name]:8.1f} us per update")
    print(f"on/off {result['ratio_on_off']:.4f}")
    print(f"record+maybe_check {1e6 * recording:6.2f} us per update = {100 * share:.2f} % of an update "
          f"(target under {100 * TARGET:.0f} %), {samples} sampled entries")
    print(f"record(layouts=False)+maybe_check {1e6 * pointers:6.2f} us per update = "
          f"{100 * pointers / median['off']:.2f} % (what the agent optimizer does while the released program runs)")
    print(f"one trivial torch op in the same place {1e6 * one_op:6.2f} us = {100 * one_op / median['off']:.2f} % "
          "(the floor of touching a tensor once per update)")
    print(f"one check (window read and judged) {1e3 * check_seconds:.2f} ms per evaluation")


if __name__ == "__main__":
    main()
