"""What does wrapping cost per update? ``wrap(..., backend="keep")`` against the bare torch optimizer.

One process, one thread, the built-in ``digits`` model (MLP 64-128-10, AdamW, batch 64 from the task's own
sampler; ``--task pylm`` takes the byte-level language model instead, for scale). Each variant keeps its own model and optimizer and trains in blocks of updates; the blocks of the
variants are interleaved, in a rotating order, so that noise from the machine falls on all of them alike. Each
figure is the median over blocks of the time per whole update (batch, forward, backward, step).

Variants: ``bare`` (the torch optimizer), ``ours`` (opalctl.opal.wrap with the keep backend and every default:
8 decisions over the run, the starting programs, analysis every 25 updates, evaluation-integrity recording on),
``ours-no-integrity`` (the same with ``eval_integrity=False``) and, when the package is installed, ``peer``
(opal-optimizer's ``opal.wrap`` with its keep backend), installed only for this comparison; ``bare-again``, a
second bare variant with its own model, gives the noise floor (two identical variants differ by the host and by
where their tensors lie, a few per cent on pylm). ``--shared-model`` has every variant train one model, each
with its own optimizer, taking turns: what then differs between two variants is their optimizer and its wrapper
alone, which is what wrapping changes (the weights are no run's, and the timing does not depend on them).
Targets: ours/bare at most 1.02; ours below the peer; integrity recording (ours / ours-no-integrity) under 1 %.

``python bench/overhead.py trainer [--updates N] [--rounds R] [--json]`` is the Trainer mode: the plain
``transformers.Trainer`` against ``opalctl.integrations.hf.OpalTrainer`` (keep backend, every default) on a tiny
GPT-2 (2 layers, width 32, vocabulary 64, batch 8 of 16 tokens). Each round trains both from the same start, in
alternating order; a round's figure is the median time between two consecutive updates' ends (a callback reads
the clock there, after a few warm-up updates), and the ratio is the median over rounds. Target: at most 1.02.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import block_arguments, setup


def make_variant(name: str, task, train, parent: Path, total: int, scratch: Path, batch_size: int = 64,
                 model=None):
    """A variant's model (its own, or ``model`` when the variants share one), optimizer and sampler."""
    import torch

    model = model if model is not None else task.build(parent, {}, 1).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sampler = task.sampler(train, 1, batch_size)
    if name in ("ours", "ours-no-integrity"):
        from opalctl.opal import wrap

        optimizer = wrap(optimizer, model, backend="keep", total_steps=total, decisions=8,
                         run_dir=scratch / name, eval_integrity=name == "ours")
    elif name == "peer":
        import opal

        optimizer = opal.wrap(optimizer, model, total_steps=total, goal="benchmark", backend="keep", decisions=8)
    return model, optimizer, sampler


def block(task, variant, updates: int, pass_loss: bool) -> float:
    model, optimizer, sampler = variant
    started = time.perf_counter()
    for _ in range(updates):
        batch = sampler.next_batch()
        loss, _ = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if pass_loss:
            optimizer.step(loss=loss)
        else:
            optimizer.step()
    return (time.perf_counter() - started) / updates


class Baton:
    """Two Trainers in two threads taking turns: whoever holds the baton trains ``block`` updates, then hands it
    over, so that the host's slow and fast spells fall on both alike (only one of them ever runs)."""

    def __init__(self, block: int):
        self.block = block
        self.turn = 0
        self.done = [False, False]
        self.condition = threading.Condition()

    def wait(self, side: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == side or self.done[1 - side])

    def pass_on(self, side: int, finished: bool = False) -> None:
        with self.condition:
            self.done[side] = self.done[side] or finished
            self.turn = 1 - side
            self.condition.notify_all()


def tiny_trainer(wrapped: bool, updates: int, work: Path, callbacks: list):
    """The plain ``transformers.Trainer`` or ``OpalTrainer`` (keep backend, every default) on a tiny GPT-2."""
    import numpy as np
    import torch
    import transformers

    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 64, size=(256, 16)))
    rows = [{"input_ids": row, "labels": row} for row in tokens]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    args = transformers.TrainingArguments(output_dir=str(work / f"out-{int(wrapped)}"), max_steps=updates,
                                          per_device_train_batch_size=8, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
    settings = dict(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=rows, callbacks=callbacks)
    if wrapped:
        from opalctl.integrations.hf import OpalTrainer

        trainer = OpalTrainer(**settings, opal={"backend": "keep", "run_dir": work / f"opal-{time.monotonic_ns()}"})
    else:
        trainer = transformers.Trainer(**settings)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log lines would break --json
    return trainer


def trainer_pair(sides: tuple[bool, bool], updates: int, block: int, work: Path) -> list[float]:
    """Two Trainers of ``updates`` each (``sides``: whether each is wrapped), built in that order and taking turns
    every ``block`` updates; the ratio of the second's median update time to the first's in each pair of blocks
    (an update: from the Trainer's step begin to its step end), the first pair left out as warm-up."""
    import transformers

    baton = Baton(block)
    times: dict[int, list[float]] = {0: [], 1: []}

    class Turns(transformers.TrainerCallback):
        def __init__(self, side: int):
            self.side, self.started, self.block = side, 0.0, []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.block:
                baton.wait(self.side)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.block.append(time.perf_counter() - self.started)
            if len(self.block) == baton.block:
                times[self.side].append(statistics.median(self.block))
                self.block = []
                baton.pass_on(self.side)

        def on_train_end(self, args, state, control, **kwargs):
            baton.pass_on(self.side, finished=True)

    trainers = [tiny_trainer(wrapped, updates, work, [Turns(side)]) for side, wrapped in enumerate(sides)]
    # both train in threads, so neither has the main thread's signal checks (the keep backend's starting program
    # has no step time limit, the one thing the agent optimizer does only in the main thread)
    workers = [threading.Thread(target=trainer.train, name=f"trainer-{side}") for side, trainer in enumerate(trainers)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return [second / first for first, second in zip(times[0], times[1])][1:]


def trainer_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="overhead of OpalTrainer against the plain transformers.Trainer")
    parser.add_argument("--pairs", type=int, default=6, help="fresh pairs of Trainers, built in alternating order")
    parser.add_argument("--updates", type=int, default=1000, help="updates per Trainer")
    parser.add_argument("--block", type=int, default=50, help="updates each Trainer trains before the other's turn")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {"opal-trainer/trainer": [], "trainer/trainer": []}
    with tempfile.TemporaryDirectory(prefix="opalctl-overhead-trainer-") as folder:
        trainer_pair((False, True), 2 * args.block, args.block, Path(folder))  # warm-up: imports, first calls
        for index in range(args.pairs):
            wrapped_first = index % 2 == 1
            blocks = trainer_pair((wrapped_first, not wrapped_first), args.updates, args.block, Path(folder))
            ratios["opal-trainer/trainer"].append(statistics.median(
                [1 / ratio for ratio in blocks] if wrapped_first else blocks))
            # the same with two plain Trainers: how far two identical ones differ here (the noise floor)
            ratios["trainer/trainer"].append(statistics.median(
                trainer_pair((False, False), args.updates, args.block, Path(folder))))
    result = {"bench": "overhead", "mode": "trainer", "pairs": args.pairs, "updates": args.updates,
              "block": args.block, "ratios": {name: statistics.median(values) for name, values in ratios.items()},
              "per_pair": ratios, "targets": {"opal-trainer/trainer": 1.02}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, values in ratios.items():
        print(f"{name:22s} {statistics.median(values):.3f}   pairs: {' '.join(f'{v:.3f}' for v in values)}")


def main() -> None:
    if sys.argv[1:2] == ["trainer"]:
        trainer_main(sys.argv[2:])
        return
    args = block_arguments(__doc__.splitlines()[0], shared_model=True)

    import torch

    torch.set_num_threads(1)
    # bare-again is a second bare variant with its own model: how far two identical variants differ here, the
    # noise floor the other ratios are read against
    names = ["bare", "ours", "ours-no-integrity", "bare-again"] + (["peer"] if importlib.util.find_spec("opal")
                                                                   else [])
    with tempfile.TemporaryDirectory(prefix="opalctl-overhead-") as folder:
        work = Path(folder)
        os.chdir(work)  # the peer writes its run folder under the current directory
        task, train, parent, batch_size = setup(work, args.task)
        total = args.updates * (args.blocks + 1)
        shared = task.build(parent, {}, 1).model if args.shared_model else None
        variants = {name: make_variant(name, task, train, parent, total, work, batch_size, shared) for name in names}
        for name in names:  # warm-up block, not counted
            block(task, variants[name], args.updates, not name.startswith("bare"))
        times: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.blocks):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                times[name].append(block(task, variants[name], args.updates, not name.startswith("bare")))
        for name in names:
            close = getattr(variants[name][1], "close", None)
            if callable(close):
                close()
    median = {name: statistics.median(values) for name, values in times.items()}
    ratios = {f"{name}/bare": median[name] / median["bare"] for name in names if name != "bare"}
    ratios["integrity on/off"] = median["ours"] / median["ours-no-integrity"]
    if "peer" in median:
        ratios["ours/peer"] = median["ours"] / median["peer"]
    result = {"bench": "overhead", "task": args.task, "updates_per_block": args.updates, "blocks": args.blocks,
              "shared_model": args.shared_model,
              "seconds_per_update": median, "ratios": ratios, "targets": {"ours/bare": 1.02, "ours/peer": 1.0, "integrity on/off": 1.01},
              "peer_installed": "peer" in median}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name in names:
        print(f"{name:18s} {1e6 * median[name]:8.1f} us per update")
    for key, value in ratios.items():
        print(f"{key:26s} {value:.3f}")
    if "peer" not in median:
        print("peer: opal-optimizer is not installed (pip install opal-optimizer to compare)", file=sys.stderr)


if __name__ == "__main__":
    main()
