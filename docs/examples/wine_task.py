"""A worked example of a custom opalctl task: wine cultivar classification (scikit-learn's bundled wine data).

Run ``python docs/examples/wine_task.py DIR`` to write DIR/wine.yaml, its data files and one parent per seed,
then ``opalctl freeze DIR/wine.yaml`` and ``opalctl run DIR/wine.lock.json --arm sgd --seed 1``. The protocol's
``task.entry`` is ``wine_task:Wine``, so put this file's folder on PYTHONPATH.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from opalctl import checkpoints
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import read_arrays, write_arrays


class WineConfig(TaskConfig):
    hidden: int = 32


def make_model(hidden: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(13, hidden), nn.Tanh(), nn.Linear(hidden, 3))


class WineSampler(Sampler):
    """Seeded random batches; the state is the number of batches drawn so far."""

    fresh_ids = True  # each batch's ids are a new array, so the run keeps them without a copy

    def __init__(self, rows: dict[str, np.ndarray], seed: int, batch_size: int):
        self.rows, self.seed, self.batch_size, self.drawn = rows, seed, batch_size, 0

    def next_batch(self) -> Batch:
        import torch

        rng = np.random.default_rng([self.seed, self.drawn])
        self.drawn += 1
        index = rng.choice(len(self.rows["y"]), size=self.batch_size, replace=False)
        return Batch(ids=self.rows["ids"][index], inputs=torch.from_numpy(self.rows["x"][index]),
                     targets=torch.from_numpy(self.rows["y"][index]))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


class Wine(Task):
    name = "wine"
    Config = WineConfig
    metrics = {"correct": "higher", "total": "count"}
    splits = ("train", "selection")

    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        return {split: read_arrays(Path(path), ("x", "y", "ids")) for split, path in data_paths.items()}

    def build(self, parent_path, arm_config, seed, device="cpu") -> Built:
        model = make_model(self.config.hidden)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        payload = checkpoints.load(parent_path, expected_shapes=shapes)
        model.load_state_dict(payload["model"])
        return Built(model=model.to(device), inherited=checkpoints.describe_tensors(payload["model"]))

    def sampler(self, train, seed, batch_size, device="cpu") -> Sampler:
        return WineSampler(train, seed, batch_size)

    def loss(self, model, batch):
        import torch.nn.functional as F

        return F.cross_entropy(model(batch.inputs), batch.targets), {}

    def evaluate(self, model, rows) -> dict:
        import torch

        with torch.no_grad():
            predicted = model(torch.from_numpy(rows["x"])).argmax(dim=1)
        return {"correct": int((predicted == torch.from_numpy(rows["y"])).sum()), "total": int(len(rows["y"]))}


PROTOCOL = """\
name: wine
task: {entry: wine_task:Wine, config: {hidden: 32}}
data: {train: data/train.npz, selection: data/selection.npz}
parents: parents/seed-{seed}.pt
seeds: [1, 2]
budget: {clock: updates, amount: 200}
training: {batch_size: 16}
arms:
  sgd:  {optimizer: {name: SGD, lr: 0.05, momentum: 0.9}}
  adam: {optimizer: {name: Adam, lr: 0.003}}
selection:
  denominators: [selection.total]
  improve_any: [selection.correct]
"""


def write_project(folder: Path) -> None:
    """Data files (standardised features, a fixed split) and an untrained parent per seed."""
    import torch
    from sklearn.datasets import load_wine

    bunch = load_wine()
    x = bunch.data.astype(np.float32)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    y = bunch.target.astype(np.int64)
    ids = np.arange(len(y), dtype=np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    held_out, train = order[:48], order[48:]
    write_arrays(folder / "data" / "train.npz", {"x": x[train], "y": y[train], "ids": ids[train]})
    write_arrays(folder / "data" / "selection.npz", {"x": x[held_out], "y": y[held_out], "ids": ids[held_out]})
    for seed in (1, 2):
        torch.manual_seed(seed)
        checkpoints.save(folder / "parents" / f"seed-{seed}.pt", make_model(32).state_dict(), kind="parent")
    (folder / "wine.yaml").write_text(PROTOCOL, encoding="utf-8")


if __name__ == "__main__":
    write_project(Path(sys.argv[1] if len(sys.argv) > 1 else "wine"))
