"""``shapes``: a small convolutional net classifying procedurally drawn shapes, from a parent that knows half of them.

Why this task: it is the regime of a convolutional net with normalisation layers, where the optimizer trains
filters and a head on noisy images. Each image is one grayscale shape drawn at a random position, size and
rotation, filled plainly or with stripes, on a background with a gradient, per-pixel noise and sometimes a small
distracting dot. The parent has learnt the four ``OLD`` shapes (disc, square, triangle, plus); an arm learns the
four ``NEW`` ones (ring, frame, star, half-disc) from new rows plus a replay share of old rows the parent trained
on. Two of the new shapes are hollow versions of old ones (ring and disc, frame and square), so learning them
moves exactly the filters the old ones rely on: ``retention`` (held-out old-shape images) measures that
forgetting, ``selection`` (mostly new shapes, some old) what was learnt, and ``development`` is what an agent may
look at. Like ``digits``, the head has all eight outputs from the start.

Everything is made from fixed seeds with operations that give the same bits on every machine: each image comes
from its own ``numpy`` generator (seeded with the task's seed and the image's id), and is drawn with additions,
multiplications, divisions, square roots and comparisons only (IEEE 754 rounds each exactly, unlike ``sin`` or
``exp``, whose last bit varies between libraries): rotations are random unit vectors, the polygons' corners are
written with square roots (``cos 36 = (1 + sqrt 5) / 4``). Each pixel is the share of a 4x4 grid of points inside
the shape (a count), the image is rounded to 256 levels, and stored as ``float32`` levels over 255. The model is
built on the meta device and initialised from a seeded ``torch.Generator`` (the global RNG is never touched), has
no dropout and group norm only (evaluation needs no RNG and no batch statistics), each parent trains with one
thread on batches drawn from ``(seed, update)``, each training batch is drawn from ``(seed, batch index)``, and
the files are written with fixed timestamps, so ``opalctl init shapes`` gives the same bytes twice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from opalctl import checkpoints
from opalctl.errors import BadInput
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import (
    ReplaySampler,
    classification_metrics,
    model_from_parent,
    read_arrays,
    torch_threads,
    write_arrays,
)

SPLIT_SEED = 20_261_205
SIZE = 16  # pixels a side
SUPERSAMPLE = 4  # a pixel's value is the share of SUPERSAMPLE x SUPERSAMPLE points inside the shape
SHAPES = ("disc", "square", "triangle", "plus", "ring", "frame", "star", "half-disc")
OLD = (0, 1, 2, 3)  # the parent's classes
NEW = (4, 5, 6, 7)  # the arms'
# images per class in each split (the same for every config: the evaluation's size does not change)
PER_CLASS = {"parent": {c: 1500 for c in OLD}, "retention": {c: 64 for c in OLD},
             "new": {c: 1500 for c in NEW},
             "selection": {**{c: 200 for c in NEW}, **{c: 50 for c in OLD}},
             "development": {**{c: 50 for c in NEW}, **{c: 25 for c in OLD}}}
# separate numpy streams, so no two purposes ever share random numbers
STREAM_REPLAY = 10
STREAM_PARENT = 11
STREAM_TRAIN = 12


class ShapesConfig(TaskConfig):
    channels: Annotated[int, Field(ge=4, le=256)] = 24
    groups: Annotated[int, Field(ge=1, le=64)] = 4
    replay_share: Annotated[float, Field(ge=0, lt=1)] = 0.25
    replay_per_class: Annotated[int, Field(ge=1, le=1500)] = 150
    parent_updates: Annotated[int, Field(ge=1, le=100_000)] = 2000
    parent_lr: Annotated[float, Field(gt=0)] = 3e-3
    parent_batch: Annotated[int, Field(ge=1, le=8192)] = 64

    @model_validator(mode="after")
    def _consistent(self) -> ShapesConfig:
        if self.channels % self.groups:
            raise ValueError(f"channels {self.channels} must be a multiple of groups {self.groups}")
        return self


# -- the model ---------------------------------------------------------------------------------------------------
class ShapesNet(nn.Module):
    """Three 3x3 convolutions (16x16, then 8x8 and 4x4 after two strides of 2), each followed by group norm and a
    ReLU, a global average and a linear head over all eight shapes."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        wide = 2 * channels
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, wide, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(groups, wide)
        self.conv3 = nn.Conv2d(wide, wide, 3, stride=2, padding=1)
        self.norm3 = nn.GroupNorm(groups, wide)
        self.head = nn.Linear(wide, len(SHAPES))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(images)))
        x = F.relu(self.norm2(self.conv2(x)))
        x = F.relu(self.norm3(self.conv3(x)))
        return self.head(x.mean(dim=(2, 3)))


def _meta_model(config: ShapesConfig) -> ShapesNet:
    with torch.device("meta"):  # no storage and no random draws: the global RNG is never advanced
        return ShapesNet(config.channels, config.groups)


def build_model(config: ShapesConfig, seed: int | None, device: str = "cpu") -> ShapesNet:
    """The model; with a seed, initialised from ``torch.Generator(seed)`` as torch initialises these modules by
    default (convolutions and the head uniform within 1/sqrt(fan-in), norms 1 and 0)."""
    model = _meta_model(config).to_empty(device="cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                module_name, _, kind = name.rpartition(".")
                if module_name.startswith("norm"):
                    parameter.fill_(1.0 if kind == "weight" else 0.0)
                else:
                    weight = getattr(model, module_name).weight
                    bound = 1.0 / math.sqrt(weight[0].numel())  # fan-in: inputs x kernel area
                    parameter.copy_((torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound)
    return model.to(device)


def expected_shapes(config: ShapesConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in _meta_model(config).state_dict().items()}


# -- the drawing ---------------------------------------------------------------------------------------------------
SQRT3, SQRT5 = math.sqrt(3.0), math.sqrt(5.0)
COS36, SIN36 = (1.0 + SQRT5) / 4.0, math.sqrt(10.0 - 2.0 * SQRT5) / 4.0
COS72, SIN72 = (SQRT5 - 1.0) / 4.0, math.sqrt(10.0 + 2.0 * SQRT5) / 4.0
TRIANGLE = ((0.0, 1.0), (-SQRT3 / 2.0, -0.5), (SQRT3 / 2.0, -0.5))
# the star's ten corners from the top, anticlockwise: outer (radius 1) and inner (radius 0.42) in turn; the
# angles are multiples of 36 degrees from the vertical, so their sines and cosines are the square-root forms above
_STAR_DIRECTIONS = ((0.0, 1.0), (-SIN36, COS36), (-SIN72, COS72), (-SIN72, -COS72), (-SIN36, -COS36),
                    (0.0, -1.0), (SIN36, -COS36), (SIN72, -COS72), (SIN72, COS72), (SIN36, COS36))
STAR = tuple((x * (1.0 if i % 2 == 0 else 0.42), y * (1.0 if i % 2 == 0 else 0.42))
             for i, (x, y) in enumerate(_STAR_DIRECTIONS))
# the centres of a pixel's sample points, in pixels
_SAMPLES = (np.arange(SIZE * SUPERSAMPLE, dtype=np.float64) + 0.5) / SUPERSAMPLE


def _inside_polygon(px: np.ndarray, py: np.ndarray, corners: tuple[tuple[float, float], ...]) -> np.ndarray:
    """Even-odd rule: a point is inside when a ray to its right crosses the outline an odd number of times."""
    inside = np.zeros(px.shape, dtype=bool)
    for (xi, yi), (xj, yj) in zip(corners, corners[1:] + corners[:1], strict=True):
        if yi == yj:
            continue  # a horizontal edge is never crossed by a horizontal ray
        crosses = (yi > py) != (yj > py)
        at = (xj - xi) * (py - yi) / (yj - yi) + xi
        inside ^= crosses & (px < at)
    return inside


def _inside(shape: int, px: np.ndarray, py: np.ndarray) -> np.ndarray:
    """Whether each point (in the shape's own frame: centred, unrotated, radius 1) is inside ``shape``."""
    square = px * px + py * py
    ax, ay = np.abs(px), np.abs(py)
    name = SHAPES[shape]
    if name == "disc":
        return square <= 0.85
    if name == "square":
        return (ax <= 0.8) & (ay <= 0.8)
    if name == "triangle":
        return _inside_polygon(px, py, TRIANGLE)
    if name == "plus":
        return ((ax <= 0.3) & (ay <= 1.0)) | ((ay <= 0.3) & (ax <= 1.0))
    if name == "ring":
        return (square <= 1.0) & (square >= 0.36)
    if name == "frame":
        return (ax <= 0.85) & (ay <= 0.85) & ((ax >= 0.45) | (ay >= 0.45))
    if name == "star":
        return _inside_polygon(px, py, STAR)
    if name == "half-disc":
        shifted = py + 0.4  # its centroid near the centre
        return (px * px + shifted * shifted <= 1.0) & (shifted >= 0.0)
    raise AssertionError(shape)


def _unit_vector(rng: np.random.Generator) -> tuple[float, float]:
    """A direction uniform on the circle, from a point uniform in the unit disc (no sine or cosine)."""
    while True:
        x, y = rng.random(2) * 2.0 - 1.0
        length = x * x + y * y
        if 1e-4 < length <= 1.0:
            norm = math.sqrt(length)
            return x / norm, y / norm


def draw(shape: int, image_id: int) -> np.ndarray:
    """One ``SIZE`` x ``SIZE`` uint8 image of ``shape``, a function of the id alone (its own generator)."""
    rng = np.random.default_rng([SPLIT_SEED, image_id])
    radius = 4.5 + 2.5 * rng.random()
    cx, cy = SIZE / 2.0 + (rng.random(2) * 2.0 - 1.0) * (SIZE / 2.0 - radius - 0.5)
    c, s = _unit_vector(rng)  # the rotation
    qx, qy = _SAMPLES[None, :] - cx, _SAMPLES[:, None] - cy
    px, py = (c * qx + s * qy) / radius, (c * qy - s * qx) / radius
    covered = _inside(shape, px, py)
    background = 0.15 + 0.6 * rng.random()
    contrast = (0.35 + 0.35 * rng.random()) * (1.0 if background < 0.45 else -1.0)
    striped = np.zeros(px.shape, dtype=bool)
    if rng.random() < 0.5:  # stripes across the shape, of a random direction and period, at half the contrast
        sx, sy = _unit_vector(rng)
        period = 0.35 + 0.4 * rng.random()
        striped = np.floor((sx * px + sy * py) / period) % 2 == 1
    # a pixel: the mean over its points of the shape's level where covered (the stripes' where striped) and the
    # background elsewhere, from integer counts of each (so no sum of floats, whose order could vary)
    blocks = SIZE, SUPERSAMPLE, SIZE, SUPERSAMPLE
    plain = (covered & ~striped).reshape(blocks).sum(axis=(1, 3))
    stripes = (covered & striped).reshape(blocks).sum(axis=(1, 3))
    uncovered = SUPERSAMPLE ** 2 - plain - stripes
    gx, gy = (rng.random(2) * 2.0 - 1.0) * 0.02  # a background gradient, per pixel
    centres = np.arange(SIZE, dtype=np.float64) - (SIZE - 1) / 2.0
    behind = background + gx * centres[None, :] + gy * centres[:, None]
    image = (plain * (background + contrast) + stripes * (background + 0.5 * contrast)
             + uncovered * behind) / SUPERSAMPLE ** 2
    if rng.random() < 0.3:  # a distracting dot, somewhere
        dx, dy = rng.random(2) * (SIZE - 2) + 1.0
        dot = (centres[None, :] + (SIZE - 1) / 2.0 - dx) ** 2 + (centres[:, None] + (SIZE - 1) / 2.0 - dy) ** 2 <= 1.2
        image = np.where(dot, background + contrast * (0.5 + 0.5 * rng.random()), image)
    noise = 0.02 + 0.08 * rng.random()
    image = image + (rng.random((SIZE, SIZE)) * 2.0 - 1.0) * noise
    return np.rint(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)


def make_rows() -> dict[str, dict[str, np.ndarray]]:
    """Every split's images (``x``: float32 of shape (rows, 1, SIZE, SIZE)), classes and ids; the ids are
    consecutive over the splits in the order of ``PER_CLASS``, class by class."""
    rows, next_id = {}, 0
    for split, counts in PER_CLASS.items():
        images, classes, ids = [], [], []
        for shape, count in sorted(counts.items()):
            for image_id in range(next_id, next_id + count):
                images.append(draw(shape, image_id))
                classes.append(shape)
                ids.append(image_id)
            next_id += count
        x = (np.stack(images).astype(np.float32) / np.float32(255.0))[:, None]
        rows[split] = {"x": x, "y": np.asarray(classes, dtype=np.int64), "ids": np.asarray(ids, dtype=np.int64)}
    return rows


class Shapes(Task):
    name = "shapes"
    Config = ShapesConfig
    metrics = {"correct": "higher", "total": "count", "loss": "lower"}
    splits = ("train", "development", "selection", "retention")

    # -- built-in data ---------------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        folder = Path(folder)
        rows = make_rows()
        data_folder = Path("data") / "shapes"
        parent_folder = Path("parents") / "shapes"
        # the arms' training file: the new shapes' rows, then a replay pool of the parent's rows, flagged replay
        pool = self._replay_pool(rows["parent"])
        replayed = {key: value[pool] for key, value in rows["parent"].items()}
        train = {key: np.concatenate([rows["new"][key], replayed[key]]) for key in ("x", "y", "ids")}
        train["replay"] = np.concatenate([np.zeros(len(rows["new"]["ids"]), bool), np.ones(len(pool), bool)])
        paths = {"train": data_folder / "train.npz"}
        write_arrays(folder / paths["train"], train)
        for split in ("development", "selection", "retention"):
            paths[split] = data_folder / f"{split}.npz"
            write_arrays(folder / paths[split], rows[split])
        for seed in seeds:
            state = self._train_parent(rows["parent"], seed)
            checkpoints.save(folder / parent_folder / f"seed-{seed}.pt", state, kind="parent",
                             meta={"task": "shapes", "seed": int(seed), "classes": [SHAPES[c] for c in OLD],
                                   "updates": self.config.parent_updates})
        return {"data": {k: str(v) for k, v in paths.items()}, "parents": str(parent_folder / "seed-{seed}.pt")}

    def _replay_pool(self, parent_rows: dict[str, np.ndarray]) -> np.ndarray:
        """Positions in the parent's rows of ``replay_per_class`` rows of each old shape."""
        rng = np.random.default_rng([SPLIT_SEED, STREAM_REPLAY])
        pool = [rng.choice(np.flatnonzero(parent_rows["y"] == shape), size=self.config.replay_per_class,
                           replace=False) for shape in OLD]
        return np.sort(np.concatenate(pool))

    def _train_parent(self, rows: dict[str, np.ndarray], seed: int) -> dict:
        """AdamW, then the rate cosine-decayed to a hundredth: the parent should know its four shapes well, so
        that forgetting them is visible."""
        config = self.config
        with torch_threads(1):
            model = build_model(config, seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=config.parent_lr, weight_decay=0.01)
            x, y = torch.from_numpy(rows["x"]), torch.from_numpy(rows["y"])
            size = min(config.parent_batch, len(y))
            for update in range(config.parent_updates):
                progress = update / max(1, config.parent_updates - 1)
                for group in optimizer.param_groups:
                    group["lr"] = config.parent_lr * (0.01 + 0.495 * (1.0 + math.cos(math.pi * progress)))
                rng = np.random.default_rng([int(seed), STREAM_PARENT, update])
                index = torch.from_numpy(rng.choice(len(y), size=size, replace=False))
                loss = F.cross_entropy(model(x[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return model.state_dict()

    # -- the interface the driver uses -------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        splits = {}
        for split, path in data_paths.items():
            path = Path(path)
            required = ("x", "y", "ids", "replay") if split == "train" else ("x", "y", "ids")
            arrays = read_arrays(path, required)
            x, y, ids = arrays["x"], arrays["y"], arrays["ids"]
            if (x.dtype != np.float32 or x.shape[1:] != (1, SIZE, SIZE) or y.dtype != np.int64
                    or y.shape != (len(x),) or ids.shape != (len(x),)
                    or (len(y) and (y.min() < 0 or y.max() >= len(SHAPES)))):
                raise BadInput(f"data file {path} is not a shapes split (float32 images of 1 x {SIZE} x {SIZE} and "
                               f"one class of {len(SHAPES)} each); it was prepared for another task")
            splits[split] = arrays
        return splits

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        return model_from_parent(build_model, self.config, expected_shapes(self.config), parent_path, seed, device)

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        return ReplaySampler(train, seed, batch_size, self.config.replay_share, device,
                             task="shapes", new_rows="new-shape rows", stream=STREAM_TRAIN)

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        return F.cross_entropy(model(batch.inputs), batch.targets), {}

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        return classification_metrics(model, rows)
