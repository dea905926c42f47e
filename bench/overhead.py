"""What does wrapping cost per update? ``wrap(..., backend="keep")`` against the bare torch optimizer.

One process, one thread, the built-in ``digits`` model (MLP 64-128-10, AdamW, batch 64 from the task's own
sampler; ``--task pylm`` takes the byte-level language model instead, for scale). Each variant keeps its own model and optimizer and trains in blocks of updates; the blocks of the
variants are interleaved, in a rotating order, so that noise from the machine falls on all of them alike. Each
figure is the median over blocks of the time per whole update (batch, forward, backward, step).

Variants: ``bare`` (the torch optimizer), ``ours`` (opalctl.opal.wrap with the keep backend and every default:
8 decisions over the run, the starting programs, analysis every 25 updates, evaluation-integrity recording on),
``ours-no-integrity`` (the same with ``eval_integrity=False``) and, when the package is installed, ``peer``
(opal-optimizer's ``opal.wrap`` with its keep backend), installed only for this comparison.
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
import time
from pathlib import Path

from common import block_arguments, setup


def make_variant(name: str, task, train, parent: Path, total: int, scratch: Path, batch_size: int = 64):
    import torch

    model = task.build(parent, {}, 1).model
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


def trainer_round(wrapped: bool, updates: int, work: Path) -> float:
    """One Trainer run of ``updates``; the median seconds between two consecutive updates' ends after warm-up."""
    import numpy as np
    import torch
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 64, size=(256, 16)))
    rows = [{"input_ids": row, "labels": row} for row in tokens]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    args = transformers.TrainingArguments(output_dir=str(work / "out"), max_steps=updates, per_device_train_batch_size=8,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, seed=0)
    settings = dict(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=rows, callbacks=[Clock()])
    if wrapped:
        from opalctl.integrations.hf import OpalTrainer

        trainer = OpalTrainer(**settings, opal={"backend": "keep", "run_dir": work / f"opal-{time.monotonic_ns()}"})
    else:
        trainer = transformers.Trainer(**settings)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log lines would break --json
    clock = settings["callbacks"][0]
    trainer.train()
    warm = min(10, updates // 4)
    return statistics.median(b - a for a, b in zip(clock.ends[warm:], clock.ends[warm + 1:]))


def trainer_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="overhead of OpalTrainer against the plain transformers.Trainer")
    parser.add_argument("--updates", type=int, default=300, help="updates per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"trainer": [], "opal-trainer": []}
    with tempfile.TemporaryDirectory(prefix="opalctl-overhead-trainer-") as folder:
        trainer_round(True, 20, Path(folder))  # warm-up: imports, first-call costs
        for index in range(args.rounds):
            for wrapped in ((False, True) if index % 2 == 0 else (True, False)):
                times["opal-trainer" if wrapped else "trainer"].append(trainer_round(wrapped, args.updates,
                                                                                     Path(folder)))
    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = statistics.median(w / p for p, w in zip(times["trainer"], times["opal-trainer"]))
    result = {"bench": "overhead", "mode": "trainer", "updates_per_round": args.updates, "rounds": args.rounds,
              "seconds_per_update": median, "ratios": {"opal-trainer/trainer": ratio},
              "targets": {"opal-trainer/trainer": 1.02}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, value in median.items():
        print(f"{name:18s} {1e6 * value:8.1f} us per update")
    print(f"{'opal-trainer/trainer':26s} {ratio:.3f}")


def main() -> None:
    if sys.argv[1:2] == ["trainer"]:
        trainer_main(sys.argv[2:])
        return
    args = block_arguments(__doc__.splitlines()[0])

    import torch

    torch.set_num_threads(1)
    names = ["bare", "ours", "ours-no-integrity"] + (["peer"] if importlib.util.find_spec("opal") else [])
    with tempfile.TemporaryDirectory(prefix="opalctl-overhead-") as folder:
        work = Path(folder)
        os.chdir(work)  # the peer writes its run folder under the current directory
        task, train, parent, batch_size = setup(work, args.task)
        total = args.updates * (args.blocks + 1)
        variants = {name: make_variant(name, task, train, parent, total, work, batch_size) for name in names}
        for name in names:  # warm-up block, not counted
            block(task, variants[name], args.updates, name != "bare")
        times: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.blocks):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                times[name].append(block(task, variants[name], args.updates, name != "bare"))
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
