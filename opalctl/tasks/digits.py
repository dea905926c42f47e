"""``digits``: class-incremental learning on scikit-learn's bundled 8x8 handwritten digits.

The parent is an MLP trained on digits 0-4 only. An arm starts from it and learns 5-9 from new rows plus a
fixed share of replayed 0-4 rows (rows the parent itself trained on). Learning the new classes erodes the old
ones, so the protocol's selection rules have a real tension to arbitrate: ``selection`` holds out new-class rows
(and a few old ones), ``retention`` is exactly 128 held-out rows of 0-4, and ``development`` is what an agent
may look at.

Everything is deterministic: the split is drawn once with a fixed generator, each parent with its seed and one
thread, and the files are written with fixed timestamps, so ``opalctl init digits`` gives the same bytes twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from opalctl import checkpoints
from opalctl.errors import BadInput
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import classification_metrics, read_arrays, torch_threads, write_arrays

SPLIT_SEED = 20_240_607
OLD = (0, 1, 2, 3, 4)
NEW = (5, 6, 7, 8, 9)
RETENTION_ROWS = 128
SELECTION_OLD_PER_CLASS = 10
SELECTION_NEW_PER_CLASS = 50
DEVELOPMENT_OLD_PER_CLASS = 10
DEVELOPMENT_NEW_PER_CLASS = 20


class DigitsConfig(TaskConfig):
    hidden: Annotated[int, Field(ge=4, le=4096)] = 128
    replay_share: Annotated[float, Field(ge=0, lt=1)] = 0.25
    replay_per_class: Annotated[int, Field(ge=1, le=100)] = 40
    parent_updates: Annotated[int, Field(ge=1, le=100_000)] = 600
    parent_lr: Annotated[float, Field(gt=0)] = 1e-3
    parent_batch: Annotated[int, Field(ge=1)] = 64


def build_mlp(hidden: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def split_rows() -> dict[str, dict[str, np.ndarray]]:
    """The fixed partition of the 1,797 digits into the parent's rows, the replay pool and the four files."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    ids = np.arange(len(y), dtype=np.int64)
    rng = np.random.default_rng(SPLIT_SEED)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("parent", "new", "development", "selection", "retention")}
    retention_counts = np.full(len(OLD), RETENTION_ROWS // len(OLD))
    retention_counts[: RETENTION_ROWS % len(OLD)] += 1
    for index, digit in enumerate(OLD):
        rows = rng.permutation(ids[y == digit])
        r, s, d = retention_counts[index], SELECTION_OLD_PER_CLASS, DEVELOPMENT_OLD_PER_CLASS
        parts["retention"].append(rows[:r])
        parts["selection"].append(rows[r:r + s])
        parts["development"].append(rows[r + s:r + s + d])
        parts["parent"].append(rows[r + s + d:])
    for digit in NEW:
        rows = rng.permutation(ids[y == digit])
        s, d = SELECTION_NEW_PER_CLASS, DEVELOPMENT_NEW_PER_CLASS
        parts["selection"].append(rows[:s])
        parts["development"].append(rows[s:s + d])
        parts["new"].append(rows[s + d:])
    chosen = {name: np.sort(np.concatenate(chunks)) for name, chunks in parts.items()}
    return {name: {"x": x[rows], "y": y[rows], "ids": rows} for name, rows in chosen.items()}


class DigitsSampler(Sampler):
    """Batches of ``batch_size - replay`` new rows and ``replay`` old rows, each stream walking seeded epochs.

    The state is two (epoch, position) pairs: each epoch's order is recomputed from (seed, stream, epoch), so
    resuming costs nothing and never depends on what happened before.
    """

    fresh_ids = True  # each batch's ids are a new array (an index into the rows' ids)

    def __init__(self, train: dict[str, Any], seed: int, batch_size: int, replay_share: float, device: str):
        import torch

        self.seed = int(seed)
        self.device = device
        replay = train["replay"].astype(bool)
        self.streams = [np.flatnonzero(~replay), np.flatnonzero(replay)]
        replay_count = int(round(batch_size * replay_share)) if len(self.streams[1]) else 0
        self.counts = [batch_size - replay_count, replay_count]
        if self.counts[0] > 0 and len(self.streams[0]) == 0:
            raise BadInput("the training file (data.train) holds no new-class rows, only replay rows; give a file "
                           "`opalctl init digits` writes, or one with rows whose replay flag is 0")
        self.x = torch.from_numpy(train["x"]).to(device)
        self.y = torch.from_numpy(train["y"]).to(device)
        self.ids = train["ids"]
        self.state = [{"epoch": 0, "position": 0}, {"epoch": 0, "position": 0}]
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, stream: int, epoch: int) -> np.ndarray:
        key = (stream, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != stream}
            rng = np.random.default_rng([self.seed, stream, epoch])
            self._orders[key] = self.streams[stream][rng.permutation(len(self.streams[stream]))]
        return self._orders[key]

    def _take(self, stream: int, count: int) -> np.ndarray:
        taken = []
        state = self.state[stream]
        while count > 0:
            order = self._order(stream, state["epoch"])
            chunk = order[state["position"]:state["position"] + count]
            taken.append(chunk)
            count -= len(chunk)
            state["position"] += len(chunk)
            if state["position"] >= len(order):
                state["epoch"] += 1
                state["position"] = 0
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)

    def next_batch(self) -> Batch:
        import torch

        rows = np.concatenate([self._take(0, self.counts[0]), self._take(1, self.counts[1])])
        index = torch.from_numpy(rows).to(self.device)
        return Batch(ids=self.ids[rows], inputs=self.x.index_select(0, index), targets=self.y.index_select(0, index))

    def state_dict(self) -> dict:
        return {"streams": [dict(s) for s in self.state]}

    def load_state_dict(self, state: dict) -> None:
        self.state = [{"epoch": int(s["epoch"]), "position": int(s["position"])} for s in state["streams"]]


class Digits(Task):
    name = "digits"
    Config = DigitsConfig
    metrics = {"correct": "higher", "total": "count", "loss": "lower"}
    splits = ("train", "development", "selection", "retention")

    # -- built-in data ---------------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        rows = split_rows()
        data_folder = Path("data") / "digits"
        parent_folder = Path("parents") / "digits"
        train = {
            "x": np.concatenate([rows["new"]["x"], rows["parent"]["x"]]),
            "y": np.concatenate([rows["new"]["y"], rows["parent"]["y"]]),
            "ids": np.concatenate([rows["new"]["ids"], rows["parent"]["ids"]]),
        }
        replay_pool = self._replay_pool(rows["parent"])
        keep = np.concatenate([np.ones(len(rows["new"]["ids"]), bool), np.isin(rows["parent"]["ids"], replay_pool)])
        train = {k: v[keep] for k, v in train.items()}
        train["replay"] = np.isin(train["ids"], replay_pool)
        paths = {"train": data_folder / "train.npz"}
        write_arrays(folder / paths["train"], train)
        for split in ("development", "selection", "retention"):
            paths[split] = data_folder / f"{split}.npz"
            write_arrays(folder / paths[split], rows[split])
        for seed in seeds:
            state = self._train_parent(rows["parent"], seed)
            checkpoints.save(folder / parent_folder / f"seed-{seed}.pt", state, kind="parent",
                             meta={"task": "digits", "seed": int(seed), "classes": list(OLD),
                                   "updates": self.config.parent_updates})
        return {"data": {k: str(v) for k, v in paths.items()}, "parents": str(parent_folder / "seed-{seed}.pt")}

    def _replay_pool(self, parent_rows: dict[str, np.ndarray]) -> np.ndarray:
        rng = np.random.default_rng(SPLIT_SEED + 1)
        pool = []
        for digit in OLD:
            candidates = parent_rows["ids"][parent_rows["y"] == digit]
            pool.append(rng.choice(candidates, size=min(self.config.replay_per_class, len(candidates)), replace=False))
        return np.sort(np.concatenate(pool))

    def _train_parent(self, rows: dict[str, np.ndarray], seed: int) -> dict:
        import torch
        import torch.nn.functional as F

        with torch_threads(1):
            generator = torch.Generator().manual_seed(int(seed))
            model = build_mlp(self.config.hidden)
            with torch.no_grad():
                for parameter in model.parameters():  # a seeded init that does not touch the global RNG
                    bound = 1.0 / max(1, parameter.shape[-1]) ** 0.5 if parameter.dim() > 1 else 0.05
                    parameter.copy_((torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound)
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.config.parent_lr)
            x, y = torch.from_numpy(rows["x"]), torch.from_numpy(rows["y"])
            order_rng = np.random.default_rng([int(seed), 7])
            for _ in range(self.config.parent_updates):
                index = torch.from_numpy(order_rng.choice(len(y), size=self.config.parent_batch, replace=False))
                loss = F.cross_entropy(model(x[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return model.state_dict()

    # -- the interface the driver uses -------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        splits = {}
        for split, path in data_paths.items():
            required = ("x", "y", "ids", "replay") if split == "train" else ("x", "y", "ids")
            splits[split] = read_arrays(Path(path), required)
        return splits

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        import torch

        model = build_mlp(self.config.hidden)
        if parent_path is None:
            torch.manual_seed(seed)
            model = build_mlp(self.config.hidden)
            return Built(model=model.to(device), initialised=checkpoints.describe_tensors(model.state_dict()))
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        payload = checkpoints.load(parent_path, expected_shapes=shapes)
        model.load_state_dict(payload["model"])
        return Built(model=model.to(device), inherited=checkpoints.describe_tensors(payload["model"]))

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        return DigitsSampler(train, seed, batch_size, self.config.replay_share, device)

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        import torch.nn.functional as F

        return F.cross_entropy(model(batch.inputs), batch.targets), {}

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        return classification_metrics(model, rows)
