"""``illcond``: regression on inputs with a designed condition number, where the slow directions decide the loss.

Why this task: it is the regime where curvature, not noise or generalisation, limits an optimizer. The inputs
are ``z @ diag(s) @ Q.T`` for standard normal ``z``, singular values ``s`` spaced geometrically from 1 down to
``1 / sqrt(condition)`` (so the input covariance has condition number ``condition``) and a fixed random
rotation ``Q`` (so the slow directions are not the coordinate axes, where a per-coordinate method such as Adam
would undo the conditioning for free). Each target is linear in the inputs, with weights that make every
direction contribute the same variance to it: the directions of small variance matter as much as the large
ones, and they are exactly the ones a first-order method fits slowly. The model is a small MLP with one output
per target.

The parent has fitted target 0; an arm fits target 1 from new rows plus a replay share of target-0 rows. Both
share the hidden layer, so fitting the new target moves what the old one uses: ``retention`` (held-out target-0
rows) measures that forgetting, ``selection`` and ``development`` (held-out target-1 rows) the new fit.

A row's ``x`` is its ``dimension`` input values and, last, which target it belongs to (0.0 or 1.0); ``y`` is that
target's value. Metrics: ``mse``, ``r2`` (one minus mse over the split's variance of ``y``: 1 is a perfect fit,
0 is no better than the mean) and ``total`` (rows).

Everything is deterministic: the geometry and the rows come from fixed generators, the model is initialised from
a seeded ``torch.Generator`` (the global RNG is never touched), evaluation draws nothing, each parent trains with
one thread on batches drawn from ``(seed, update)``, each training batch from ``(seed, batch index)``, and the
files are written with fixed timestamps, so ``opalctl init illcond`` gives the same bytes twice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field

from opalctl import checkpoints
from opalctl.errors import BadInput
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import ReplaySampler, model_from_parent, read_arrays, torch_threads, write_arrays

SPLIT_SEED = 20_261_204
TARGETS = 2  # target 0: the parent's; target 1: the arms'
NOISE = 0.01  # the targets' noise, as a share of their standard deviation (an mse floor of about 1e-4 of the variance)
# rows per split (the same for every config: the shapes of the problem do not change the evaluation's size)
ROWS = {"parent": 2048, "retention": 512, "new": 2048, "selection": 1024, "development": 512}
# separate numpy streams, so no two purposes ever share random numbers
STREAM_GEOMETRY = 1
STREAM_ROWS = {"parent": 2, "retention": 3, "new": 4, "selection": 5, "development": 6}
STREAM_PARENT = 11
STREAM_TRAIN = 12


class IllConditionedConfig(TaskConfig):
    dimension: Annotated[int, Field(ge=2, le=1024)] = 32
    condition: Annotated[float, Field(ge=1, le=1e8)] = 1e4
    hidden: Annotated[int, Field(ge=2, le=4096)] = 64
    replay_share: Annotated[float, Field(ge=0, lt=1)] = 0.25
    parent_updates: Annotated[int, Field(ge=1, le=100_000)] = 3000
    parent_lr: Annotated[float, Field(gt=0)] = 3e-3
    parent_batch: Annotated[int, Field(ge=1, le=8192)] = 128


class TwoTargetMLP(nn.Module):
    """Inputs (and, last, the row's target index) in, that target's prediction out: a shared GELU hidden layer
    and one linear output per target."""

    def __init__(self, dimension: int, hidden: int):
        super().__init__()
        self.hidden = nn.Linear(dimension, hidden)
        self.out = nn.Linear(hidden, TARGETS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        which = x[:, -1:].long()
        return self.out(F.gelu(self.hidden(x[:, :-1]))).gather(1, which).squeeze(1)


def _meta_model(config: IllConditionedConfig) -> TwoTargetMLP:
    with torch.device("meta"):  # no storage and no random draws: the global RNG is never advanced
        return TwoTargetMLP(config.dimension, config.hidden)


def build_model(config: IllConditionedConfig, seed: int | None, device: str = "cpu") -> TwoTargetMLP:
    """The model; with a seed, initialised from ``torch.Generator(seed)`` (uniform within 1/sqrt(fan-in))."""
    model = _meta_model(config).to_empty(device="cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for module in (model.hidden, model.out):
                bound = 1.0 / math.sqrt(module.in_features)
                for parameter in (module.weight, module.bias):
                    parameter.copy_((torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound)
    return model.to(device)


def expected_shapes(config: IllConditionedConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in _meta_model(config).state_dict().items()}


def make_rows(config: IllConditionedConfig) -> dict[str, dict[str, np.ndarray]]:
    """Every split's rows: the fixed geometry (scales, rotation, the two targets' weights), then the rows."""
    d = config.dimension
    geometry = np.random.default_rng([SPLIT_SEED, STREAM_GEOMETRY])
    scales = np.geomspace(1.0, 1.0 / math.sqrt(config.condition), d)
    rotation, _ = np.linalg.qr(geometry.standard_normal((d, d)))
    # each direction contributes the same variance to a target: weight 1/scale along it, then unit variance
    weights = rotation @ (geometry.standard_normal((d, TARGETS)) / scales[:, None]) / math.sqrt(d)
    rows, first_id = {}, 0
    for split, count in ROWS.items():
        target = 0 if split in ("parent", "retention") else 1
        rng = np.random.default_rng([SPLIT_SEED, STREAM_ROWS[split]])
        inputs = (rng.standard_normal((count, d)) * scales) @ rotation.T
        clean = inputs @ weights[:, target]
        y = clean + NOISE * rng.standard_normal(count)
        x = np.concatenate([inputs, np.full((count, 1), float(target))], axis=1)
        rows[split] = {"x": x.astype(np.float32), "y": y.astype(np.float32),
                       "ids": np.arange(first_id, first_id + count, dtype=np.int64)}
        first_id += count
    return rows


class IllConditioned(Task):
    name = "illcond"
    Config = IllConditionedConfig
    metrics = {"mse": "lower", "r2": "higher", "total": "count"}
    splits = ("train", "development", "selection", "retention")

    # -- built-in data ---------------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        config = self.config
        folder = Path(folder)
        rows = make_rows(config)
        data_folder = Path("data") / "illcond"
        parent_folder = Path("parents") / "illcond"
        # the arms' training file: the target-1 rows, then every row the parent trained on, flagged replay
        train = {key: np.concatenate([rows["new"][key], rows["parent"][key]]) for key in ("x", "y", "ids")}
        train["replay"] = np.concatenate([np.zeros(ROWS["new"], bool), np.ones(ROWS["parent"], bool)])
        paths = {"train": data_folder / "train.npz"}
        write_arrays(folder / paths["train"], train)
        for split in ("development", "selection", "retention"):
            paths[split] = data_folder / f"{split}.npz"
            write_arrays(folder / paths[split], rows[split])
        for seed in seeds:
            state = self._train_parent(rows["parent"], seed)
            checkpoints.save(folder / parent_folder / f"seed-{seed}.pt", state, kind="parent",
                             meta={"task": "illcond", "seed": int(seed), "target": 0, "dimension": config.dimension,
                                   "condition": config.condition, "updates": config.parent_updates})
        return {"data": {k: str(v) for k, v in paths.items()}, "parents": str(parent_folder / "seed-{seed}.pt")}

    def _train_parent(self, rows: dict[str, np.ndarray], seed: int) -> dict:
        """Adam, then the rate cosine-decayed to a hundredth: the parent should fit its target well, slow
        directions included, so that forgetting it is visible."""
        config = self.config
        with torch_threads(1):
            model = build_model(config, seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=config.parent_lr)
            x, y = torch.from_numpy(rows["x"]), torch.from_numpy(rows["y"])
            size = min(config.parent_batch, len(y))
            for update in range(config.parent_updates):
                progress = update / max(1, config.parent_updates - 1)
                for group in optimizer.param_groups:
                    group["lr"] = config.parent_lr * (0.01 + 0.495 * (1.0 + math.cos(math.pi * progress)))
                rng = np.random.default_rng([int(seed), STREAM_PARENT, update])
                index = torch.from_numpy(rng.choice(len(y), size=size, replace=False))
                loss = F.mse_loss(model(x[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return model.state_dict()

    # -- the interface the driver uses -------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        columns = self.config.dimension + 1
        splits = {}
        for split, path in data_paths.items():
            path = Path(path)
            required = ("x", "y", "ids", "replay") if split == "train" else ("x", "y", "ids")
            arrays = read_arrays(path, required)
            x, y, ids = arrays["x"], arrays["y"], arrays["ids"]
            if (x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != columns or y.dtype != np.float32
                    or y.shape != (len(x),) or ids.shape != (len(x),) or not np.isin(x[:, -1], (0.0, 1.0)).all()):
                raise BadInput(f"data file {path} is not an illcond split of dimension {self.config.dimension} "
                               f"(float32 rows of {columns} values, the last 0 or 1, and one target each); it was "
                               f"prepared for another dimension or task")
            splits[split] = arrays
        return splits

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        return model_from_parent(build_model, self.config, expected_shapes(self.config), parent_path, seed, device)

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        return ReplaySampler(train, seed, batch_size, self.config.replay_share, device,
                             task="illcond", new_rows="target-1 rows", stream=STREAM_TRAIN)

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        return F.mse_loss(model(batch.inputs), batch.targets), {}

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        device = next(model.parameters()).device
        x = torch.from_numpy(rows["x"]).to(device)
        y = rows["y"].astype(np.float64)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                predicted = model(x).double().cpu().numpy()
        finally:
            model.train(was_training)
        total = int(len(y))
        mse = float(np.mean((predicted - y) ** 2)) if total else 0.0
        variance = float(np.var(y)) if total else 0.0
        return {"mse": mse, "r2": 1.0 - mse / variance if variance > 0 else 0.0, "total": total}
