"""The Trainer script's model, data and loss as an opalctl task (docs/custom-task.md), for formal runs.

``python gpt2_task.py DIR`` writes DIR/trainer.yaml (an AdamW arm, as the Trainer trains, and the agent arm),
its data files and a parent per seed. The protocol's ``task.entry`` is ``gpt2_task:TinyGPT2``: put this folder
on PYTHONPATH. Metrics: next-token predictions that are right (``correct``) out of ``total``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from tiny_gpt2 import corpus, make_model

from opalctl import checkpoints
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import read_arrays, write_arrays


class RowSampler(Sampler):
    """Seeded random batches of whole rows; the state is the number of batches drawn so far."""

    fresh_ids = True

    def __init__(self, rows: dict[str, np.ndarray], seed: int, batch_size: int):
        self.rows, self.seed, self.batch_size, self.drawn = rows, seed, batch_size, 0

    def next_batch(self) -> Batch:
        import torch

        index = np.random.default_rng([self.seed, self.drawn]).choice(len(self.rows["ids"]), self.batch_size,
                                                                      replace=False)
        self.drawn += 1
        tokens = torch.from_numpy(self.rows["tokens"][index])
        return Batch(ids=self.rows["ids"][index], inputs=tokens, targets=tokens)

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


class TinyGPT2(Task):
    name = "tiny-gpt2"
    Config = TaskConfig
    metrics = {"correct": "higher", "total": "count"}
    splits = ("train", "selection")

    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        return {split: read_arrays(Path(path), ("tokens", "ids")) for split, path in data_paths.items()}

    def build(self, parent_path, arm_config, seed, device="cpu") -> Built:
        model = make_model()
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        payload = checkpoints.load(parent_path, expected_shapes=shapes)
        model.load_state_dict(payload["model"])
        return Built(model=model.to(device), inherited=checkpoints.describe_tensors(payload["model"]))

    def sampler(self, train, seed, batch_size, device="cpu") -> Sampler:
        return RowSampler(train, seed, batch_size)

    def loss(self, model, batch):
        return model(input_ids=batch.inputs, labels=batch.targets).loss, {}

    def evaluate(self, model, rows) -> dict:
        import torch

        tokens = torch.from_numpy(rows["tokens"])
        was_training = model.training
        model.eval()
        with torch.no_grad():
            predicted = model(input_ids=tokens).logits[:, :-1].argmax(dim=-1)
        model.train(was_training)
        return {"correct": int((predicted == tokens[:, 1:]).sum()), "total": int(predicted.numel())}


PROTOCOL = """\
name: trainer
task: {entry: gpt2_task:TinyGPT2}
data: {train: data/train.npz, selection: data/selection.npz}
parents: parents/seed-{seed}.pt
seeds: [1, 2]
budget: {clock: updates, amount: 200}
training: {batch_size: 8, gradient_clip: 1.0}
arms:
  adamw: {optimizer: {name: AdamW, lr: 3.0e-3, weight_decay: 0.0}, schedule: linear}
  agent: {optimizer: {name: AdamW, lr: 3.0e-3, weight_decay: 0.0}, schedule: linear,
          agent: {backend: heuristic, decisions: 4}}
selection:
  denominators: [selection.total]
  improve_any: [selection.correct]
"""


def write_project(folder: Path) -> None:
    """The Trainer script's corpus split in two, and the model it starts from as a parent per seed."""
    import torch

    tokens = corpus(640, seed=0)
    ids = np.arange(len(tokens), dtype=np.int64)
    write_arrays(folder / "data" / "train.npz", {"tokens": tokens[:512], "ids": ids[:512]})
    write_arrays(folder / "data" / "selection.npz", {"tokens": tokens[512:], "ids": ids[512:]})
    for seed in (1, 2):
        torch.manual_seed(seed)
        checkpoints.save(folder / "parents" / f"seed-{seed}.pt", make_model().state_dict(), kind="parent")
    (folder / "trainer.yaml").write_text(PROTOCOL, encoding="utf-8")


if __name__ == "__main__":
    write_project(Path(sys.argv[1] if len(sys.argv) > 1 else "trainer-example"))
